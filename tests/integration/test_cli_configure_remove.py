"""`nvctk configure --remove` puts back what configure replaced, even after a hand edit
(real files, no daemons; the rest: test_cli_configure_containerd.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import support.configure as _configure
from support.configure import RUNTIME, V2, Run, toml

nv = _configure.nv  # fixture

try:
    import tomllib  # an independent parser checks tomlkit's output
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def _foreign_nvidia(engine: str, tmp_path: Path) -> tuple[Path, str]:
    """The engine's config file under tmp_path, written with a runtime "nvidia" of
    NVIDIA's toolkit (someone else's), and its text."""
    if engine == "containerd":
        cfg = tmp_path / "config.toml"
        text = (f'version = 2\n[{V2}.containerd.runtimes.nvidia]\n'
                '  runtime_type = "io.containerd.runc.v2"\n'
                f'[{V2}.containerd.runtimes.nvidia.options]\n'
                '  BinaryName = "/usr/bin/nvidia-container-runtime"\n')
    else:
        cfg = tmp_path / "daemon.json"
        text = '{"runtimes": {"nvidia": {"path": "/usr/bin/nvidia-container-runtime"}}}\n'
    cfg.write_text(text)
    return cfg, text


@pytest.mark.parametrize("engine", ["containerd", "docker"])
def test_remove_restores_the_foreign_runtime_configure_replaced(nv: Run, tmp_path: Path,
                                                                 engine: str) -> None:
    cfg, text = _foreign_nvidia(engine, tmp_path)
    res = nv("--runtime", engine, "--config", str(cfg))
    assert res.returncode == 0, res.stderr
    assert RUNTIME in cfg.read_text()
    res = nv("--runtime", engine, "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert cfg.read_text() == text


# --- remove puts back what configure replaced, even after a hand edit -------


@pytest.mark.parametrize("cdi", [False, True])
def test_containerd_remove_after_edit_restores_the_previous_default(nv: Run, tmp_path: Path,
                                                                    cdi: bool) -> None:
    cfg = tmp_path / "config.toml"
    text = (f'version = 2\n[{V2}]\n  enable_cdi = false\n[{V2}.containerd]\n'
            '  default_runtime_name = "crun"\n'
            f'[{V2}.containerd.runtimes.crun]\n  runtime_type = "io.containerd.runc.v2"\n'
            f'[{V2}.containerd.runtimes.crun.options]\n  BinaryName = "/usr/bin/crun"\n')
    cfg.write_text(text)
    args = ["--runtime", "containerd", "--config", str(cfg), "--set-as-default"]
    assert nv(*args, *(["--cdi"] if cdi else [])).returncode == 0
    doc = toml(cfg)
    assert doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["default_runtime_name"] == "nvidia"
    assert doc["plugins"]["io.containerd.grpc.v1.cri"]["enable_cdi"] is cdi
    # a hand edit: the .bak no longer matches, and a later configure run overwrote it
    cfg.write_text(cfg.read_text() + "# edited by hand\n")
    assert nv(*args, "--cdi").returncode == 0
    res = nv("--runtime", "containerd", "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert "set back to 'crun'" in res.stdout, res.stdout
    # every key configure changed is as it was: only the hand edit remains
    assert toml(cfg) == tomllib.loads(text)
    assert cfg.read_text().endswith("# edited by hand\n")


def test_docker_remove_after_edit_restores_the_previous_default(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "daemon.json"
    orig = {"default-runtime": "crun", "runtimes": {"crun": {"path": "/usr/bin/crun"}}}
    cfg.write_text(json.dumps(orig, indent=2) + "\n")
    assert nv("--runtime", "docker", "--config", str(cfg), "--set-as-default").returncode == 0
    assert json.loads(cfg.read_text())["default-runtime"] == "nvidia"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "debug": True}, indent=2) + "\n")
    res = nv("--runtime", "docker", "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert json.loads(cfg.read_text()) == {**orig, "debug": True}


def test_crio_remove_restores_a_default_it_replaced_in_the_drop_in(nv: Run, tmp_path: Path) -> None:
    main = tmp_path / "crio.conf"
    main.write_text("[crio.runtime]\ndefault_runtime = \"runc\"\n")
    drop = tmp_path / "crio.conf.d" / "50-site.toml"
    drop.parent.mkdir()
    text = '[crio.runtime]\ndefault_runtime = "kata"\n[crio.runtime.runtimes.kata]\n' \
           'runtime_path = "/usr/bin/kata-runtime"\n'
    drop.write_text(text)
    args = ["--runtime", "crio", "--config", str(main), "--drop-in", str(drop)]
    assert nv(*args, "--set-as-default").returncode == 0
    assert tomllib.loads(drop.read_text())["crio"]["runtime"]["default_runtime"] == "nvidia"
    drop.write_text(drop.read_text() + "# edited\n")
    res = nv(*args, "--remove")
    assert res.returncode == 0, res.stderr
    assert tomllib.loads(drop.read_text()) == tomllib.loads(text)


@pytest.mark.parametrize("engine", ["containerd", "docker"])
def test_remove_after_edit_restores_the_foreign_runtime_configure_replaced(
        nv: Run, tmp_path: Path, engine: str) -> None:
    """As above, but the file was edited by hand since: the .bak no longer matches, and
    the runtime configure replaced still comes back (not deleted with nvctk's)."""
    cfg, text = _foreign_nvidia(engine, tmp_path)
    parse = tomllib.loads if engine == "containerd" else json.loads
    assert nv("--runtime", engine, "--config", str(cfg)).returncode == 0
    edited = cfg.read_text().replace("{", '{"debug": true, ', 1) if engine == "docker" \
        else cfg.read_text() + "# edited\n"
    cfg.write_text(edited)
    res = nv("--runtime", engine, "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert "back to the one configure replaced" in res.stdout, res.stdout
    want = parse(text)
    if engine == "docker":
        want = {"debug": True, **want}
    assert parse(cfg.read_text()) == want
