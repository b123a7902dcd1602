"""The one thing nvctk reads from an ELF file: its program interpreter."""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Literal


def elf_interpreter(fd: int) -> str | None:
    """PT_INTERP of an ELF file (None for a static binary); ValueError if not ELF64."""
    head = os.pread(fd, 64, 0)
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:
        raise ValueError("not a 64-bit ELF file")
    order: Literal["little", "big"] = "little" if head[5] == 1 else "big"

    def word(buf: bytes, off: int, size: int) -> int:
        return int.from_bytes(buf[off:off + size], order)

    phoff, phentsize, phnum = word(head, 32, 8), word(head, 54, 2), min(word(head, 56, 2), 256)
    if not 40 <= phentsize <= 256:  # Elf64_Phdr is 56 bytes; we read up to p_filesz
        raise ValueError("not a 64-bit ELF file")
    table = os.pread(fd, phentsize * phnum, phoff)  # the program headers in one read
    for i in range(min(phnum, len(table) // phentsize)):
        ph = table[i * phentsize:(i + 1) * phentsize]
        if word(ph, 0, 4) == 3:  # PT_INTERP
            off, size = word(ph, 8, 8), word(ph, 32, 8)
            return os.pread(fd, min(size, 4096), off).rstrip(b"\0").decode("utf-8", "replace")
    return None
