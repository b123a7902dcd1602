"""What the simulated driver generates from tables: NVML getters (data/nvml_getters.txt),
each an entry point of the API list defined once; cuGetProcAddress's rows
(data/cuda_procs.txt); a bad table line is refused by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nvctk.sim import apilist, build

CSRC = Path(apilist.__file__).parent / "csrc"


def test_every_getter_is_an_entry_point_defined_once() -> None:
    got = apilist.getters("nvml")
    assert got, "the table is empty"
    names = set(apilist.names("nvml"))
    src = build.generate_getters("nvml")
    hand = (CSRC / "nvml_mock.c").read_text()
    for g in got:
        assert g.name in names
        assert len(re.findall(rf"\b{g.name}\(nvmlDevice_t d", src)) == 1, g.name
        assert not re.search(rf"^nvmlReturn_t {g.name}\(", hand, re.M), f"{g.name} is hand-written too"
    assert '#include "nvml_getters.inc"' in hand


def test_a_bad_line_names_the_file_and_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for text in ("nvmlNoSuchFunction | unsigned | 0 | 1\n", "nvmlDeviceGetMinorNumber | unsigned\n",
                 "nvmlDeviceGetMinorNumber | unsigned | any | 1\n"):
        (tmp_path / "nvml_getters.txt").write_text("# a comment\n" + text)
        for f in ("nvml_api.txt",):
            (tmp_path / f).write_text((apilist.DATA / f).read_text())
        monkeypatch.setattr(apilist, "DATA", tmp_path)
        with pytest.raises(ValueError, match=r"nvml_getters.txt:2: "):
            apilist.getters("nvml")


def test_cuda_has_no_table_yet() -> None:
    assert apilist.getters("cuda") == ()


def test_proc_table_rows_are_generated_in_order() -> None:
    rows = apilist.procs()
    src = build.generate_procs()
    assert len(rows) > 100
    assert [ln for ln in src.splitlines() if ln.startswith("{")] == [
        f'{{"{p.name}", {p.version}, (fnptr){p.symbol}}},' for p in rows]
    assert '#include "cuda_procs.inc"' in (CSRC / "cuda_mock.c").read_text()
    # several versions of one name (the newest one the caller's version allows wins)
    assert {p.version for p in rows if p.name == "cuGraphInstantiate"} == {11000, 12000}


def test_enums_keep_cuda_values() -> None:
    blocks = {name: items for _, name, items in apilist.enums()}
    assert blocks["CUresult"][0] == "CUDA_SUCCESS = 0"
    assert "CUDA_ERROR_OUT_OF_MEMORY = 2" in blocks["CUresult"]
    assert "CUDA_ERROR_NOT_SUPPORTED = 801" in blocks["CUresult"]
    header = build.generate_enums()
    assert "typedef enum cudaError_enum {\n    CUDA_SUCCESS = 0,\n" in header
    assert "    CUDA_ERROR_UNKNOWN = 999\n} CUresult;" in header  # no comma after the last
    assert '#include "cuda_enums.h"' in (CSRC / "cuda_types.h").read_text()


def test_attribute_and_error_tables() -> None:
    attrs = build.generate_attributes()
    assert "    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: v = 32; break;\n" in attrs
    assert "v = hopper ? 1980000 : 1410000; break; /* kHz */" in attrs
    errors = build.generate_errors()
    assert errors.startswith('    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},\n')
    mock = (CSRC / "cuda_mock.c").read_text()
    assert '#include "cuda_attributes.inc"' in mock and '#include "cuda_errors.inc"' in mock
