"""What an earlier create of this bundle added, and how much of it this create may take out.

The spec's nvctk.io/edits record (nvctk.spec.record) says what an earlier create
added, so that the next create of a reused bundle removes exactly that. But a record
is only an annotation, which a container's author can set (Docker's --annotation,
CRI-O's Pod annotations): a genuine record copied from another container would strip
this one's own seccomp rules, variables or CDI entries. The rule: nvctk never removes
an entry it cannot prove it added to this very spec. A record is honoured in full only
when its MAC (the node's edits key over the record and this bundle's identity) is good
and the spec still carries every entry it names as added; any other record takes out
no more than NVIDIA device nodes and their allow rules (that only takes access away, and
keeps an earlier create's GPUs from staying in a reused bundle), with a warning naming
why. The spec writer (nvctk.spec.apply) removes what the judged record names.
"""

from __future__ import annotations

import os

from nvctk.base.errors import SpecError
from nvctk.base.keyfile import EDITS_KEY_FILE, edits_key, same_mac
from nvctk.spec.apply import OUR_DEVICE_PREFIX, OUR_ENV_PREFIXES, missing_additions
from nvctk.spec.record import EDITS_ANNOTATION, EarlierRecord, Seal, read_record, record_mac

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from nvctk.edits import Edits

_WHERE = f"annotations[{EDITS_ANNOTATION!r}]"


def bundle_binding(bundle: str) -> str:
    """This bundle's identity, which a record's MAC covers: its resolved path and the
    inode of its directory (a bundle made anew at a path an earlier one had is another
    bundle). The bundle is the caller's (containerd, dockerd, CRI-O): a container's
    author cannot choose it."""
    st = os.stat(bundle)
    return f"{os.path.realpath(bundle)}\0{st.st_dev}:{st.st_ino}"


def earlier_record(bundle: str, spec: dict[str, Any], state_dir: str | None) -> EarlierRecord | None:
    """The spec's record, judged (None: none; malformed: as read_record found it). Reads
    the node's edits key only for a record with a MAC."""
    record = read_record(spec)
    if record is None or record.malformed:
        return record
    key: bytes | None = None
    key_problem = "no config"
    if record.mac is not None and state_dir is not None:
        try:
            key = edits_key(state_dir)
            key_problem = f"no {EDITS_KEY_FILE} in {state_dir}"
        except SpecError as e:
            key_problem = str(e)
    try:
        binding = bundle_binding(bundle)
    except OSError as e:
        key, key_problem = None, f"{bundle}: {e.strerror}"
    return judge(record, spec, key, binding, key_problem)


def judge(record: EarlierRecord, spec: dict[str, Any], key: bytes | None, binding: str,
          key_problem: str = "no key") -> EarlierRecord:
    """`record` narrowed to what this create may take out (pure). trusted: honoured in
    full. problem: why not, when that leaves out something the record names."""
    if record.malformed:
        return record
    what = "a CDI record" if record.cdi else "a record"
    problem = None
    if record.mac is None:
        problem = "without nvctk's MAC (not written by nvctk)"
    elif key is None:
        problem = f"nvctk cannot check ({key_problem})"
    else:
        try:
            good = record_mac(record.fields, key, binding)
        except (ValueError, RecursionError, TypeError):
            problem = "nvctk cannot serialize"
        else:
            if not same_mac(good, record.mac, key):
                problem = ("whose MAC is not nvctk's for this bundle (another container's "
                           "record, one an earlier nvctk wrote, or a forged one)")
    if problem is None:
        missing = missing_additions(spec, record.fields)
        if missing is not None:
            problem = f"naming {missing} that this spec no longer carries"
    if problem is None:
        return EarlierRecord(_ours_only(record.fields), record.mac, trusted=True)
    kept = _nvidia_access(record.fields)
    if kept == _named(_ours_only(record.fields)):
        return EarlierRecord(kept, record.mac)  # nothing left out: nothing to say
    gone = "only its /dev/nvidia* device nodes and their allow rules are taken out" if kept \
        else "nothing of it is taken out"
    return EarlierRecord(kept, record.mac, f"{_WHERE}: {what} {problem}; {gone}")


def _ours_only(fields: dict[str, Any]) -> dict[str, Any]:
    """A legacy record kept to the shapes a legacy create adds (a CDI one's entries may
    be any device, variable or mount: the record says so)."""
    if fields.get("cdi") is True:
        return fields
    out = dict(fields)
    out["devices"] = [d for d in fields.get("devices") or ()
                      if isinstance(d, list) and str(d[0]).startswith(OUR_DEVICE_PREFIX)]
    out["env"] = [e for e in fields.get("env") or ()
                  if isinstance(e, str) and e.startswith(OUR_ENV_PREFIXES)]
    return out


def _nvidia_access(fields: dict[str, Any]) -> dict[str, Any]:
    """What any legacy record may take out: NVIDIA nodes and their allow rules; nothing
    of a CDI record (its devices may be anything)."""
    if fields.get("cdi") is True:
        return {}
    ours = _ours_only(fields)
    return _named({k: ours[k] for k in ("devices", "rules") if k in ours})


def _named(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v}


def record_seal(bundle: str, state_dir: str, edits: Edits) -> Seal:
    """The seal of the record of applying `edits`: the node's edits key (made on first
    use) and the bundle's identity. When the record will name more than NVIDIA device
    access (a vGPU's variables and seccomp rules, any CDI entry) a key that cannot be
    had fails the create; otherwise none is read (AppliedRecord.needs_seal)."""
    if not (edits.origin == "cdi" or edits.env or edits.seccomp_block_userns):
        return Seal(None, "")  # nothing to seal: no key, no look at the bundle
    return Seal(edits_key(state_dir, create=True), bundle_binding(bundle))
