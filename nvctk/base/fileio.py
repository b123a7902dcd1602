"""Files nvctk reads and writes: never blocking on a read, never torn on a write.

One reader (read_regular_file) for every file a container start reads, one writer
(atomic_write) for every file it replaces; one read-all and one write-all loop on a
descriptor (read_all, write_all: files, pipes, sockets). os only: all are on the start
path.
"""

from __future__ import annotations

import errno
import os
import stat


class NotRegularFile(OSError):
    """A path nvctk reads at container start is a FIFO, device, socket or directory."""


# a real config is under 4 KiB: anything far larger is not one (and would cost time)
MAX_CONFIG_BYTES = 64 << 10
# the OCI state a hook reads on stdin (runc's is a few hundred bytes; crun's adds annotations)
MAX_HOOK_STATE = 4 << 20


def _why(limit: int) -> str:
    return " (a real nvctk config is under 4 KiB)" if limit == MAX_CONFIG_BYTES else ""


def read_regular_file(path: str, limit: int = MAX_CONFIG_BYTES, *,
                      nofollow: bool = False) -> bytes:
    """The bytes of a regular file, read without ever blocking (read_regular_file_stat)."""
    return read_regular_file_stat(path, limit, nofollow=nofollow)[0]


def read_regular_file_stat(path: str, limit: int = MAX_CONFIG_BYTES, *,
                           nofollow: bool = False) -> tuple[bytes, os.stat_result]:
    """The bytes of a regular file, read without ever blocking.

    O_NONBLOCK|O_NOCTTY then fstat: a FIFO (which would wait for a writer), a
    device or a socket is refused with NotRegularFile before anything is read.
    More than `limit` bytes is an OSError too. FileNotFoundError as open() has it.
    nofollow: a symlink as the last component is an OSError (ELOOP) too.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
                 | (os.O_NOFOLLOW if nofollow else 0))
    try:
        st = os.fstat(fd)
        if (st.st_mode & 0o170000) != 0o100000:
            raise NotRegularFile(f"not a regular file: {path}")
        if st.st_size > limit:
            raise OSError(f"larger than {limit} bytes{_why(limit)}: {path}")
        try:
            return read_all(fd, limit), st
        except TooLarge:
            raise OSError(f"larger than {limit} bytes{_why(limit)}: {path}") from None
    finally:
        os.close(fd)


class TooLarge(OSError):
    """More bytes than the reader takes."""


def read_all(fd: int, limit: int | None = None) -> bytes:
    """Everything left to read from fd, up to EOF (a file, a pipe, a socket); TooLarge
    when that is more than `limit` bytes."""
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if limit is not None and total > limit:
            raise TooLarge(f"more than {limit} bytes")
        chunks.append(chunk)


def write_all(fd: int, data: bytes) -> None:
    """All of data to fd (os.write may take less at a time)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_path(path: str) -> bytes:
    """A whole file through os.open/os.read: no buffered or text layer, and no codec
    lookup (which could import an encodings module after the hook's setns). For files
    of the kernel's (/proc): no size limit, as they report none. A regular file only, opened
    without blocking: a FIFO put where a driver's /proc file is would hang the hook's worker
    (and the server waiting on it) for ever; OSError naming the path instead."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return read_all(fd)
    finally:
        os.close(fd)


def write_temp(path: str, data: bytes, mode: int | None = None, *,
               like: str | None = None, keep_owner: bool = True) -> str:
    """A new temp file beside `path` holding `data`, fsynced: the caller renames it over
    `path` (atomic_write) or, to replace several files all or none, renames them all once
    every one is written (engines.common.apply), and unlinks it on failure.

    Mode and owner follow `like` (default: `path`) where it exists, else mode 0644 and
    the writer's owner; an explicit mode wins. keep_owner=False: always the writer's.
    """
    directory = os.path.dirname(os.path.abspath(path))
    uid = gid = -1
    try:
        st = os.stat(path if like is None else like)
        mode = st.st_mode & 0o7777 if mode is None else mode
        if keep_owner:
            uid, gid = st.st_uid, st.st_gid
    except FileNotFoundError:
        mode = 0o644 if mode is None else mode
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}."
                                  f"{os.urandom(4).hex()}.tmp")
    # O_EXCL|O_NOFOLLOW: never a file or link someone planted at the temp name
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
                 | os.O_NOCTTY, 0o600)
    try:
        try:
            write_all(fd, data)
            os.fchmod(fd, mode)
            if uid >= 0 and (uid, gid) != (os.geteuid(), os.getegid()):
                try:
                    os.fchown(fd, uid, gid)
                except OSError:
                    pass
            os.fsync(fd)
        except OSError as e:
            if e.filename is not None:
                raise
            # write(2) errors (no space, quota) carry no path: name the file written
            raise OSError(e.errno, e.strerror, path) from e
        finally:
            os.close(fd)
    except BaseException:
        unlink_quietly(tmp)
        raise
    return tmp


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def sync_directory(directory: str) -> None:
    """fsync a directory: the renames in it are durable."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename itself is done
    finally:
        os.close(dfd)


def atomic_write(path: str, data: bytes, mode: int | None = None, *,
                 sync_dir: bool = True, keep_owner: bool = True) -> None:
    """Replace `path` with `data`: temp file in the same dir, fsync, rename, fsync dir.

    A reader (runc, a crashed runtime's retry) sees the old file or the new one,
    never a torn one. Mode and owner follow the file being replaced (write_temp).
    sync_dir=False leaves the directory's fsync (the rename's durability) to the
    caller's next atomic_write in the same directory, which then covers both renames.
    keep_owner=False: the new file is the writer's (a cache must not stay another's).
    """
    tmp = write_temp(path, data, mode, keep_owner=keep_owner)
    try:
        os.rename(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    if sync_dir:
        sync_directory(os.path.dirname(os.path.abspath(path)))


def kind_of(mode: int) -> str:
    """What a file of this st_mode is, for a message ("a directory", "a character device")."""
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISREG, "a regular file")):
        if test(mode):
            return what
    return "not a regular file"


def replace_regular_file(path: str, data: bytes, mode: int = 0o644) -> None:
    """atomic_write for a file an operator named (`--output`, a tool's own file): only a
    regular file, or nothing, is replaced. The rename would otherwise put a file in
    place of a device node (`--output /dev/null`), a FIFO, a socket or a directory, or
    replace a symlink rather than follow it; NotRegularFile says which, and the path is
    left untouched. The one refusal rule of every nvctk command that writes such a file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and (st.st_mode & 0o170000) != 0o100000:
        raise NotRegularFile(f"{path}: it is {kind_of(st.st_mode)}, not a regular file; "
                             "nvctk replaces only a regular file, and left it untouched")
    atomic_write(path, data, mode)
