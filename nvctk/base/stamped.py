"""The one helper for nvctk's caches keyed by a file's stat (the parsed config, the
passthrough launcher's entries, the parsed CDI specs, the host inventory): one stamp of
a file, one "racy" rule, one trusted read and one trusted write of a cache file.

Trust: a cache file is used only when it is a regular file (never followed, never a
blocking open) owned by the expected user with no mode bit beyond the one it is written
with, in a directory of that user that others cannot write; anything else is a miss.
Writes are atomic and any failure is ignored (not root, a read-only /run): the caller
then reads the source again. os only: on every create's path.
"""

from __future__ import annotations

import os
import time

from nvctk.base.fileio import atomic_write, read_regular_file_stat

# git's "racy" rule: a file changed this recently may change again without a new stamp
# (timestamps move by the kernel's timer tick, or by whole seconds on coarse file
# systems), so its content is not cached yet: readers keep reading it until it settles
RACY_NS = 50_000_000
RACY_COARSE_NS = 2_000_000_000
MAX_CACHE_BYTES = 16 << 20


def stamp(st: os.stat_result) -> list[int]:
    """What a cache entry is valid for: (dev, inode, size, mtime, ctime)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def stat_stamp(path: str) -> list[int] | None:
    """The stamp of the file at path now; None when it cannot be stat'ed."""
    try:
        return stamp(os.stat(path))
    except OSError:
        return None


def racy(ctime_ns: int, now_ns: int | None = None) -> bool:
    """Whether a file whose ctime is ctime_ns is too fresh for its stamp to vouch for it."""
    window = RACY_NS if ctime_ns % 1_000_000_000 else RACY_COARSE_NS
    return (time.time_ns() if now_ns is None else now_ns) - ctime_ns < window


def trusted_dir(directory: str, owner: int = 0) -> bool:
    """A real directory of `owner` that no one else can write."""
    try:
        st = os.stat(directory, follow_symlinks=False)
    except OSError:
        return False
    return st.st_uid == owner and (st.st_mode & 0o170000) == 0o040000 and not st.st_mode & 0o022


def read_cache(path: str, mode: int = 0o644, owner: int = 0,
               limit: int = MAX_CACHE_BYTES) -> bytes | None:
    """A cache file's bytes, or None for a miss: no file, or one not to trust (see the
    module doc; mode: what it is written with)."""
    try:
        data, st = read_regular_file_stat(path, limit, nofollow=True)
    except (OSError, ValueError):
        return None
    if st.st_uid != owner or st.st_mode & 0o777 & ~mode \
            or not trusted_dir(os.path.dirname(path), owner):
        return None
    return data


def write_cache(path: str, data: bytes, mode: int = 0o644, dir_mode: int = 0o755,
                root_only: bool = True) -> None:
    """Atomically replace a cache file, in its directory (made with dir_mode); nothing
    when not root (root_only), or the directory is not one a reader would trust."""
    owner = os.geteuid()
    if root_only and owner != 0:
        return
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=dir_mode, exist_ok=True)
        if trusted_dir(directory, owner):
            atomic_write(path, data, mode, sync_dir=False, keep_owner=False)
    except OSError:
        pass
