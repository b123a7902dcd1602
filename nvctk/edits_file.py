"""The form's file: its name in the bundle, its one writer and its one reader.

nvctk-runtime saves the form (nvctk.edits.Edits) beside config.json at create
(save_edits); the hooks (prestart, poststop) and the monitor read it back
(load_edits), deciding nothing the form does not say; a create that asks for no GPU
takes an earlier create's out (remove_edits).
"""

from __future__ import annotations

import errno
import os

from nvctk.base import fileio
from nvctk.base.errors import MountError
from nvctk.base.fileio import NotRegularFile, read_regular_file
from nvctk.edits import Edits, saved_part

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nvctk.base.log import Logger

EDITS_FILE = "nvctk-edits.json"  # in the bundle directory, beside config.json
# a form is a few KiB (8 GPUs with every capability: ~60 KiB)
MAX_EDITS_BYTES = 4 << 20


def edits_path(bundle: str) -> str | None:
    """Where the bundle's form is; None when there is none."""
    path = os.path.join(bundle, EDITS_FILE)
    return path if os.path.lexists(path) else None


def save_edits(bundle: str, edits: Edits) -> str:
    """What the prestart hook reads of `edits` (saved_part), written beside the spec; its
    path. No directory fsync: the spec's rename that follows makes both durable, the
    form's first (a directory fsync costs a journal commit)."""
    path = os.path.join(bundle, EDITS_FILE)
    fileio.atomic_write(path, saved_part(edits).to_json().encode(), 0o644, sync_dir=False)
    return path


def remove_edits(bundle: str, logger: Logger | None) -> None:
    """An earlier GPU create's form out: without it the hooks that create left in the
    spec know no GPU was asked for this time (nvctk.hook.entry)."""
    path = os.path.join(bundle, EDITS_FILE)
    if not os.path.lexists(path):  # one lstat: no write to a (maybe read-only) bundle
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # no hook of ours reads it any more: not worth failing for
        if logger is not None:
            logger.warning(f"{bundle}: cannot remove an earlier create's {EDITS_FILE}: "
                           f"{e.strerror}")


def load_edits(bundle: str) -> Edits | None:
    """The form nvctk-runtime saved beside the spec at create: the one reader of it, for
    the hooks (prestart, poststop) and for anyone who wants to know what the runtime
    decided (the devices selected, in libvgpu's order: Edits.selected). Never
    recomputed here: the hook does what the form says.

    Read without ever blocking or leaving the bundle: a FIFO, a device, a symlink or
    a file larger than MAX_EDITS_BYTES at its path is a MountError naming it.
    None when there is none: nvctk-runtime removes it from a bundle whose container
    asks for no GPU, and such a container must start even when an earlier create's
    hook is still in a spec nvctk would not rewrite (one it cannot read)."""
    found = read_edits(bundle)
    return None if found is None else parse_edits(*found)


def read_edits(bundle: str) -> tuple[str, bytes] | None:
    """load_edits' read: (the form's path, its bytes); None when there is none (nor a
    bundle directory to hold one: what the bundle is, is its reader's to say)."""
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
