"""OCI runtime-spec pieces: load a bundle's config.json, edit it, save it atomically;
parse the state a hook gets on stdin.

Edits work on the parsed JSON as plain dicts, so every field nvctk does not know
(annotations, seccomp, future spec fields, vendor extensions) is written back
untouched and in its original order. Every edit is idempotent: running the shim
twice on one bundle yields the same file as running it once.
"""

from __future__ import annotations

import os

from nvctk import jsonio
from nvctk.errors import SpecError, SpecShapeError, shown
from nvctk.fileio import atomic_write
from nvctk.record import Record

# typing is for the type checker only: importing it costs every container start
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

    from nvctk.plan import DeviceNode

SPEC_FILE = "config.json"
CAP_SYS_ADMIN = "CAP_SYS_ADMIN"

# Hooks that Docker's --gpus (and NVIDIA's own runtime) put into specs: we replace them.
NVIDIA_HOOK_NAMES = frozenset({"nvidia-container-runtime-hook", "nvidia-container-toolkit"})
OUR_HOOK_NAME = "nvctk-hook"
HOOK_PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# --- spec ----------------------------------------------------------------------------


def spec_path(bundle: str) -> str:
    return os.path.join(bundle, SPEC_FILE)


# far above any real spec (runc's own are a few KiB; a big pod's, tens)
MAX_SPEC_BYTES = 64 << 20


def read_spec(bundle: str) -> bytes:
    """The bytes of the bundle's config.json, read without ever blocking (a FIFO,
    device or socket is refused unread); SpecError naming the file when unusable."""
    from nvctk.fileio import NotRegularFile, read_regular_file

    path = spec_path(bundle)
    try:
        return read_regular_file(path, MAX_SPEC_BYTES)
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file (is {bundle} an OCI bundle?)")
    except NotRegularFile:
        raise SpecError(f"{path}: not a regular file")
    except ValueError:
        raise SpecError(f"{path!r}: the bundle path holds a NUL character")
    except OSError as e:
        raise SpecError(f"{path}: cannot read: {e.strerror or e}")


def load_spec(bundle: str) -> dict[str, Any]:
    """The bundle's config.json as a dict; SpecError naming the file when unusable."""
    return parse_spec(read_spec(bundle), spec_path(bundle))


def load_spec_as_runc(bundle: str) -> dict[str, Any]:
    """load_spec, but a byte that is not UTF-8 reads as U+FFFD, as runc (Go) reads
    it: the hooks see the spec runc runs (the shim refuses such a GPU spec)."""
    data = read_spec(bundle)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return parse_spec(data.decode("utf-8", "replace"), spec_path(bundle))
    return parse_spec(data, spec_path(bundle))


def parse_spec(data: bytes | str, where: str = SPEC_FILE) -> dict[str, Any]:
    try:
        spec = jsonio.loads(data)
    except UnicodeDecodeError as e:
        raise SpecError(f"{where}: not UTF-8 (invalid byte at offset {e.start})")
    except ValueError as e:
        raise SpecError(f"{where}: invalid JSON: {e}")
    except RecursionError:
        raise SpecError(f"{where}: JSON nested too deeply for nvctk to read")
    if not isinstance(spec, dict):
        raise SpecShapeError(f"{where}: the spec must be a JSON object, not {type(spec).__name__}")
    for key, kind in (("process", dict), ("linux", dict), ("root", dict), ("hooks", dict),
                      ("mounts", list), ("annotations", dict)):
        if key in spec and spec[key] is not None and not isinstance(spec[key], kind):
            raise SpecShapeError(f"{where}: {key} must be a JSON {kind.__name__.replace('dict', 'object')}")
    process = spec.get("process") or {}
    env = process.get("env")
    if env is not None and (
        not isinstance(env, list) or not all(isinstance(e, str) for e in env)
    ):
        raise SpecShapeError(f"{where}: process.env must be a list of strings")
    return spec


def dump_spec(spec: dict[str, Any]) -> bytes:
    # runc and containerd write compact JSON; indenting would only cost bytes
    try:
        return jsonio.dumps(spec, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise SpecError(f"{SPEC_FILE}: {_surrogate_message(spec)}")
    except RecursionError:
        raise SpecError(f"{SPEC_FILE}: JSON nested too deeply for nvctk to rewrite")


# --- what nvctk cannot rewrite, or must not run ------------------------------------------

# Text in a spec that may make it a GPU container's (env names, the device-mount
# directory, CDI annotations): looked for in the raw bytes of a spec nvctk cannot parse
GPU_MARKERS = (b"NVIDIA_VISIBLE_DEVICES", b"CUDA_VERSION", b"nvidia-container-devices",
               b"cdi.k8s.io")


def gpu_marker(data: bytes) -> str | None:
    """The first GPU_MARKERS entry in a spec's raw bytes (JSON \\u escapes of ASCII
    undone first, so "NVIDIA\\u005fVISIBLE_DEVICES" counts), or None."""
    if b"\\u" in data:
        parts = data.split(b"\\u")
        out = [parts[0]]
        for part in parts[1:]:
            code = part[:4]
            if len(code) == 4 and all(c in b"0123456789abcdefABCDEF" for c in code) \
                    and int(code, 16) < 0x80:
                out.append(bytes([int(code, 16)]) + part[4:])
            else:
                out.append(b"\\u" + part)
        data = b"".join(out)
    for marker in GPU_MARKERS:
        if marker in data:
            return marker.decode()
    return None


def _has_surrogate(text: str) -> bool:
    return any("\ud800" <= c <= "\udfff" for c in text)


def _surrogate_path(value: Any, path: str) -> str | None:
    """Where in a parsed spec a string holds a lone UTF-16 surrogate (a JSON
    "\\ud800" escape), for the message: "process.env[3]", "annotations[\"k\"]"."""
    if isinstance(value, str):
        return path if _has_surrogate(value) else None
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _surrogate_path(item, f"{path}[{i}]")
            if found:
                return found
    elif isinstance(value, dict):
        for k, item in value.items():
            key = f"{path}[{k!r}]" if path else repr(k)
            if _has_surrogate(k):
                return f"a key of {path or 'the spec'}"
            found = _surrogate_path(item, f"{path}.{k}" if path and k.isidentifier()
                                    else key if path else k)
            if found:
                return found
    return None


def _surrogate_message(spec: dict[str, Any]) -> str:
    where = _surrogate_path(spec, "") or "a string"
    env = (spec.get("process") or {}).get("env")
    if where.startswith("process.env[") and isinstance(env, list):
        i = int(where[len("process.env["):].split("]", 1)[0])
        name = env[i].partition("=")[0] if isinstance(env[i], str) else ""
        if name and not _has_surrogate(name):
            where += f" ({name})"
    return (f"{where} holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is not "
            "text: nvctk cannot write it back into a GPU container's spec")


def check_rewritable(spec: dict[str, Any], data: bytes) -> None:
    """SpecError naming the field when nvctk could not write `spec` (parsed from
    `data`) back: a lone surrogate escape. Costs a scan of the bytes, nothing more,
    when the spec has no \\uD8xx-\\uDFxx escape at all."""
    low = data.lower()
    if not any(b"\\u" + d in low for d in (b"d8", b"d9", b"da", b"db", b"dc", b"dd", b"de",
                                              b"df")):
        return
    if _surrogate_path(spec, ""):
        raise SpecError(f"{SPEC_FILE}: {_surrogate_message(spec)}")


def user_namespace(spec: dict[str, Any]) -> str | None:
    """What makes the container run in a user namespace (for the message), or None."""
    linux = spec.get("linux")
    if not isinstance(linux, dict):
        return None
    namespaces = linux.get("namespaces")
    if isinstance(namespaces, list) and any(
        isinstance(n, dict) and n.get("type") == "user" for n in namespaces
    ):
        return 'linux.namespaces has a "user" namespace'
    for key in ("uidMappings", "gidMappings"):
        if linux.get(key):
            return f"linux.{key} is set"
    return None


def save_spec(bundle: str, spec: dict[str, Any]) -> None:
    atomic_write(spec_path(bundle), dump_spec(spec))


# --- reading the spec -------------------------------------------------------------------


def spec_env(spec: dict[str, Any]) -> dict[str, str]:
    """process.env as a dict; a later duplicate wins (as NVIDIA's toolkit reads it)."""
    out: dict[str, str] = {}
    for item in (spec.get("process") or {}).get("env") or ():
        key, sep, value = item.partition("=")
        if sep:
            out[key] = value
    return out


def is_privileged(spec: dict[str, Any]) -> bool:
    """CAP_SYS_ADMIN in the process's bounding set: NVIDIA's definition of privileged."""
    caps = (spec.get("process") or {}).get("capabilities")
    if not isinstance(caps, dict):
        return False
    bounding = caps.get("bounding") or ()
    return CAP_SYS_ADMIN in bounding


def root_path(spec: dict[str, Any], bundle: str) -> str:
    """The rootfs as an absolute host path (root.path may be relative to the bundle)."""
    root = spec.get("root") or {}
    path = root.get("path")
    if not isinstance(path, str) or not path:
        raise SpecError(f"{spec_path(bundle)}: root.path is missing")
    if "\0" in path:
        raise SpecError(f"{spec_path(bundle)}: root.path holds a NUL character")
    return os.path.normpath(os.path.join(bundle, path))


def bundle_in_rootfs(bundle: str, rootfs: str) -> bool:
    """Whether the bundle dir lies inside the rootfs (root.path "." or ".." of it):
    the container could then rewrite config.json and nvctk's plan beside it."""
    b, r = os.path.realpath(bundle), os.path.realpath(rootfs)
    return b == r or b.startswith(r.rstrip("/") + "/")


def spec_mounts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in spec.get("mounts") or () if isinstance(m, dict)]


# --- editing ------------------------------------------------------------------------------


def _field(parent: dict[str, Any], key: str, kind: type, where: str) -> Any:
    """parent[key], created empty when absent or null; SpecError naming the field
    when it has another type: nvctk never "repairs" a spec runc would refuse into
    one it accepts (dropping what the user wrote there)."""
    value = parent.get(key)
    if value is None:
        value = parent[key] = kind()
    elif not isinstance(value, kind):
        raise SpecError(f"{SPEC_FILE}: {where} must be {_json_type(kind())}, not "
                        f"{_json_type(value)}")
    return value


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _linux(spec: dict[str, Any]) -> dict[str, Any]:
    linux: dict[str, Any] = _field(spec, "linux", dict, "linux")
    return linux


def device_entry(node: DeviceNode) -> dict[str, Any]:
    return {
        "path": node.path,
        "type": node.type,
        "major": node.major,
        "minor": node.minor,
        "fileMode": node.file_mode,
        "uid": 0,
        "gid": 0,
    }


def cgroup_rule(node: DeviceNode) -> dict[str, Any]:
    return {
        "allow": True,
        "type": node.type,
        "major": node.major,
        "minor": node.minor,
        "access": "rwm",
    }


def check_editable(spec: dict[str, Any]) -> None:
    """SpecError naming the first field nvctk edits that has the wrong type, before
    anything is planned (add_devices, set_hook, set_env check again as they edit)."""
    linux = spec.get("linux")
    if isinstance(linux, dict):
        _check_kind(linux, "devices", list, "linux.devices")
        resources = _check_kind(linux, "resources", dict, "linux.resources")
        if isinstance(resources, dict):
            _check_kind(resources, "devices", list, "linux.resources.devices")
    hooks = spec.get("hooks")
    if isinstance(hooks, dict):
        for stage in ("prestart", "poststop"):
            _check_kind(hooks, stage, list, f"hooks.{stage}")
    problem = edits_record_problem(spec)
    if problem is not None:
        raise SpecError(f"{SPEC_FILE}: {problem} (nvctk's record of what an earlier create "
                        "added; take the annotation out)")


def _check_kind(parent: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = parent.get(key)
    if value is not None and not isinstance(value, kind):
        raise SpecError(f"{SPEC_FILE}: {where} must be {_json_type(kind())}, not "
                        f"{_json_type(value)}")
    return value


def add_devices(spec: dict[str, Any], nodes: Iterable[DeviceNode]) -> Edits:
    """linux.devices (runc creates the nodes) + linux.resources.devices allow rules.

    An entry for the same container path is replaced, an identical rule is not
    added again, so repeated creates do not grow the spec. Returns what was added
    (for record_edits: the next create removes exactly that).
    """
    linux = _linux(spec)
    devices = _field(linux, "devices", list, "linux.devices")
    resources = _field(linux, "resources", dict, "linux.resources")
    rules = _field(resources, "devices", list, "linux.resources.devices")
    added = Edits()
    for node in nodes:
        entry = device_entry(node)
        for i, d in enumerate(devices):
            if isinstance(d, dict) and d.get("path") == node.path:
                if d == entry:  # the user's own (ours went with the earlier create's record)
                    break
                devices[i] = entry
                added.devices.append([node.path, node.type, node.major, node.minor])
                break
        else:
            devices.append(entry)
            added.devices.append([node.path, node.type, node.major, node.minor])
        rule = cgroup_rule(node)
        if rule not in rules:
            rules.append(rule)
            added.rules.append([node.type, node.major, node.minor])
    return added


# --- what an earlier create added ---------------------------------------------------------

# The annotation in which a GPU create records the spec entries it added, so that the
# next create of the same bundle (reused, its request changed) removes exactly those.
EDITS_ANNOTATION = "org.nvctk.edits"
# Only entries of these shapes are ever removed, whatever the annotation says: removing
# an NVIDIA device node, an allow rule or a variable nvctk sets only takes access away.
_OUR_DEVICE_PREFIX = "/dev/nvidia"
OUR_ENV_PREFIXES = ("CUDA_DEVICE_", "NVCTK_")


class Edits(Record):
    """The entries one create added: device nodes and allow rules as
    [path, type, major, minor] / [type, major, minor], env entries as "K=V"; in CDI
    mode (cdi True) also spec mounts as the entries added, hooks as [stage, entry]."""

    __slots__ = ("devices", "rules", "env", "seccomp", "mounts", "hooks", "cdi")  # noqa: RUF023

    def __init__(self, devices: list[list[Any]] | None = None,
                 rules: list[list[Any]] | None = None, env: list[str] | None = None,
                 seccomp: dict[str, Any] | None = None,
                 mounts: list[dict[str, Any]] | None = None,
                 hooks: list[list[Any]] | None = None, cdi: bool = False) -> None:
        self.devices: list[list[Any]] = [] if devices is None else devices
        self.rules: list[list[Any]] = [] if rules is None else rules
        self.env: list[str] = [] if env is None else env
        # block_user_namespaces: {"created": bool, "syscalls": [rules added]}, or None
        self.seccomp = seccomp
        self.mounts: list[dict[str, Any]] = [] if mounts is None else mounts
        self.hooks: list[list[Any]] = [] if hooks is None else hooks
        # the entries came from CDI specs: any device path, env name, rule access
        self.cdi = cdi


def record_edits(spec: dict[str, Any], edits: Edits, state_dir: str | None = None) -> None:
    """The record into the annotation; a CDI record (it may remove any entry) carries a
    MAC keyed by <state_dir>/edits.key, so that no spec's author can forge one."""
    annotations = _field(spec, "annotations", dict, "annotations")
    record: dict[str, Any] = {"devices": edits.devices, "rules": edits.rules, "env": edits.env}
    if edits.seccomp is not None:  # vGPU only: other GPU containers' records stay as they were
        record["seccomp"] = edits.seccomp
    if edits.cdi:  # CDI only: legacy records stay as they were
        if state_dir is None:
            raise ValueError("a CDI record needs the state dir of its key")
        record.update(cdi=True, mounts=edits.mounts, hooks=edits.hooks)
        key = edits_key(state_dir, create=True)
        assert key is not None  # create: made, or an error
        record["mac"] = _record_mac(record, key)
    annotations[EDITS_ANNOTATION] = jsonio.dumps(record)


EDITS_KEY_FILE = "edits.key"
_KEY_BYTES = 32


def _record_mac(record: dict[str, Any], key: bytes) -> str:
    """blake2b keyed MAC of the record's canonical JSON (without its "mac")."""
    import hashlib  # CDI records only: the legacy create path never needs it

    body = jsonio.dumps({k: v for k, v in record.items() if k != "mac"}, sort_keys=True)
    return hashlib.blake2b(body.encode(), key=key, digest_size=32).hexdigest()


def edits_key(state_dir: str, create: bool = False) -> bytes | None:
    """The key of CDI records' MACs, <state_dir>/edits.key: 32 random bytes, made on
    first use (create) with O_EXCL via link(), so a racing create never reads half a
    key. None when there is none and create is False. A key file that is not a regular
    0600 file of ours, 32 bytes long, is refused (SpecError): anyone else who could
    write it could forge records."""
    path = os.path.join(state_dir, EDITS_KEY_FILE)
    if create and not os.path.lexists(path):
        os.makedirs(state_dir, 0o755, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.write(fd, os.urandom(_KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another create made it first: its key is the key
        finally:
            os.unlink(tmp)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
                     | os.O_CLOEXEC)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as e:
        raise SpecError(f"{path}: {e.strerror} (nvctk's key of CDI edit records)")
    try:
        st = os.fstat(fd)
        if (st.st_mode & 0o170000) != 0o100000 or st.st_mode & 0o7777 != 0o600 \
                or st.st_uid != os.geteuid() or st.st_size != _KEY_BYTES:
            raise SpecError(f"{path}: not a regular 0600 file of {_KEY_BYTES} bytes owned by "
                            f"uid {os.geteuid()}; nvctk refuses it as the key of its CDI edit "
                            "records (remove it: the next CDI create makes a new one)")
        key = os.read(fd, _KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != _KEY_BYTES:
        raise SpecError(f"{path}: a short key file; remove it")
    return key


def cdi_record_problem(spec: dict[str, Any], state_dir: str | None) -> str | None:
    """Why the annotation's CDI record is not honoured (None: no CDI record, or one
    whose MAC is valid): a record nvctk did not write could remove any hook, mount,
    variable or device of the spec."""
    annotations = spec.get("annotations")
    if not isinstance(annotations, dict) or not isinstance(annotations.get(EDITS_ANNOTATION), str):
        return None
    try:
        rec = jsonio.loads(annotations[EDITS_ANNOTATION])
    except (ValueError, RecursionError):
        return None  # edits_record_problem says so
    if not isinstance(rec, dict) or "cdi" not in rec:
        return None
    where = f"annotations[{EDITS_ANNOTATION!r}]"
    mac = rec.get("mac")
    if not isinstance(mac, str):
        return f"{where}: a CDI record without nvctk's MAC (not written by nvctk); ignored"
    if state_dir is None:
        return f"{where}: a CDI record nvctk cannot check (no config); ignored"
    try:
        key = edits_key(state_dir)
    except SpecError as e:
        return f"{where}: a CDI record nvctk cannot check ({e}); ignored"
    if key is None:
        return f"{where}: a CDI record nvctk cannot check (no {EDITS_KEY_FILE} in {state_dir}); ignored"
    import hmac

    try:
        good = _record_mac(rec, key)
    except (ValueError, RecursionError, TypeError):
        return f"{where}: a CDI record nvctk cannot serialize; ignored"
    if not hmac.compare_digest(good, mac):
        return f"{where}: a CDI record with a wrong MAC (not written by nvctk); ignored"
    return None


def has_our_edits(spec: dict[str, Any]) -> bool:
    """Whether an earlier create left nvctk's entries in the spec (cheap: no-GPU
    creates ask this, and rewrite the spec only when it is true)."""
    annotations = spec.get("annotations")
    if isinstance(annotations, dict) and EDITS_ANNOTATION in annotations:
        return True
    hooks = spec.get("hooks")
    if not isinstance(hooks, dict):
        return False
    return any(
        isinstance(hooks.get(stage), list) and any(is_our_hook(h, stage) for h in hooks[stage])
        for stage in ("prestart", "poststop")
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# the record's fields and the shape of each entry (record_edits writes these only)
_RECORD_SHAPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "devices": (lambda e: isinstance(e, list) and len(e) == 4 and isinstance(e[0], str)
                and isinstance(e[1], str) and _is_int(e[2]) and _is_int(e[3]),
                "[path, type, major, minor]"),
    "rules": (lambda e: isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)
              and _is_int(e[1]) and _is_int(e[2]), "[type, major, minor]"),
    "env": (lambda e: isinstance(e, str), "a string"),
    "mounts": (lambda e: isinstance(e, dict), "an object"),
    "hooks": (lambda e: isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
              and isinstance(e[1], dict), "[stage, hook]"),
}


def edits_record_problem(spec: dict[str, Any]) -> str | None:
    """What is wrong with the org.nvctk.edits annotation, or None (absent or well
    formed). Strict: remove_our_edits acts on it only when it is exactly what
    record_edits writes."""
    annotations = spec.get("annotations")
    if not isinstance(annotations, dict) or EDITS_ANNOTATION not in annotations:
        return None
    where = f"annotations[{EDITS_ANNOTATION!r}]"
    raw = annotations[EDITS_ANNOTATION]
    if not isinstance(raw, str):
        return f"{where} must be a string, not {_json_type(raw)}"
    try:
        rec = jsonio.loads(raw)
    except (ValueError, RecursionError):
        return f"{where}: not valid JSON"
    if not isinstance(rec, dict):
        return f"{where} must hold a JSON object, not {_json_type(rec)}"
    for key, value in rec.items():
        if key == "seccomp":
            if not isinstance(value, dict):
                return f"{where}: seccomp must be an object, not {_json_type(value)}"
            continue  # _remove_userns_rules acts only on what matches nvctk's own rules
        if key == "mac":
            if not isinstance(value, str):
                return f"{where}: mac must be a string, not {_json_type(value)}"
            continue
        if key == "cdi":
            if not isinstance(value, bool):
                return f"{where}: cdi must be true or false, not {_json_type(value)}"
            continue
        if key not in _RECORD_SHAPES:
            return f"{where}: unknown field {shown(key)}"
        ok, shape = _RECORD_SHAPES[key]
        if not isinstance(value, list):
            return f"{where}: {key} must be a list, not {_json_type(value)}"
        for entry in value:
            if not ok(entry):
                # no repr(): an entry may be nested deep or hold a 5000-digit number
                what = f"an array of {len(entry)}" if isinstance(entry, list) else _json_type(entry)
                return f"{where}: a {key} entry must be {shape}, not {what}"
    return None


def _recorded(annotations: Any) -> dict[str, Any]:
    if not isinstance(annotations, dict):
        return {}
    raw = annotations.pop(EDITS_ANNOTATION, None)
    if not isinstance(raw, str):
        return {}
    try:
        rec = jsonio.loads(raw)
    except (ValueError, RecursionError):
        return {}
    return rec if isinstance(rec, dict) else {}


def _as_keys(items: Any, size: int) -> list[tuple[Any, ...]]:
    if not isinstance(items, list):
        return []
    # _hashable: a malformed record must not raise TypeError (edits_record_problem
    # refuses one before this runs; this is the second line)
    return [_hashable(tuple(i)) for i in items if isinstance(i, list) and len(i) == size]


def remove_our_edits(spec: dict[str, Any], state_dir: str | None = None) -> None:
    """Take out what an earlier create added: nvctk's prestart/poststop hooks, and the
    device nodes, allow rules and env entries its annotation records (only of the
    shapes nvctk adds: see OUR_ENV_PREFIXES). Everyone else's entries stay in order.
    A CDI record is acted on only with a valid MAC (cdi_record_problem, keyed in
    state_dir); any other record with "cdi" is ignored whole."""
    # emptied lists and objects stay: a GPU create that follows then refills them in
    # place, and writes the same bytes as the first create did
    unverified = cdi_record_problem(spec, state_dir) is not None
    rec = _recorded(spec.get("annotations"))
    if unverified:
        rec = {}
    # a CDI spec's entries are any device, variable or access: removing them still only
    # takes away what the record says this create's request added
    cdi = rec.get("cdi") is True
    hooks = spec.get("hooks")
    if isinstance(hooks, dict):
        for stage in ("prestart", "poststop"):
            entries = hooks.get(stage)
            if isinstance(entries, list):
                hooks[stage] = [h for h in entries if not is_our_hook(h, stage)]
        if cdi:
            _remove_recorded(hooks, rec.get("hooks"))
    if cdi and isinstance(spec.get("mounts"), list) and isinstance(rec.get("mounts"), list):
        gone = list(rec["mounts"])
        spec["mounts"] = [m for m in spec["mounts"] if not _take(gone, m)]
    devices = set(_as_keys(rec.get("devices"), 4))
    rules = set(_as_keys(rec.get("rules"), 3))
    env = rec.get("env")
    env_entries = {e for e in env if isinstance(e, str)
                   and (cdi or e.startswith(OUR_ENV_PREFIXES))} if isinstance(env, list) else set()
    device_prefix = "/" if cdi else _OUR_DEVICE_PREFIX
    linux = spec.get("linux")
    if isinstance(linux, dict):
        if devices and isinstance(linux.get("devices"), list):
            linux["devices"] = [
                d for d in linux["devices"]
                if not (isinstance(d, dict) and str(d.get("path", "")).startswith(device_prefix)
                        and _hashable((d.get("path"), d.get("type"), d.get("major"),
                                       d.get("minor"))) in devices)
            ]
        resources = linux.get("resources")
        if rules and isinstance(resources, dict) and isinstance(resources.get("devices"), list):
            resources["devices"] = [
                r for r in resources["devices"]
                if not (isinstance(r, dict) and r.get("allow") is True
                        and (r.get("access") == "rwm" or (cdi and isinstance(r.get("access"), str)))
                        and set(r) == {"allow", "type", "major", "minor", "access"}
                        and _hashable((r.get("type"), r.get("major"), r.get("minor"))) in rules)
            ]
    process = spec.get("process")
    if env_entries and isinstance(process, dict) and isinstance(process.get("env"), list):
        process["env"] = [e for e in process["env"] if e not in env_entries]
    _remove_userns_rules(spec, rec.get("seccomp"))


def _take(recorded: list[Any], entry: Any) -> bool:
    """Whether entry is one of recorded (then used up: each record entry removes one)."""
    for i, r in enumerate(recorded):
        if r == entry:
            del recorded[i]
            return True
    return False


def _remove_recorded(hooks: dict[str, Any], recorded: Any) -> None:
    """CDI hooks a create added ([stage, entry] each) out of hooks.<stage>."""
    if not isinstance(recorded, list):
        return
    by_stage: dict[str, list[Any]] = {}
    for item in recorded:
        if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str):
            by_stage.setdefault(item[0], []).append(item[1])
    for stage, gone in by_stage.items():
        if isinstance(hooks.get(stage), list):
            hooks[stage] = [h for h in hooks[stage] if not _take(gone, h)]


def _hashable(key: tuple[Any, ...]) -> tuple[Any, ...]:
    # a spec's values may be lists or objects where numbers belong: never in our set
    return tuple(k if isinstance(k, (str, int, float, bool)) or k is None else repr(k)
                 for k in key)


def hook_entry(hook_path: str, timeout: int, nvctk_config: str | None) -> dict[str, Any]:
    """Our prestart hook. Its env is built here from scratch: never the container's
    (a container's LD_PRELOAD reaching a host-side hook was CVE-2025-23266)."""
    env = [HOOK_PATH_ENV]
    if nvctk_config:
        env.append(f"NVCTK_CONFIG={nvctk_config}")
    return {
        "path": hook_path,
        "args": [OUR_HOOK_NAME, "prestart"],
        "env": env,
        "timeout": timeout,
    }


def is_nvidia_hook(hook: Any) -> bool:
    """Docker's --gpus hook or NVIDIA's runtime hook (by path or args[0] basename)."""
    if not isinstance(hook, dict):
        return False
    names = {os.path.basename(str(hook.get("path", "")))}
    args = hook.get("args")
    if isinstance(args, list) and args:
        names.add(os.path.basename(str(args[0])))
    return bool(names & NVIDIA_HOOK_NAMES)


def is_our_hook(hook: Any, kind: str = "prestart") -> bool:
    if not isinstance(hook, dict):
        return False
    args = hook.get("args")
    if not (isinstance(args, list) and len(args) >= 2 and args[1] == kind):
        return False
    # we always write args[0] = nvctk-hook; the path's name depends on hook-path
    return OUR_HOOK_NAME in (os.path.basename(str(hook.get("path", ""))), args[0])


def remove_nvidia_hooks(spec: dict[str, Any]) -> int:
    """Drop NVIDIA's/Docker's GPU hooks from every hook list; returns how many."""
    hooks = spec.get("hooks")
    if not isinstance(hooks, dict):
        return 0
    removed = 0
    for name, entries in list(hooks.items()):
        if isinstance(entries, list):
            kept = [h for h in entries if not is_nvidia_hook(h)]
            removed += len(entries) - len(kept)
            hooks[name] = kept
    return removed


def set_hook(spec: dict[str, Any], hook: dict[str, Any], stage: str = "prestart") -> None:
    """Put `hook` in hooks.<stage>, replacing an earlier nvctk hook of the same kind
    (so a second create does not run the hook twice) and keeping everyone else's."""
    hooks = _field(spec, "hooks", dict, "hooks")
    entries = _field(hooks, stage, list, f"hooks.{stage}")
    kind = hook["args"][1]
    kept = [h for h in entries if not is_our_hook(h, kind)]
    kept.append(hook)
    hooks[stage] = kept


def set_env(spec: dict[str, Any], env: dict[str, str]) -> None:
    """Set process.env keys (replacing every earlier occurrence of each key)."""
    if not env:
        return
    process = _field(spec, "process", dict, "process")
    current = [e for e in _field(process, "env", list, "process.env")
               if not (isinstance(e, str) and e.partition("=")[0] in env)]
    process["env"] = current + [f"{k}={v}" for k, v in env.items()]


# --- vGPU: no new user namespace -----------------------------------------------------------

# In a user namespace of its own, a process holds CAP_SYS_ADMIN over a mount namespace of
# its own: there it can mount over /etc/ld.so.preload or /run/nvctk and run CUDA without its
# cap. Docker's default seccomp profile refuses new user namespaces; runc's default spec (and
# so a plain runc or containerd container) has no profile at all.
CLONE_NEWUSER = 0x10000000
_EPERM = 1
_ENOSYS = 38
_SCMP_ALLOW = "SCMP_ACT_ALLOW"
_SCMP_ERRNO = "SCMP_ACT_ERRNO"
# actions that fail a call whatever its arguments: a rule with one lets nothing through
_SCMP_REFUSING = frozenset({_SCMP_ERRNO, "SCMP_ACT_KILL", "SCMP_ACT_KILL_PROCESS",
                            "SCMP_ACT_KILL_THREAD", "SCMP_ACT_TRAP"})
_USERNS_SYSCALLS = ("unshare", "clone", "clone3")
# The ABIs a process of this machine can call the kernel through, as runc's and Docker's
# profiles list them: the rules then also cover a syscall made through int 0x80 on x86-64
_SECCOMP_ARCHES = {
    "x86_64": ("SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"),
    "aarch64": ("SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"),
    "ppc64le": ("SCMP_ARCH_PPC64LE",),
    "s390x": ("SCMP_ARCH_S390X", "SCMP_ARCH_S390"),
}


def _flags_index(name: str, machine: str) -> int:
    # the flags come first, but for clone on s390 (its stack pointer does there)
    return 1 if name == "clone" and machine.startswith("s390") else 0


def _newuser(index: int, datum: int) -> dict[str, Any]:
    """The comparison "CLONE_NEWUSER set" (datum CLONE_NEWUSER) or "clear" (datum 0)."""
    return {"index": index, "value": CLONE_NEWUSER, "valueTwo": datum,
            "op": "SCMP_CMP_MASKED_EQ"}


def userns_rules(machine: str | None = None) -> list[dict[str, Any]]:
    """Seccomp rules that make creating a user namespace fail: unshare and clone with
    CLONE_NEWUSER in their flags get EPERM; clone3 gets ENOSYS, as under Docker's
    profile (its flags sit in memory seccomp cannot read; glibc then falls back to clone)."""
    machine = machine or os.uname().machine
    rules: list[dict[str, Any]] = [
        {"names": [name], "action": _SCMP_ERRNO, "errnoRet": _EPERM,
         "args": [_newuser(_flags_index(name, machine), CLONE_NEWUSER)]}
        for name in ("unshare", "clone")
    ]
    rules.append({"names": ["clone3"], "action": _SCMP_ERRNO, "errnoRet": _ENOSYS})
    return rules


def _new_profile(machine: str) -> dict[str, Any]:
    """The profile made for a spec that has none: everything allowed but what nvctk adds."""
    return {"defaultAction": _SCMP_ALLOW, "architectures": list(_SECCOMP_ARCHES.get(machine, ())),
            "syscalls": []}


def _rule_key(rule: Any) -> str:
    # exact JSON equality (Python's == takes true for 1)
    return jsonio.dumps(rule, sort_keys=True)


def _excludes_newuser(cmp: dict[str, Any]) -> bool:
    """Whether a comparison on the flags never holds while CLONE_NEWUSER is set."""
    op, value, two = cmp.get("op"), cmp.get("value"), cmp.get("valueTwo", 0)
    if not (isinstance(value, int) and isinstance(two, int)) or isinstance(value, bool) \
            or isinstance(two, bool):
        return False
    if op == "SCMP_CMP_MASKED_EQ":
        return bool(value & CLONE_NEWUSER) and not two & CLONE_NEWUSER
    if op == "SCMP_CMP_EQ":
        return not value & CLONE_NEWUSER
    if op == "SCMP_CMP_LT":
        return value <= CLONE_NEWUSER
    if op == "SCMP_CMP_LE":
        return value < CLONE_NEWUSER
    return False


def _needs_narrowing(rule: dict[str, Any], name: str, index: int, where: str) -> bool:
    """For a rule that lets `name` (unshare or clone) through: whether it may do so with
    CLONE_NEWUSER set; SpecError when its conditions on the flags leave nvctk unsure."""
    args = rule.get("args") or []
    if isinstance(args, list) and all(isinstance(a, dict) for a in args):
        indexes = [_rule_key(a.get("index")) for a in args]
        # a rule that compares one argument twice, runc splits into one rule for each
        # comparison (any of them lets the call through): no condition added holds then
        if len(set(indexes)) == len(indexes):
            on_flags = [a for a in args if a.get("index") == index]
            if not on_flags:
                return True  # narrowed by one more condition, on the flags
            if _excludes_newuser(on_flags[0]):
                return False
    raise SpecError(f"{SPEC_FILE}: {where} lets {name} through on conditions nvctk cannot "
                    "combine with its rule against new user namespaces (in one, a process of a "
                    "vGPU container could mount over the files that cap it); take "
                    f"{name} out of that rule, or set no vGPU limit")


def _narrowed(rule: Any, where: str, machine: str) -> list[Any] | None:
    """The rules that replace `rule` so that it lets no new user namespace through
    (unshare and clone only with CLONE_NEWUSER clear; clone3 left to nvctk's ENOSYS),
    or None when it needs no change. libseccomp lets an unconditional rule for a syscall
    win over every conditional one, and picks between overlapping ones itself: nvctk's
    own rules hold only when no rule of the profile lets the same calls through."""
    names = rule.get("names") if isinstance(rule, dict) else None
    if (not isinstance(names, list) or rule.get("action") in _SCMP_REFUSING
            or not any(n in _USERNS_SYSCALLS for n in names)):
        return None
    kept: list[Any] = []
    narrow: dict[int, list[str]] = {}
    for name in names:
        if name == "clone3":
            continue
        if name in ("unshare", "clone"):
            index = _flags_index(name, machine)
            if _needs_narrowing(rule, name, index, where):
                narrow.setdefault(index, []).append(name)
                continue
        kept.append(name)
    if kept == names:
        return None
    out: list[Any] = [{**rule, "names": kept}] if kept else []
    for index, group in narrow.items():
        out.append({**rule, "names": group,
                    "args": [*(rule.get("args") or []), _newuser(index, 0)]})
    return out


def block_user_namespaces(spec: dict[str, Any], edits: Edits) -> None:
    """A vGPU container's seccomp profile refuses new user namespaces: userns_rules
    appended to linux.seccomp.syscalls (a profile that allows everything else is made
    when the spec has none), the profile's own rules that would let one through
    narrowed; edits.seccomp records both, for remove_our_edits.

    A container with CAP_SYS_ADMIN in its bounding set is left alone: it can mount over
    nvctk's files without any user namespace, so the rules would only take away what it
    may have been given that capability for (nested containers, sandboxes)."""
    if is_privileged(spec):
        return
    machine = os.uname().machine
    linux = _linux(spec)
    created = linux.get("seccomp") is None
    seccomp: dict[str, Any] = _field(linux, "seccomp", dict, "linux.seccomp")
    if created:
        seccomp.update(_new_profile(machine))
    syscalls = _field(seccomp, "syscalls", list, "linux.seccomp.syscalls")
    replaced: list[list[Any]] = []  # [position, the rule as it was, the rules put there]
    out: list[Any] = []
    for i, rule in enumerate(syscalls):
        new = _narrowed(rule, f"linux.seccomp.syscalls[{i}]", machine)
        if new is None:
            out.append(rule)
        else:
            replaced.append([len(out), rule, new])
            out.extend(new)
    syscalls[:] = out
    # a rule the profile already has is not added twice (nor recorded: it stays the user's)
    present = {_rule_key(r) for r in syscalls}
    added = [r for r in userns_rules(machine) if _rule_key(r) not in present]
    syscalls.extend(added)
    edits.seccomp = {"created": created, "syscalls": added, "replaced": replaced}


def _remove_userns_rules(spec: dict[str, Any], rec: Any) -> None:
    """Undo block_user_namespaces as recorded, only as far as it is what nvctk does,
    whatever the record says: its own rules out, each narrowed rule back as it was, the
    profile itself out when nvctk made it and nothing else has been put in it since."""
    if not isinstance(rec, dict):
        return
    linux = spec.get("linux")
    if not isinstance(linux, dict) or not isinstance(linux.get("seccomp"), dict):
        return
    seccomp = linux["seccomp"]
    syscalls = seccomp.get("syscalls")
    machine = os.uname().machine
    if isinstance(syscalls, list):
        recorded = rec.get("syscalls")
        if isinstance(recorded, list):
            ours = {_rule_key(r) for m in _SECCOMP_ARCHES for r in userns_rules(m)}
            for key in (k for k in map(_rule_key, recorded) if k in ours):
                # the last match: nvctk appended its rules after the user's
                for i in range(len(syscalls) - 1, -1, -1):
                    if _rule_key(syscalls[i]) == key:
                        del syscalls[i]
                        break
        replaced = rec.get("replaced")
        if isinstance(replaced, list):
            for item in reversed(replaced):
                _restore_rule(syscalls, item, machine)
    if rec.get("created") is True and _rule_key(seccomp) == _rule_key(_new_profile(machine)):
        del linux["seccomp"]


def _restore_rule(syscalls: list[Any], item: Any, machine: str) -> None:
    """Put a narrowed rule back: only where the rules recorded as its replacement are
    exactly what narrowing it makes, and are still in the profile."""
    if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], int)
            and isinstance(item[2], list)):
        return
    at, rule, new = item
    try:
        if _rule_key(_narrowed(rule, "", machine)) != _rule_key(new):
            return
    except SpecError:
        return
    keys = [_rule_key(r) for r in new]
    n = len(keys)
    starts = [at] + [i for i in range(len(syscalls) - n + 1) if i != at]
    for i in starts:
        if 0 <= i <= len(syscalls) - n and [_rule_key(r) for r in syscalls[i:i + n]] == keys:
            syscalls[i:i + n] = [rule]
            return


# --- state (what hooks read on stdin) --------------------------------------------------


class State(Record):
    __slots__ = ("id", "pid", "bundle", "status", "root", "annotations")  # noqa: RUF023

    def __init__(self, id: str, pid: int, bundle: str, status: str = "",
                 root: str | None = None, annotations: dict[str, str] | None = None) -> None:
        self.id = id
        self.pid = pid
        self.bundle = bundle
        self.status = status
        self.root = root  # crun passes the rootfs; runc does not
        self.annotations: dict[str, str] = {} if annotations is None else annotations


def load_state(text: str | bytes) -> State:
    """The OCI state JSON a hook gets on stdin; SpecError on anything unusable."""
    try:
        d = jsonio.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise SpecError(f"hook state on stdin: invalid JSON: {e}")
    except RecursionError:
        raise SpecError("hook state on stdin: JSON nested too deeply")
    if not isinstance(d, dict):
        raise SpecError("hook state on stdin: not a JSON object")
    cid, bundle, pid = d.get("id"), d.get("bundle"), d.get("pid", 0)
    if not isinstance(cid, str) or not cid or "\0" in cid:
        raise SpecError("hook state on stdin: id is missing")
    if not isinstance(bundle, str) or not bundle.startswith("/") or "\0" in bundle:
        raise SpecError(f"hook state on stdin: bundle must be an absolute path, not "
                        f"{shown(bundle)}")
    # Linux pids stay below 2**22 (PID_MAX_LIMIT); os calls overflow far past it
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < 1 << 31:
        raise SpecError(f"hook state on stdin: bad pid {shown(pid)}")
    root = d.get("root")
    if isinstance(root, str) and "\0" in root:
        raise SpecError("hook state on stdin: root holds a NUL character")
    annotations = d.get("annotations") or {}
    if not isinstance(annotations, dict):
        raise SpecError("hook state on stdin: annotations must be an object")
    status = d.get("status", "")
    return State(
        id=cid,
        pid=pid,
        bundle=bundle,
        status=status if isinstance(status, str) else "",
        root=root if isinstance(root, str) and root else None,
        # runc's are strings; anything else (a nested value) is no annotation of use
        annotations={str(k): v if isinstance(v, str) else str(v)
                     for k, v in annotations.items() if not isinstance(v, (dict, list))},
    )
