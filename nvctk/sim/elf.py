"""Minimal ELF shared objects for the simulated driver's stub libraries, and reading
one's DT_SONAME back.

A stub is written directly (ELF64 x86-64 or ELF32 i386): loadable by the dynamic
loader and readable by ldconfig and objdump, built in microseconds and without a
multilib compiler.
"""

from __future__ import annotations

import struct

PT_LOAD, PT_DYNAMIC, PT_GNU_STACK = 1, 2, 0x6474E551
PF_RW = 4 | 2  # PF_R | PF_W
SHF_WRITE, SHF_ALLOC = 1, 2
SHT_STRTAB, SHT_HASH, SHT_DYNAMIC, SHT_DYNSYM = 3, 5, 6, 11
DT_NULL, DT_NEEDED, DT_HASH, DT_STRTAB, DT_SYMTAB, DT_STRSZ, DT_SYMENT, DT_SONAME = (
    0, 1, 4, 5, 6, 10, 11, 14)
SECTIONS = (".hash", ".dynsym", ".dynstr", ".dynamic", ".shstrtab")
NPH, NSH = 3, 6  # program headers (LOAD, DYNAMIC, GNU_STACK); section headers (null + SECTIONS)


class _Class:
    """The sizes and struct formats of ELF64 (x86-64) or ELF32 (i386)."""

    def __init__(self, bits: int) -> None:
        if bits not in (32, 64):
            raise ValueError(bits)
        self.is64 = is64 = bits == 64
        self.ehdr_size, self.phent, self.shent = (64, 56, 64) if is64 else (52, 32, 40)
        self.sym_size, self.dyn_fmt = (24, "<qQ") if is64 else (16, "<iI")
        self.dyn_size = struct.calcsize(self.dyn_fmt)
        self.align = 8 if is64 else 4

    def ehdr(self, sh_off: int) -> bytes:
        ident = b"\x7fELF" + bytes([2 if self.is64 else 1, 1, 1, 0]) + b"\0" * 8
        fmt = "<HHIQQQIHHHHHH" if self.is64 else "<HHIIIIIHHHHHH"
        return ident + struct.pack(fmt, 3, 62 if self.is64 else 3, 1, 0, self.ehdr_size, sh_off,
                                   0, self.ehdr_size, self.phent, NPH, self.shent, NSH,
                                   SECTIONS.index(".shstrtab") + 1)

    def phdr(self, typ: int, off: int, size: int, align: int) -> bytes:
        """A read-write segment mapped at its file offset."""
        if self.is64:
            return struct.pack("<IIQQQQQQ", typ, PF_RW, off, off, off, size, size, align)
        return struct.pack("<8I", typ, off, off, off, size, size, PF_RW, align)

    def shdr(self, name: int, typ: int, flags: int, addr: int, off: int, size: int, link: int,
             info: int, align: int, ent: int) -> bytes:
        fmt = "<IIQQQQIIQQ" if self.is64 else "<10I"
        return struct.pack(fmt, name, typ, flags, addr, off, size, link, info, align, ent)


def _pad(b: bytearray, to: int) -> None:
    b.extend(b"\0" * (-len(b) % to))


def _strtab(names: tuple[str, ...]) -> tuple[bytearray, dict[str, int]]:
    """A string table of names and each name's offset in it."""
    tab, offsets = bytearray(b"\0"), {}
    for s in names:
        offsets[s] = len(tab)
        tab += s.encode() + b"\0"
    return tab, offsets


def elf_stub(soname: str, *, bits: int = 64, needed: tuple[str, ...] = ("libc.so.6",)) -> bytes:
    """A minimal ELF shared object (x86-64 or i386) whose dynamic section names
    `soname`: one RW PT_LOAD, PT_DYNAMIC, PT_GNU_STACK (non-exec), a SysV hash
    table, an empty symbol table, and section headers for the tools."""
    c = _Class(bits)
    dynstr, offsets = _strtab((*needed, soname))
    body = bytearray(c.ehdr_size + NPH * c.phent)  # headers filled in at the end
    _pad(body, c.align)
    off = {".hash": len(body)}
    body += struct.pack("<4I", 1, 1, 0, 0)  # nbucket, nchain, bucket[0], chain[0]
    _pad(body, c.align)
    off[".dynsym"] = len(body)
    body += b"\0" * c.sym_size
    off[".dynstr"] = len(body)
    body += dynstr
    _pad(body, c.align)
    off[".dynamic"] = len(body)
    tags = [(DT_NEEDED, offsets[n]) for n in needed] + [
        (DT_SONAME, offsets[soname]), (DT_HASH, off[".hash"]), (DT_STRTAB, off[".dynstr"]),
        (DT_SYMTAB, off[".dynsym"]), (DT_STRSZ, len(dynstr)), (DT_SYMENT, c.sym_size),
        (DT_NULL, 0),
    ]
    for tag, val in tags:
        body += struct.pack(c.dyn_fmt, tag, val)
    dyn_len = len(body) - off[".dynamic"]
    load_size = len(body)
    headers = _section_headers(c, body, off, len(dynstr), dyn_len)  # appends .shstrtab
    body += headers
    sh_off = len(body) - NSH * c.shent
    head = c.ehdr(sh_off) + c.phdr(PT_LOAD, 0, load_size, 0x1000)
    head += c.phdr(PT_DYNAMIC, off[".dynamic"], dyn_len, c.align) + c.phdr(PT_GNU_STACK, 0, 0, 16)
    body[: len(head)] = head
    return bytes(body)


def _section_headers(c: _Class, body: bytearray, off: dict[str, int], dynstr_len: int,
                     dyn_len: int) -> bytes:
    """.shstrtab (appended to body, with its padding) and the section headers that
    follow it, the null one first."""
    shstr, names = _strtab(SECTIONS)
    shstr_off = len(body)
    body += shstr
    _pad(body, c.align)
    hdrs = b"\0" * c.shent

    def loaded(name: str, typ: int, flags: int, size: int, link: int, info: int, align: int,
               ent: int) -> bytes:
        return c.shdr(names[name], typ, flags, off[name], off[name], size, link, info, align, ent)

    hdrs += loaded(".hash", SHT_HASH, SHF_ALLOC, 16, 2, 0, c.align, 4)
    hdrs += loaded(".dynsym", SHT_DYNSYM, SHF_ALLOC, c.sym_size, 3, 1, c.align, c.sym_size)
    hdrs += loaded(".dynstr", SHT_STRTAB, SHF_ALLOC, dynstr_len, 0, 0, 1, 0)
    hdrs += loaded(".dynamic", SHT_DYNAMIC, SHF_WRITE | SHF_ALLOC, dyn_len, 3, 0, c.align,
                   c.dyn_size)
    # .shstrtab is not loaded: its sh_addr must be 0
    return hdrs + c.shdr(names[".shstrtab"], SHT_STRTAB, 0, 0, shstr_off, len(shstr), 0, 0, 1, 0)


def read_soname(path: str) -> str | None:
    """DT_SONAME of an ELF file (32 or 64-bit, little-endian), via its program headers."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF":
        raise ValueError(f"{path}: not an ELF file")
    is64 = data[4] == 2
    if is64:
        phoff, phent, phnum = struct.unpack_from("<Q", data, 32)[0], *struct.unpack_from("<HH", data, 54)
        ph_fmt, dyn_fmt = "<IIQQQQQQ", "<qQ"
    else:
        phoff, phent, phnum = struct.unpack_from("<I", data, 28)[0], *struct.unpack_from("<HH", data, 42)
        ph_fmt, dyn_fmt = "<8I", "<iI"
    loads, dynamic = [], None
    for i in range(phnum):
        fields = struct.unpack_from(ph_fmt, data, phoff + i * phent)
        if is64:
            ptype, _fl, off, vaddr, _pa, filesz = fields[:6]
        else:
            ptype, off, vaddr, _pa, filesz = fields[:5]
        if ptype == PT_LOAD:
            loads.append((vaddr, off, filesz))
        elif ptype == PT_DYNAMIC:
            dynamic = (off, filesz)
    if dynamic is None:
        return None

    def v2o(addr: int) -> int:
        for vaddr, off, size in loads:
            if vaddr <= addr < vaddr + size:
                return addr - vaddr + off
        raise ValueError(f"{path}: address {addr:#x} is not in a PT_LOAD segment")

    step = struct.calcsize(dyn_fmt)
    strtab = soname = None
    for pos in range(dynamic[0], dynamic[0] + dynamic[1], step):
        tag, val = struct.unpack_from(dyn_fmt, data, pos)
        if tag == DT_NULL:
            break
        if tag == DT_STRTAB:
            strtab = val
        elif tag == DT_SONAME:
            soname = val
    if strtab is None or soname is None:
        return None
    start = v2o(strtab) + soname
    return data[start : data.index(b"\0", start)].decode()
