"""Reader of glibc's /etc/ld.so.cache in its three formats (old, compat, new).

Formats (glibc's elf/cache.c; REFERENCE §4):

- new (glibc >= 2.32 default): header ``"glibc-ld.so.cache1.1"``, u32 nlibs,
  u32 string-table size, u8 flags, 3 pad bytes, u32 extension offset, 3 x u32
  unused (48 bytes); then nlibs entries ``{i32 flags, u32 key, u32 value,
  u32 osversion, u64 hwcap}`` (24 bytes). key and value are byte offsets from the
  start of this header.
- old (libc5 era): ``"ld.so-1.7.0"`` (+ NUL), u32 nlibs, nlibs entries ``{i32
  flags, u32 key, u32 value}``; string offsets count from the end of the entries.
- compat: an old-format file whose string table hides a complete new-format
  cache, starting at the first 8-byte aligned offset after the old entries.

Like the dynamic loader, the reader prefers the new table when one is present.
Only ELF entries (``flags & 0xff`` in 1..3) are returned; ``flags & 0xff00`` names
the architecture.
"""

from __future__ import annotations

import os
import struct
import sys

from nvctk.base.errors import DriverError
from nvctk.base.record import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Container, Iterable

OLD_MAGIC = b"ld.so-1.7.0"
NEW_MAGIC = b"glibc-ld.so.cache1.1"
_OLD_HEADER = struct.Struct("<12sI")  # magic incl. NUL, nlibs
_OLD_ENTRY = struct.Struct("<iII")
_NEW_HEADER = struct.Struct("<20sIIB3sI12s")
_NEW_ENTRY = struct.Struct("<iIIIQ")

FLAG_TYPE_MASK = 0x00FF
FLAG_ARCH_MASK = 0xFF00

# glibc's FLAG_*_LIB* values (sysdeps/generic/ldconfig.h)
ARCHES: dict[int, str] = {
    0x0000: "i386",  # no "required" flag: the native 32-bit ABI of the host family
    0x0100: "sparc64",
    0x0200: "ia64",
    0x0300: "x86-64",
    0x0400: "s390x",
    0x0500: "ppc64",
    0x0600: "mips64-n32",
    0x0700: "mips64",
    0x0800: "x32",
    0x0900: "armhf",
    0x0A00: "aarch64",
    0x0B00: "armsf",
    0x0C00: "mips32-nan2008",
    0x0D00: "mips64-n32-nan2008",
    0x0E00: "mips64-nan2008",
    0x0F00: "riscv64-softfloat",
    0x1000: "riscv64",
    0x1100: "loongarch64-softfloat",
    0x1200: "loongarch64",
}

# what os.fsdecode does, without its per-call lookups (a host's cache has thousands of strings)
_FS_ENCODING = sys.getfilesystemencoding()
_FS_ERRORS = sys.getfilesystemencodeerrors()


class CacheError(DriverError):
    """The ld.so.cache is missing, truncated or not a cache at all."""


class CacheEntry(Record):
    __slots__ = ("name", "path", "arch", "flags")  # noqa: RUF023

    def __init__(self, name: str, path: str, arch: str, flags: int = 0) -> None:
        self.name = name  # the key the loader looks up, e.g. "libcuda.so.1"
        self.path = path  # as stored in the cache (for `ldconfig -r ROOT`, relative to ROOT)
        self.arch = arch  # "x86-64", "i386", "aarch64", ...
        self.flags = flags


def _cstr(data: bytes, offset: int, what: str) -> str:
    if not 0 <= offset < len(data):
        raise CacheError(f"ld.so.cache: {what} string offset {offset} is outside the file")
    end = data.find(b"\0", offset)
    if end < 0:
        raise CacheError(f"ld.so.cache: {what} string at offset {offset} is not terminated")
    return data[offset:end].decode(_FS_ENCODING, _FS_ERRORS)


def _arch(flags: int) -> str:
    required = flags & FLAG_ARCH_MASK
    return ARCHES.get(required, f"unknown-0x{required:04x}")


def _entries(data: bytes, table: memoryview, fields: struct.Struct, strings: int,
             names: Container[bytes] | None) -> list[CacheEntry]:
    """The ELF entries of an entry table; string offsets count from `strings`."""
    out = []
    for flags, key, value, *_ in fields.iter_unpack(table):
        if not 1 <= (flags & FLAG_TYPE_MASK) <= 3:
            continue
        if names is not None:
            # most of a host's entries are not wanted: judge them before decoding anything
            k = strings + key
            end = data.find(b"\0", k) if 0 <= k < len(data) else -1
            if end >= 0 and data[k:end].partition(b".so")[0] not in names:
                continue
        out.append(CacheEntry(_cstr(data, strings + key, "key"),
                              _cstr(data, strings + value, "value"), _arch(flags), flags))
    return out


def _parse_new(data: bytes, start: int, names: Container[bytes] | None) -> list[CacheEntry]:
    if len(data) - start < _NEW_HEADER.size:
        raise CacheError("ld.so.cache: truncated header")
    magic, nlibs, len_strings, _flags, _pad, _ext, _unused = _NEW_HEADER.unpack_from(data, start)
    if magic != NEW_MAGIC:
        raise CacheError("ld.so.cache: bad magic in new-format header")
    table = start + _NEW_HEADER.size
    entries_end = table + nlibs * _NEW_ENTRY.size
    if entries_end > len(data):
        raise CacheError(
            f"ld.so.cache: truncated: header says {nlibs} entries, "
            f"file has room for {(len(data) - start - _NEW_HEADER.size) // _NEW_ENTRY.size}"
        )
    if entries_end + len_strings > len(data):
        raise CacheError("ld.so.cache: truncated string table")
    return _entries(data, memoryview(data)[table:entries_end], _NEW_ENTRY, start, names)


def _align(n: int, to: int = 8) -> int:
    return (n + to - 1) & ~(to - 1)


def parse(data: bytes, names: Iterable[str] | None = None) -> list[CacheEntry]:
    """All ELF entries of a cache file's bytes, in file order (the loader's order).

    names: only the entries of these libraries (the key up to ".so", e.g. "libcuda");
    the others are skipped unread, so a bad value offset among them goes unnoticed.
    """
    want = None if names is None else {os.fsencode(n) for n in names}
    if data.startswith(NEW_MAGIC):
        return _parse_new(data, 0, want)
    if data.startswith(OLD_MAGIC):
        if len(data) < _OLD_HEADER.size:
            raise CacheError("ld.so.cache: truncated old-format header")
        _magic, nlibs = _OLD_HEADER.unpack_from(data, 0)
        strings = _OLD_HEADER.size + nlibs * _OLD_ENTRY.size
        if strings > len(data):
            raise CacheError(f"ld.so.cache: truncated: old header says {nlibs} entries")
        new_start = _align(strings)
        if data[new_start : new_start + len(NEW_MAGIC)] == NEW_MAGIC:  # compat format
            return _parse_new(data, new_start, want)
        return _entries(data, memoryview(data)[_OLD_HEADER.size:strings], _OLD_ENTRY, strings,
                        want)
    if not data:
        raise CacheError("ld.so.cache: empty file")
    raise CacheError("ld.so.cache: not an ld.so.cache file (unknown magic)")


MAX_CACHE_BYTES = 256 << 20  # a host's real one is well under 1 MiB


def cache_path(root: str) -> str:
    return os.path.join(root, "etc/ld.so.cache")


def read(root: str, names: Iterable[str] | None = None) -> list[CacheEntry]:
    """Entries of <root>/etc/ld.so.cache (of the libraries `names`: see parse); paths as
    stored (relative to root for `-r root`)."""
    path = cache_path(root)
    from nvctk.base.fileio import NotRegularFile, read_regular_file  # os and sys only

    try:
        # never a blocking open: a FIFO put there must not hang a GPU create
        data = read_regular_file(path, MAX_CACHE_BYTES)
    except FileNotFoundError:
        raise CacheError(f"no ld.so.cache at {path}")
    except OSError as e:
        why = "not a regular file" if isinstance(e, NotRegularFile) else e.strerror or e
        raise CacheError(f"cannot read {path}: {why}")
    try:
        return parse(data, names)
    except CacheError as e:
        raise CacheError(f"{path}: {str(e).removeprefix('ld.so.cache: ')}")
