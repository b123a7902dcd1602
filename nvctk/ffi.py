"""The slice of ctypes the prestart hook needs, built straight on `_ctypes`.

`import ctypes` costs ~4 ms on a 2-core VM, almost all of it ctypes/__init__.py's
Python glue (dozens of types, loader objects, a PyDLL of the interpreter), while
`import _ctypes`, the C module doing the real work, costs ~0.3 ms. The hook runs
in every GPU container's start and needs only libc's syscall wrappers, a few
integer and pointer types and two structs, so it defines those the way
ctypes/__init__.py does and nothing else. The names match ctypes', so the code
using them reads like ordinary ctypes (tests/test_ffi.py checks them against it).
"""

from __future__ import annotations

from _ctypes import (
    FUNCFLAG_CDECL,
    FUNCFLAG_USE_ERRNO,
    Structure,
    _SimpleCData,
    byref,
    dlopen,
    get_errno,
    sizeof,
)
from _ctypes import CFuncPtr as _CFuncPtr

__all__ = [
    "Structure",
    "byref",
    "c_char",
    "c_char_p",
    "c_int",
    "c_long",
    "c_size_t",
    "c_uint",
    "c_uint64",
    "c_ulong",
    "c_void_p",
    "get_errno",
    "libc_function",
    "sizeof",
]


class c_int(_SimpleCData):
    _type_ = "i"


class c_uint(_SimpleCData):
    _type_ = "I"


class c_long(_SimpleCData):
    _type_ = "l"


class c_ulong(_SimpleCData):
    _type_ = "L"


class c_char(_SimpleCData):
    _type_ = "c"


class c_char_p(_SimpleCData):
    _type_ = "z"


class c_void_p(_SimpleCData):
    _type_ = "P"


# LP64 (every Linux the hook runs on): long is 64 bits, as ctypes itself decides
c_uint64 = c_ulong
c_size_t = c_ulong
assert sizeof(c_ulong) == 8, "nvctk.ffi assumes an LP64 platform"


class _Libc:
    """What _CFuncPtr looks up a symbol in: the process's global namespace."""

    _handle = dlopen(None, 0)  # type: ignore[arg-type]  # NULL: the global namespace


class _LibcFunction(_CFuncPtr):
    _flags_ = FUNCFLAG_CDECL | FUNCFLAG_USE_ERRNO  # errno kept for get_errno(), as use_errno=True
    _restype_ = c_int


def libc_function(name: str, restype: type = c_int) -> _LibcFunction:
    """libc's `name` as ctypes.CDLL(None, use_errno=True).<name> with that restype."""
    fn = _LibcFunction((name, _Libc))  # type: ignore[arg-type]  # any object with _handle
    fn.restype = restype
    return fn
