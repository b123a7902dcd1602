"""The record of what nvctk added to a spec: written by one create, read by the next.

AppliedRecord is what one create added to config.json; nvctk.spec.apply writes it into
the spec's nvctk.io/edits annotation, sealed (record_text) with a MAC keyed by the
node's edits key and bound to this bundle. EarlierRecord is that annotation as the
next create finds it, parsed once (read_record): its fields, its MAC, and its problem
(None: well formed, not yet judged). Whether it is honoured is the runtime's decision
(nvctk.runtime.earlier), not the writer's: the writer removes what the judged record
names, nothing more.

Its own module so that nvctk.spec.seccomp (which adds to it) and nvctk.spec.apply
(which applies the edits form, nvctk.edits) do not import each other.
"""

from __future__ import annotations

from nvctk.base import jsonio, keyfile
from nvctk.base.errors import shown
from nvctk.base.record import Record
from nvctk.oci.spec import json_type

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

# The annotation in which a GPU create records the spec entries it added, so that the
# next create of the same bundle (reused, its request changed) removes exactly those.
EDITS_ANNOTATION = "nvctk.io/edits"
_WHERE = f"annotations[{EDITS_ANNOTATION!r}]"


class AppliedRecord(Record):
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

    def fields(self) -> dict[str, Any]:
        """The record's fields as the annotation holds them (without the MAC)."""
        out: dict[str, Any] = {"devices": self.devices, "rules": self.rules, "env": self.env}
        if self.seccomp is not None:  # vGPU only: other GPU containers' records stay as they were
            out["seccomp"] = self.seccomp
        if self.cdi:  # CDI only: legacy records stay as they were
            out.update(cdi=True, mounts=self.mounts, hooks=self.hooks)
        return out

    def needs_seal(self) -> bool:
        """Whether the record names more than NVIDIA device nodes and their allow rules
        (which any record may take out: that only takes access away), so that the next
        create honours it only when it proves nvctk wrote it for this bundle."""
        return self.cdi or self.seccomp is not None or bool(self.env)


class EarlierRecord(Record):
    """nvctk.io/edits as a spec carries it. fields: the record without its MAC ({} when
    malformed); mac: its MAC (None: none); problem: why it is not honoured in full (None:
    well formed and not yet judged, or judged trusted); malformed: the annotation is not
    what nvctk writes (a GPU create refuses it, a no-GPU create leaves the spec as it is);
    trusted: judged written by nvctk for this bundle and still carried by the spec."""

    __slots__ = ("fields", "mac", "problem", "malformed", "trusted")  # noqa: RUF023

    def __init__(self, fields: dict[str, Any], mac: str | None = None,
                 problem: str | None = None, malformed: bool = False,
                 trusted: bool = False) -> None:
        self.fields = fields
        self.mac = mac
        self.problem = problem
        self.malformed = malformed
        self.trusted = trusted

    @property
    def cdi(self) -> bool:
        return self.fields.get("cdi") is True


def read_record(spec: dict[str, Any]) -> EarlierRecord | None:
    """The spec's nvctk.io/edits record, parsed once (None: the spec has none). Strict:
    a record that is not exactly what nvctk writes comes back malformed, with no fields."""
    annotations = spec.get("annotations")
    if not isinstance(annotations, dict) or EDITS_ANNOTATION not in annotations:
        return None
    raw = annotations[EDITS_ANNOTATION]
    if not isinstance(raw, str):
        return _malformed(f"{_WHERE} must be a string, not {json_type(raw)}")
    try:
        rec = jsonio.loads(raw)
    except (ValueError, RecursionError):
        return _malformed(f"{_WHERE}: not valid JSON")
    if not isinstance(rec, dict):
        return _malformed(f"{_WHERE} must hold a JSON object, not {json_type(rec)}")
    problem = _shape_problem(rec)
    if problem is not None:
        return _malformed(problem)
    mac = rec.pop("mac", None)
    return EarlierRecord(rec, mac)


def _malformed(problem: str) -> EarlierRecord:
    return EarlierRecord({}, None, problem, malformed=True)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# the record's list fields and the shape of each entry (AppliedRecord.fields writes these)
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


def _shape_problem(rec: dict[str, Any]) -> str | None:
    for key, value in rec.items():
        if key == "seccomp":
            if not isinstance(value, dict):
                return f"{_WHERE}: seccomp must be an object, not {json_type(value)}"
            continue  # remove_userns_rules acts only on what matches nvctk's own rules
        if key == "mac":
            if not isinstance(value, str):
                return f"{_WHERE}: mac must be a string, not {json_type(value)}"
            continue
        if key == "cdi":
            if not isinstance(value, bool):
                return f"{_WHERE}: cdi must be true or false, not {json_type(value)}"
            continue
        if key not in _RECORD_SHAPES:
            return f"{_WHERE}: unknown field {shown(key)}"
        ok, shape = _RECORD_SHAPES[key]
        if not isinstance(value, list):
            return f"{_WHERE}: {key} must be a list, not {json_type(value)}"
        for entry in value:
            if not ok(entry):
                # no repr(): an entry may be nested deep or hold a 5000-digit number
                what = f"an array of {len(entry)}" if isinstance(entry, list) else json_type(entry)
                return f"{_WHERE}: a {key} entry must be {shape}, not {what}"
    return None


def record_mac(fields: dict[str, Any], key: bytes, binding: str) -> str:
    """The MAC of a record: keyed blake2b over the bundle it was written for (binding:
    nvctk.runtime.earlier.bundle_binding) and the record's canonical JSON, so that a
    record copied into another container's spec (Docker's --annotation, a Pod's
    annotations passed through) proves nothing there. ValueError, TypeError or
    RecursionError: fields nvctk cannot serialize."""
    return keyfile.mac(jsonio.dumps({"bundle": binding, "record": fields}, sort_keys=True), key)


class Seal(Record):
    """What a record is sealed with: the node's edits key (None: none could be had, and
    only a record that needs no seal may be written; AppliedRecord.needs_seal) and the
    bundle's binding."""

    __slots__ = ("key", "binding")  # noqa: RUF023

    def __init__(self, key: bytes | None, binding: str) -> None:
        self.key = key
        self.binding = binding


def record_text(added: AppliedRecord, seal: Seal | None) -> str:
    """The annotation's value for what one create added, with its MAC when sealed."""
    fields = added.fields()
    if added.needs_seal():
        if seal is None or seal.key is None:
            raise ValueError("a record naming more than NVIDIA device access needs the edits key")
        fields["mac"] = record_mac(added.fields(), seal.key, seal.binding)
    return jsonio.dumps(fields)
