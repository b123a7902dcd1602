"""Looking at a container image's files from the host without ever leaving its rootfs.

nvctk.mount does this with openat2(RESOLVE_IN_ROOT), reached through ctypes, whose
import costs every GPU container's create milliseconds. The shim only needs to know
whether a path exists, so this module resolves it by hand, one component at a time
below file descriptors it holds: each component is opened with O_PATH | O_NOFOLLOW
relative to its parent's fd (the kernel never follows a link, nor a `..`, for us),
a symlink's target is read from the link's own fd and resolved again from the rootfs'
root (absolute) or from the link's directory (relative), and `..` pops the stack of
held directories, never above the rootfs. So an image's absolute links, `..` chains,
link chains and links to host directories all stay inside the rootfs, as in the
container (where /proc/self/root magic links are no issue: the image's /proc is no
procfs before the container starts).
"""

from __future__ import annotations

import os
import stat

from nvctk.errors import SpecError

MAX_LINKS = 40  # as the kernel's path walk: ELOOP beyond that

_O_LOOKUP = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def exists_in_rootfs(rootfs: str, path: str) -> bool:
    """Whether `path` exists inside `rootfs`, with every link resolved as if the rootfs
    were / (never leaving it); SpecError when the rootfs itself cannot be opened."""
    try:
        root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise SpecError(f"rootfs {rootfs}: {e.strerror}")
    dirs = [root]  # the directories walked so far, the rootfs first
    try:
        return _walk(dirs, _components(path)[::-1])
    finally:
        for fd in dirs:
            os.close(fd)


def _components(path: str) -> list[str]:
    return [c for c in path.split("/") if c not in ("", ".")]


def _walk(dirs: list[int], todo: list[str]) -> bool:
    """Resolve the components in `todo` (the next one last) below dirs[-1]; dirs grows
    with the directories entered (the caller closes them)."""
    links = 0
    while todo:
        name = todo.pop()
        if name == "..":
            if len(dirs) > 1:  # `..` of the rootfs is the rootfs
                os.close(dirs.pop())
            continue
        try:
            fd = os.open(name, _O_LOOKUP, dir_fd=dirs[-1])
        except OSError:
            return False
        try:
            mode = os.fstat(fd).st_mode
            target = os.readlink("", dir_fd=fd) if stat.S_ISLNK(mode) else None
        except OSError:
            os.close(fd)
            return False
        if target is not None:
            os.close(fd)
            links += 1
            if links > MAX_LINKS or not target:  # a loop; an empty link names nothing
                return False
            if target.startswith("/"):
                while len(dirs) > 1:
                    os.close(dirs.pop())
            todo.extend(_components(target)[::-1])
            continue
        if stat.S_ISDIR(mode):
            dirs.append(fd)
            continue
        os.close(fd)
        return not todo  # a file with more path after it: ENOTDIR
    return True
