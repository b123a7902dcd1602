"""nvctk.host.ldcache against caches the real ldconfig writes in each format, and bad input."""

from __future__ import annotations

import os
import re
import struct
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvctk.host import ldcache
from nvctk.sim.host import elf_stub

LDCONFIG = "/sbin/ldconfig"
FORMATS = ("old", "compat", "new")

# (dir, file name, SONAME, bits)
LIBS = (
    ("usr/lib/x86_64-linux-gnu", "libcuda.so.550.54.15", "libcuda.so.1", 64),
    ("usr/lib/x86_64-linux-gnu", "libnvidia-ml.so.550.54.15", "libnvidia-ml.so.1", 64),
    ("usr/lib/x86_64-linux-gnu", "libnvidia-glcore.so.550.54.15", "libnvidia-glcore.so.550.54.15", 64),
    ("usr/lib/x86_64-linux-gnu", "libGLX_nvidia.so.550.54.15", "libGLX_nvidia.so.0", 64),
    ("usr/lib/i386-linux-gnu", "libcuda.so.550.54.15", "libcuda.so.1", 32),
    ("usr/lib/i386-linux-gnu", "libGLX_nvidia.so.550.54.15", "libGLX_nvidia.so.0", 32),
)
EXPECTED = {
    ("libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "x86-64"),
    ("libnvidia-ml.so.1", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", "x86-64"),
    (
        "libnvidia-glcore.so.550.54.15",
        "/usr/lib/x86_64-linux-gnu/libnvidia-glcore.so.550.54.15",
        "x86-64",
    ),
    ("libGLX_nvidia.so.0", "/usr/lib/x86_64-linux-gnu/libGLX_nvidia.so.0", "x86-64"),
    ("libcuda.so.1", "/usr/lib/i386-linux-gnu/libcuda.so.1", "i386"),
    ("libGLX_nvidia.so.0", "/usr/lib/i386-linux-gnu/libGLX_nvidia.so.0", "i386"),
}


@pytest.fixture(scope="module")
def lib_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ldroot")
    for d, name, soname, bits in LIBS:
        (root / d).mkdir(parents=True, exist_ok=True)
        (root / d / name).write_bytes(elf_stub(soname, bits=bits))
    (root / "etc").mkdir()
    (root / "etc/ld.so.conf").write_text("/usr/lib/x86_64-linux-gnu\n/usr/lib/i386-linux-gnu\n")
    return root


def _ldconfig(root: Path, fmt: str) -> bytes:
    subprocess.run([LDCONFIG, "-c", fmt, "-r", str(root)], check=True, capture_output=True)
    return (root / "etc/ld.so.cache").read_bytes()


def _ldconfig_p(root: Path) -> set[tuple[str, str, str]]:
    """What ldconfig itself reads back from the cache: (name, path, arch)."""
    out = subprocess.run(
        [LDCONFIG, "-r", str(root), "-p"], check=True, capture_output=True, text=True
    ).stdout
    got = set()
    for m in re.finditer(r"^\s+(\S+) \(([^)]*)\) => (\S+)$", out, re.M):
        kinds = m.group(2).split(",")
        arch = "x86-64" if "x86-64" in kinds else "i386"
        got.add((m.group(1), m.group(3), arch))
    return got


@pytest.mark.parametrize("fmt", FORMATS)
def test_real_ldconfig_formats(lib_root: Path, fmt: str) -> None:
    data = _ldconfig(lib_root, fmt)
    magic = ldcache.NEW_MAGIC if fmt == "new" else ldcache.OLD_MAGIC
    assert data.startswith(magic)
    entries = ldcache.parse(data)
    assert {(e.name, e.path, e.arch) for e in entries} == EXPECTED
    assert {(e.name, e.path, e.arch) for e in ldcache.read(str(lib_root))} == EXPECTED
    assert _ldconfig_p(lib_root) == EXPECTED


def test_compat_is_read_through_its_new_table(lib_root: Path) -> None:
    """A compat cache hides a whole new-format table after the old one: the parser
    must read that one (it has the arch flags the loader uses), not the old table."""
    data = bytearray(_ldconfig(lib_root, "compat"))
    assert data.find(ldcache.NEW_MAGIC) > 0
    # blank the old table's entries (flags 0: not ELF): only the new table is left
    (nlibs,) = struct.unpack_from("<I", data, len(ldcache.OLD_MAGIC) + 1)
    start = len(ldcache.OLD_MAGIC) + 5
    data[start:start + 12 * nlibs] = bytes(12 * nlibs)
    assert {(e.name, e.path, e.arch) for e in ldcache.parse(bytes(data))} == EXPECTED


def test_host_cache_matches_ldconfig_p() -> None:
    if not os.path.exists("/etc/ld.so.cache"):
        pytest.skip("no host ld.so.cache")
    entries = ldcache.read("/")
    assert entries, "host cache is empty"
    assert {(e.name, e.path) for e in entries} == {
        (n, p) for n, p, _ in _ldconfig_p(Path("/"))
    }


def _old_format(entries: list[tuple[int, str, str]]) -> bytes:
    """An old-only cache crafted per REFERENCE §4 (what libc5-era ldconfig wrote)."""
    strings = bytearray()
    packed = []
    for flags, key, value in entries:
        k = len(strings)
        strings += key.encode() + b"\0"
        v = len(strings)
        strings += value.encode() + b"\0"
        packed.append(struct.pack("<iII", flags, k, v))
    return b"ld.so-1.7.0\0" + struct.pack("<I", len(entries)) + b"".join(packed) + bytes(strings)


@pytest.mark.parametrize(
    ("flags", "arch"),
    [(0x0303, "x86-64"), (0x0003, "i386"), (0x0A03, "aarch64"), (0x0503, "ppc64")],
)
def test_crafted_old_format(flags: int, arch: str) -> None:
    data = _old_format([(flags, "libfoo.so.1", "/lib/libfoo.so.1"), (0, "aout", "/x")])
    assert ldcache.parse(data) == [ldcache.CacheEntry("libfoo.so.1", "/lib/libfoo.so.1", arch, flags)]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"\x7fELF garbage", "not an ld.so.cache"),
        (ldcache.NEW_MAGIC + b"\0\0", "truncated header"),
        (ldcache.NEW_MAGIC + struct.pack("<IIB3sI12s", 5, 0, 0, b"", 0, b""), "truncated"),
        (b"ld.so-1.7.0\0" + struct.pack("<I", 3), "truncated"),
        (
            ldcache.NEW_MAGIC
            + struct.pack("<IIB3sI12s", 1, 0, 0, b"", 0, b"")
            + struct.pack("<iIIIQ", 0x303, 9999, 9999, 0, 0),
            "outside the file",
        ),
    ],
)
def test_bad_input(data: bytes, message: str) -> None:
    with pytest.raises(ldcache.CacheError, match=message):
        ldcache.parse(data)


def test_missing_cache_names_path(tmp_path: Path) -> None:
    with pytest.raises(ldcache.CacheError, match=re.escape(str(tmp_path / "etc/ld.so.cache"))):
        ldcache.read(str(tmp_path))


@pytest.fixture(scope="module")
def cache_bytes(lib_root: Path) -> dict[str, bytes]:
    return {fmt: _ldconfig(lib_root, fmt) for fmt in FORMATS}


@settings(max_examples=150, deadline=None)
@given(fmt=st.sampled_from(FORMATS), cut=st.integers(min_value=0, max_value=4000),
       flip=st.integers(min_value=0, max_value=4000), byte=st.integers(0, 255))
def test_damaged_caches_fail_cleanly(
    cache_bytes: dict[str, bytes], fmt: str, cut: int, flip: int, byte: int
) -> None:
    data = bytearray(cache_bytes[fmt][:cut])
    if flip < len(data):
        data[flip] = byte
    for names in (None, {"libcuda", "libGLX_nvidia"}):
        try:
            entries = ldcache.parse(bytes(data), names)
        except ldcache.CacheError:
            continue
        assert all(isinstance(e.name, str) and isinstance(e.path, str) for e in entries)


@pytest.mark.parametrize("fmt", FORMATS)
def test_names_filter(cache_bytes: dict[str, bytes], fmt: str) -> None:
    """parse(data, names) is parse(data) restricted to those libraries (key up to .so)."""
    data = cache_bytes[fmt]
    every = ldcache.parse(data)
    for names in ({"libcuda"}, {"libcuda", "libGLX_nvidia", "libnope"}, set(), {"libcuda.so"}):
        assert ldcache.parse(data, names) == [e for e in every
                                              if e.name.split(".so", 1)[0] in names]


def test_names_filter_on_host_cache() -> None:
    if not os.path.exists("/etc/ld.so.cache"):
        pytest.skip("no host ld.so.cache")
    every = ldcache.read("/")
    names = {e.name.split(".so", 1)[0] for e in every[::3]}
    assert ldcache.read("/", names) == [e for e in every if e.name.split(".so", 1)[0] in names]
