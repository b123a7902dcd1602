"""`nvctk config` as a process: its errors on stderr."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path


def test_config_show_bad_file_is_one_line_error(
    run_nvctk: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    p = tmp_path / "c.toml"
    p.write_text("nope = 1\n")
    r = run_nvctk("config", "show", config=str(p))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"nvctk: {p}: unknown key 'nope'"]
    assert "Traceback" not in r.stderr
