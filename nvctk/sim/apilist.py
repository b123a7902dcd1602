"""Every entry point name of the CUDA driver API and of NVML that the mocks export.

The names are data (nvctk/sim/data/cuda_api.txt, nvml_api.txt), derived once from
the public headers of the versions the simulated host claims (CUDA 12.4 `cuda.h`
and its GL/EGL/VDPAU/profiler companions; the `nvml.h` of driver 550) and kept in
the repository, so building a sim needs no header. A real libcuda/libnvidia-ml
exports every versioned form (cuMemAlloc, cuMemAlloc_v2, cuMemcpy_ptds, nvmlInit,
nvmlInit_v2): interposers such as HAMi-core dlsym() all of them, so the header is
preprocessed once per define set that selects another form, and the union kept.

Regenerate (headers from PyPI's nvidia-cuda-runtime-cu12 / nvidia-nvml-dev-cu12):
    python -m nvctk.sim.apilist cuda .../nvidia/cuda_runtime/include \
        "nvidia-cuda-runtime-cu12 12.4.127" > nvctk/sim/data/cuda_api.txt
    python -m nvctk.sim.apilist nvml .../nvidia/nvml_dev/include \
        "nvidia-nvml-dev-cu12 12.4.127" > nvctk/sim/data/nvml_api.txt
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Literal, NamedTuple

DATA = Path(__file__).resolve().parent / "data"
Kind = Literal["cuda", "nvml"]
FILES: dict[Kind, str] = {"cuda": "cuda_api.txt", "nvml": "nvml_api.txt"}
# entry points of one shape, generated into the mock (see getters())
GETTER_FILES: dict[Kind, str] = {"nvml": "nvml_getters.txt"}
# cuGetProcAddress's versioned table (see procs())
PROCS_FILE = "cuda_procs.txt"
# the CUDA enums of csrc/cuda_types.h (see enums())
ENUMS_FILE = "cuda_enums.txt"
# cuDeviceGetAttribute's values and cuGetErrorString's texts (see table())
ATTRIBUTES_FILE, ERRORS_FILE = "cuda_attributes.txt", "cuda_errors.txt"

# The status a stub returns: CUDA_ERROR_NOT_SUPPORTED, NVML_ERROR_NOT_SUPPORTED.
NOT_SUPPORTED: dict[Kind, int] = {"cuda": 801, "nvml": 3}

# Names that return something other than the status enum: a stub returning an int
# there would crash the caller, so the mocks implement these for real (a test checks).
NON_STATUS: dict[Kind, frozenset[str]] = {
    "cuda": frozenset(),
    "nvml": frozenset({"nvmlErrorString"}),
}

# (header, define sets) per kind; each define set selects another versioned form
_CUDA_DEFINES = ((), ("CUDA_API_PER_THREAD_DEFAULT_STREAM",), ("__CUDA_API_VERSION_INTERNAL",))
_SOURCES: dict[Kind, tuple[tuple[str, tuple[tuple[str, ...], ...]], ...]] = {
    "cuda": (
        ("cuda.h", _CUDA_DEFINES),
        ("cudaGL.h", _CUDA_DEFINES),
        ("cudaEGL.h", _CUDA_DEFINES),
        ("cudaVDPAU.h", _CUDA_DEFINES),
    ),
    "nvml": (("nvml.h", ((), ("NVML_NO_UNVERSIONED_FUNC_DEFS",))),),
}
# the window-system headers the graphics interop headers include: only their names
# matter to the preprocessor, so empty stand-ins do
_FAKE_INCLUDES = ("GL/gl.h", "EGL/egl.h", "EGL/eglext.h", "KHR/khrplatform.h", "vdpau/vdpau.h")
_DECL = {
    "cuda": re.compile(r"\bCUresult\s+(?:CUDAAPI\s+)?(cu[A-Z]\w*)\s*\("),
    "nvml": re.compile(
        r"(?:\bnvmlReturn_t|\bconst\s+(?:DECLDIR\s+)?char\s*\*)\s*(?:DECLDIR\s+)?(nvml[A-Z]\w*)\s*\("
    ),
}
# cudaProfiler.h is not shipped on PyPI; its three entry points are named by the
# PFN_ typedefs of cudaProfilerTypedefs.h
_PFN = re.compile(r"\bPFN_(cu[A-Z][A-Za-z0-9]*?)(?:_v\d+)?\b")


def names(kind: Kind) -> tuple[str, ...]:
    """The entry point names of `kind`, sorted, from the repository's data file."""
    with open(DATA / FILES[kind]) as f:
        return tuple(
            line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")
        )


class Getter(NamedTuple):
    """An entry point `name(handle, type *out)`: the handle checked at `kind` (the
    mock's check() level), out not NULL, then `*out = expression`."""

    name: str
    type: str
    kind: int
    expression: str


def getters(kind: Kind) -> tuple[Getter, ...]:
    """The generated getters of `kind` (data/<kind>_getters.txt: `name | type | kind |
    expression` a line), each an entry point of names(kind)."""
    if kind not in GETTER_FILES:
        return ()
    known = set(names(kind))
    out = []
    with open(DATA / GETTER_FILES[kind]) as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            fields = [x.strip() for x in line.split("|")]
            if len(fields) != 4 or fields[0] not in known or not fields[2].isdigit():
                raise ValueError(f"{GETTER_FILES[kind]}:{n}: not `name | type | kind | "
                                 f"expression` of an entry point in {FILES[kind]}: {line!r}")
            out.append(Getter(fields[0], fields[1], int(fields[2]), fields[3]))
    return tuple(out)


class Proc(NamedTuple):
    """A cuGetProcAddress row: `name` asked for with a CUDA version >= `version` gets
    `symbol` (the newest such row wins)."""

    name: str
    version: int
    symbol: str


def procs() -> tuple[Proc, ...]:
    """The rows of data/cuda_procs.txt (`name | version | symbol`): a symbol is an entry
    point of names("cuda") or a newer form the mock defines itself (cuCtxCreate_v4)."""
    out = []
    with open(DATA / PROCS_FILE) as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            fields = [x.strip() for x in line.split("|")]
            if len(fields) != 3 or not fields[1].isdigit() or not all(
                    re.fullmatch(r"cu[A-Z]\w*", x) for x in (fields[0], fields[2])):
                raise ValueError(f"{PROCS_FILE}:{n}: not `name | version | symbol`: {line!r}")
            out.append(Proc(fields[0], int(fields[1]), fields[2]))
    return tuple(out)


def table(file: str, columns: tuple[int, int]) -> tuple[tuple[str, ...], ...]:
    """The rows of data/<file>: `a | b [| c]` a line (between columns[0] and columns[1]
    fields), the first a C identifier."""
    out = []
    with open(DATA / file) as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            fields = tuple(x.strip() for x in line.split("|"))
            if not columns[0] <= len(fields) <= columns[1] or not re.fullmatch(r"[A-Z_][A-Z0-9_]*",
                                                                                fields[0]):
                raise ValueError(f"{file}:{n}: not {columns[0]} to {columns[1]} fields: {line!r}")
            out.append(fields)
    return tuple(out)


def enums() -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """(tag, typedef name, enumerators) of data/cuda_enums.txt: a line `enum TAG NAME`
    starts a block, each further line is `NAME = VALUE` or `NAME`."""
    out: list[tuple[str, str, list[str]]] = []
    with open(DATA / ENUMS_FILE) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            head = re.fullmatch(r"enum (\w+) (\w+)", line)
            if head:
                out.append((head[1], head[2], []))
            elif out and re.fullmatch(r"[A-Z_][A-Z0-9_]*(?: = [^,]+)?", line):
                out[-1][2].append(line)
            else:
                raise ValueError(f"{ENUMS_FILE}:{n}: not `enum TAG NAME` or an enumerator: {line!r}")
    return tuple((tag, name, tuple(items)) for tag, name, items in out)


def _preprocess(header: Path, defines: tuple[str, ...], includes: list[str]) -> str:
    cmd = ["gcc", "-E", "-P", *(f"-D{d}" for d in defines), *(f"-I{i}" for i in includes), str(header)]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def derive(kind: Kind, include_dir: str) -> list[str]:
    """The names declared by the headers in `include_dir` (see the module doc)."""
    inc = Path(include_dir)
    found: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="nvsim-hdr-") as fake:
        for rel in _FAKE_INCLUDES:
            p = Path(fake, rel)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.touch()
        for header, define_sets in _SOURCES[kind]:
            if not (inc / header).is_file():
                raise FileNotFoundError(f"{inc / header} is missing")
            for defines in define_sets:
                text = _preprocess(inc / header, defines, [fake, str(inc)])
                found.update(_DECL[kind].findall(text))
    if kind == "cuda" and (inc / "cudaProfilerTypedefs.h").is_file():
        found.update(_PFN.findall((inc / "cudaProfilerTypedefs.h").read_text()))
    return sorted(found)


def _version_line(kind: Kind, include_dir: str) -> str:
    header = Path(include_dir, "cuda.h" if kind == "cuda" else "nvml.h").read_text()
    pat = r"#define\s+CUDA_VERSION\s+(\d+)" if kind == "cuda" else r"#define\s+NVML_API_VERSION_STR\s+\"(\d+)\""
    m = re.search(pat, header)
    what = "CUDA_VERSION" if kind == "cuda" else "NVML_API_VERSION"
    return f"{what} {m.group(1) if m else '?'}"


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or argv[0] not in FILES:
        print("usage: python -m nvctk.sim.apilist cuda|nvml INCLUDE_DIR [SOURCE]", file=sys.stderr)
        return 2
    kind: Kind = "cuda" if argv[0] == "cuda" else "nvml"
    found = derive(kind, argv[1])
    src = ", ".join(h for h, _ in _SOURCES[kind])
    if kind == "cuda":
        src += ", cudaProfilerTypedefs.h"
    if len(argv) == 3:
        src += f" of {argv[2]}"
    sys.stdout.write(
        f"# {kind} entry points exported by the simulated driver's mock ({len(found)} names).\n"
        f"# Derived by `python -m nvctk.sim.apilist {kind} INCLUDE_DIR` from the public\n"
        f"# headers ({src}; {_version_line(kind, argv[1])});\n# see nvctk/sim/apilist.py.\n"
        f"# {os.path.basename(FILES[kind])}: one name a line; not simulated ones return NOT_SUPPORTED.\n"
        + "".join(f"{n}\n" for n in found)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
