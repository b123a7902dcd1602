"""OCI runtime-spec pieces: load a bundle's config.json, check it, save it atomically;
parse the state a hook gets on stdin. The edits nvctk makes are nvctk.edits (and
nvctk.spec.seccomp for the user-namespace rules).

The spec is kept as the parsed JSON, plain dicts, so every field nvctk does not know
(annotations, seccomp, future spec fields, vendor extensions) is written back
untouched and in its original order.
"""

from __future__ import annotations

import os

from nvctk.base import jsonio
from nvctk.base.errors import SpecError, SpecShapeError, shown
from nvctk.base.fileio import atomic_write
from nvctk.base.record import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


SPEC_FILE = "config.json"
CAP_SYS_ADMIN = "CAP_SYS_ADMIN"



# --- spec ----------------------------------------------------------------------------


def spec_path(bundle: str) -> str:
    return os.path.join(bundle, SPEC_FILE)


# far above any real spec (runc's own are a few KiB; a big pod's, tens)
MAX_SPEC_BYTES = 64 << 20


def read_spec(bundle: str) -> bytes:
    """The bytes of the bundle's config.json, read without ever blocking (a FIFO,
    device or socket is refused unread); SpecError naming the file when unusable."""
    from nvctk.base.fileio import NotRegularFile, read_regular_file

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
    it: the hooks see the spec runc runs (nvctk-runtime refuses such a GPU spec)."""
    return parse_spec_as_runc(read_spec(bundle), bundle)


def parse_spec_as_runc(data: bytes, bundle: str) -> dict[str, Any]:
    """load_spec_as_runc's parse of the bytes read from the bundle."""
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


def check_bundle_outside_rootfs(bundle: str, rootfs: str) -> None:
    """SpecError when the bundle lies inside the rootfs: the runtime and the hooks trust
    the form saved beside config.json (host paths to bind, a dir to delete), which the
    container could then rewrite."""
    if bundle_in_rootfs(bundle, rootfs):
        raise SpecError(f"{spec_path(bundle)}: root.path {rootfs} contains the bundle {bundle}; "
                        "a GPU container's rootfs must not hold its own bundle (the container "
                        "could rewrite what nvctk's hooks read there)")


def spec_mounts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in spec.get("mounts") or () if isinstance(m, dict)]


# --- fields ---------------------------------------------------------------------------------


def field(parent: dict[str, Any], key: str, kind: type, where: str) -> Any:
    """parent[key], created empty when absent or null; SpecError naming the field
    when it has another type: nvctk never "repairs" a spec runc would refuse into
    one it accepts (dropping what the user wrote there)."""
    value = parent.get(key)
    if value is None:
        value = parent[key] = kind()
    elif not isinstance(value, kind):
        raise SpecError(f"{SPEC_FILE}: {where} must be {json_type(kind())}, not "
                        f"{json_type(value)}")
    return value


def json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def linux_of(spec: dict[str, Any]) -> dict[str, Any]:
    linux: dict[str, Any] = field(spec, "linux", dict, "linux")
    return linux


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
