"""What a hook is given: its OCI state on stdin, the bundle, and the plan in it.

The inputs of every nvctk hook (prestart, poststop, the CDI hooks), read the same way:
the environment cleaned of what could steer Python or the loader, the state parsed,
the rootfs found, the plan read back as nvctk-runtime saved it.
"""

from __future__ import annotations

import errno
import os

from nvctk.base import jsonio
from nvctk.base.errors import MountError, SpecError
from nvctk.base.fileio import NotRegularFile, read_regular_file
from nvctk.base.record import Record
from nvctk.edits import EDITS_FILE, OLD_EDITS_FILE, Edits
from nvctk.oci.spec import load_state

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import MutableMapping
    from typing import Any

# a plan is a few KiB (8 GPUs with every capability: ~60 KiB)
MAX_EDITS_BYTES = 4 << 20


def sanitize_environ(env: MutableMapping[str, str] | None = None) -> list[str]:
    """Drop LD_* and PYTHON* from our own environment; returns the names dropped."""
    env = os.environ if env is None else env
    bad = [k for k in env if k.startswith(("LD_", "PYTHON"))]
    for k in bad:
        del env[k]
    return bad


class HookState(Record):
    # field order is the record's order (repr, to_dict): the OCI state's
    __slots__ = ("id", "pid", "bundle", "root", "annotations")  # noqa: RUF023

    def __init__(self, id: str, pid: int, bundle: str, root: str | None = None,
                 annotations: dict[str, str] | None = None) -> None:
        self.id = id
        self.pid = pid
        self.bundle = bundle
        self.root = root  # crun passes the rootfs; runc does not
        self.annotations = {} if annotations is None else annotations


def parse_state(text: str | bytes) -> HookState:
    st = load_state(text)
    root: Any = st.root
    if root is None:  # crun may send root as {"path": ...}; be lenient
        try:
            raw = jsonio.loads(text).get("root")
        except (ValueError, AttributeError):
            raw = None
        if isinstance(raw, dict) and isinstance(raw.get("path"), str):
            root = raw["path"]
    return HookState(st.id, st.pid, st.bundle, root or None, dict(st.annotations))


def rootfs_path(state: HookState, spec: dict[str, Any]) -> str:
    """The rootfs: crun's state.root, else the spec's root.path (maybe bundle-relative)."""
    path = state.root or (spec.get("root") or {}).get("path")
    if not isinstance(path, str) or not path:
        raise SpecError(f"{state.bundle}/config.json: root.path is missing")
    return os.path.normpath(os.path.join(state.bundle, path))


def edits_path(bundle: str) -> str | None:
    """Where the bundle's form is: EDITS_FILE, else (a container created before the
    rename) OLD_EDITS_FILE; None when neither is there."""
    for name in (EDITS_FILE, OLD_EDITS_FILE):
        path = os.path.join(bundle, name)
        if os.path.lexists(path):
            return path
    return None


def load_edits(bundle: str) -> Edits | None:
    """The form nvctk-runtime saved beside the spec at create (<bundle>/nvctk-edits.json,
    or nvctk-plan.json before the rename): the one reader of it, for the hooks (prestart,
    poststop) and for anyone who wants to know what the runtime decided (the devices
    selected, in libvgpu's order: Edits.selected). Never recomputed here: the hook does
    what the form says.

    Read without ever blocking or leaving the bundle: a FIFO, a device, a symlink or
    a file larger than MAX_EDITS_BYTES at its path is a MountError naming it.
    None when there is none: nvctk-runtime removes it from a bundle whose container
    asks for no GPU, and such a container must start even when an earlier create's
    hook is still in a spec nvctk would not rewrite (one it cannot read)."""
    found = read_edits(bundle)
    return None if found is None else parse_edits(*found)


def read_edits(bundle: str) -> tuple[str, bytes] | None:
    """load_edits' read: (the form's path, its bytes); None when there is none."""
    path = edits_path(bundle)
    if path is None:
        return None
    try:
        return path, read_regular_file(path, MAX_EDITS_BYTES, nofollow=True)
    except FileNotFoundError:
        return None
    except NotRegularFile:
        raise MountError(f"step edits: {path}: not a regular file (nvctk-runtime writes one)")
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise MountError(f"step edits: {path}: a symbolic link (never followed; "
                             "nvctk-runtime writes a regular file)")
        if e.errno is None:  # read_regular_file's own: larger than the limit
            raise MountError(f"step edits: {path}: larger than {MAX_EDITS_BYTES} bytes")
        raise MountError(f"step edits: {path}: {e.strerror or e}")


def parse_edits(path: str, data: bytes) -> Edits:
    """load_edits' parse of the form read from `path`."""
    try:
        return Edits.from_json(data.decode("utf-8"))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise MountError(f"step edits: {path}: unusable form: {e}")
