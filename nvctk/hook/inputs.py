"""What a hook is given: its OCI state on stdin and the bundle (the form in it is read by
nvctk.edits_file, its one reader).

The inputs of every nvctk hook (prestart, poststop, the CDI hooks), read the same way:
the environment cleaned of what could steer Python or the loader, the state parsed,
the rootfs found.
"""

from __future__ import annotations

import os

from nvctk.base import jsonio
from nvctk.base.errors import SpecError
from nvctk.base.record import Record
from nvctk.oci.spec import load_state

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import MutableMapping
    from typing import Any


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
