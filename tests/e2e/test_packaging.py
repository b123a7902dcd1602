"""Packaging: the wheel, the Debian package, nvctk.host.paths.

The launchers themselves (runtime_shim/launcher.c) are tested in test_launcher.py;
here, that the wheel and the .deb carry them and that they run where installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from nvctk.base.config import Config
from nvctk.base.errors import ConfigError
from nvctk.host import paths
from support import wait

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
SITE_PACKAGES = sysconfig.get_paths()["purelib"]
# the interpreter the venv was made from: no site-packages of ours, same ABI
BASE_PYTHON = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
RUNC_ARGV = ["--root", "/run/x y", "--log-format", "json", "kill", "ctr-1", "SIGKILL"]
COPY_EXCLUDES = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache",
                 ".mypy_cache", ".ruff_cache"}


def _run(argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None,
         input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=cwd,
                          input=input)


def _fake_runtime(tmp: Path) -> tuple[Path, Path, Path]:
    """(fake runtime, the file it records its argv in, an nvctk config naming it)."""
    record = tmp / "argv.rec"
    fake = tmp / "fake-runtime"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\0' \"$0\" \"$@\" > '{record}'\n")
    fake.chmod(0o755)
    config = tmp / "config.toml"
    config.write_text(f'runtimes = ["{fake}"]\n')
    return fake, record, config


def _check_passthrough(launcher: Path | str, tmp: Path, env: dict[str, str] | None = None) -> None:
    fake, record, config = _fake_runtime(tmp)
    env = {**(env or os.environ), "NVCTK_CONFIG": str(config)}
    for _ in range(2):  # Python (which leaves the launcher its cache), then the launcher
        record.unlink(missing_ok=True)
        r = _run([str(launcher), *RUNC_ARGV], env=env, cwd=tmp)
        assert r.returncode == 0, r.stderr
        assert record.read_bytes().split(b"\0")[:-1] == [str(fake).encode()] + [
            a.encode() for a in RUNC_ARGV
        ]


# --- nvctk.host.paths ----------------------------------------------------------------


def test_vgpu_library_config_wins(tmp_path: Path) -> None:
    assert paths.vgpu_library(Config(vgpu_library="/opt/x/libvgpu.so")) == "/opt/x/libvgpu.so"


def test_vgpu_library_search_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "site" / "nvctk"
    dev = tmp_path / "site" / "libvgpu" / "build" / "libvgpu.so"
    monkeypatch.setattr(paths, "PACKAGE_DIR", str(pkg))
    assert paths.vgpu_library() == ""
    assert paths.vgpu_library(Config()) == ""
    with pytest.raises(ConfigError, match=r"lacks.*make -C libvgpu.*vgpu-library"):
        paths.require_vgpu_library(Config())
    dev.parent.mkdir(parents=True)
    dev.write_bytes(b"\x7fELF")
    assert paths.vgpu_library() == str(dev)
    (pkg / "lib").mkdir(parents=True)
    (pkg / "lib" / "libvgpu.so").symlink_to(dev)  # the .deb's layout: a link
    assert paths.vgpu_library(Config()) == str(dev)
    (pkg / "lib" / "libvgpu.so").unlink()
    (pkg / "lib" / "libvgpu.so").write_bytes(b"\x7fELF")
    assert paths.require_vgpu_library() == str(pkg / "lib" / "libvgpu.so")


def test_require_vgpu_library_names_a_missing_configured_file(tmp_path: Path) -> None:
    cfg = Config(vgpu_library=str(tmp_path / "nope.so"), path="/etc/nvctk/config.toml")
    with pytest.raises(ConfigError, match=r"/etc/nvctk/config.toml: vgpu-library .*nope.so"):
        paths.require_vgpu_library(cfg)


def _check_hook(hook: Path | str, env: dict[str, str] | None = None) -> None:
    """The hook starts, imports nvctk.hook.prestart (and nvctk._sys) and rejects a bad state."""
    r = _run([str(hook), "prestart"], input="{}", env=env)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("nvctk-hook: ") and "Traceback" not in r.stderr, r.stderr


LAUNCHERS = ("nvctk", "nvctk-hook", "nvctk-runtime")


# --- the wheel ------------------------------------------------------------------


def _copy_tree(dst: Path) -> Path:
    def ignore(d: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n in COPY_EXCLUDES or n.endswith(".egg-info")}
        if os.path.samefile(d, REPO / "libvgpu"):
            skip.add("build")
        return skip

    shutil.copytree(REPO, dst, ignore=ignore, symlinks=True)
    return dst


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel (libvgpu.so included), built from a clean copy of the tree."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = _copy_tree(tmp / "src")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(src), "-w", str(tmp)]
    r = _run(cmd, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    # a libvgpu that does not build fails here: it is part of the package
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = tmp.glob("nvctk-*.whl")
    return whl


@pytest.fixture(scope="module")
def wheel_target(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pip install --target, dependencies included: the launchers start Python with -I,
    so PYTHONPATH cannot supply them; what is in the target dir is all they get."""
    target = tmp_path_factory.mktemp("target")
    r = _run([BASE_PYTHON, "-m", "pip", "install", "-q", "--no-compile",
              "--target", str(target), str(wheel)],
             env={**os.environ, "PYTHONPATH": SITE_PACKAGES, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert r.returncode == 0, r.stderr
    return target


@pytest.mark.slow
def test_wheel_contents(wheel: Path) -> None:
    whl = wheel
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        scripts = sorted(n for n in names if ".data/scripts/" in n)
        assert [n.rsplit("/", 1)[1] for n in scripts] == list(LAUNCHERS)
        for script in scripts:  # the compiled launchers, executable
            assert z.read(script)[:4] == b"\x7fELF"
            assert z.getinfo(script).external_attr >> 16 & 0o111
        assert not [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    for need in ("nvctk/cli/main.py", "nvctk/cli/hook.py", "nvctk/cli/runtime.py",
                 "nvctk/oci/runc_argv.py", "nvctk/runtime/passthrough.py", "nvctk/py.typed"):
        assert need in names
    assert [n for n in names if n.startswith("nvctk/sim/csrc/") and n.endswith(".c")]
    top = {n.split("/", 1)[0] for n in names}
    assert {t for t in top if not t.startswith("nvctk")} == set(), top
    assert "nvctk/lib/libvgpu.so" in names
    # the compiled syscall module the hook and the runtime import (nvctk/_sys.c)
    assert [n for n in names if n.startswith("nvctk/_sys.") and n.endswith(".so")], names
    with zipfile.ZipFile(whl) as z:
        assert z.read("nvctk/lib/libvgpu.so")[:4] == b"\x7fELF"


@pytest.mark.slow
def test_wheel_installed_cli_runs(wheel_target: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{wheel_target}:{SITE_PACKAGES}"}
    cwd = wheel_target.parent  # not the repo: its nvctk/ would come first on sys.path
    r = _run([BASE_PYTHON, "-c", "import nvctk.cli; print(nvctk.cli.__file__)"], env=env, cwd=cwd)
    assert r.stdout.startswith(str(wheel_target)), r.stdout + r.stderr
    # the launcher ignores PYTHONPATH (-I): click comes from the target dir
    r = _run([str(wheel_target / "bin" / "nvctk"), "config", "default"],
             env={"PATH": "/usr/bin:/bin"}, cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert "runtimes = " in r.stdout and "vgpu-library" in r.stdout


@pytest.fixture(scope="module")
def wheel_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv (Debian's python3) with the wheel and its dependencies installed."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    assert _run([BASE_PYTHON, "-m", "venv", str(venv)]).returncode == 0
    r = _run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)],
             env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    return venv


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("runc"), reason="needs root and runc")
def test_wheel_in_a_fresh_venv(wheel_venv: Path, tmp_path: Path) -> None:
    """sim init, info, and a capped GPU container whose hook and libvgpu.so are the
    venv's: nothing of the development tree is used."""
    from nvctk.sim.rootfs import build_rootfs

    bin_ = wheel_venv / "bin"
    env = {"PATH": f"{bin_}:/usr/sbin:/usr/bin:/sbin:/bin",
           # the session's cache dir, not the host's /run/nvctk (conftest.passthrough_cache)
           "NVCTK_PASSTHROUGH_CACHE": os.environ["NVCTK_PASSTHROUGH_CACHE"]}
    sim = tmp_path / "sim"
    r = _run([str(bin_ / "nvctk"), "sim", "init", str(sim), "--gpus", "2"], env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    env["NVCTK_CONFIG"] = str(sim / "config.toml")
    r = _run([str(bin_ / "nvctk"), "info", "--json"], env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["gpus"]) == 2

    bundle = tmp_path / "bundle"
    build_rootfs(str(bundle / "rootfs"))
    assert _run(["runc", "spec"], cwd=bundle).returncode == 0
    spec = json.loads((bundle / "config.json").read_text())
    spec["process"]["terminal"] = False
    spec["process"]["args"] = ["sh", "-c", "nvidia-smi -L; cat /etc/ld.so.preload"]
    spec["process"]["env"] += ["NVIDIA_VISIBLE_DEVICES=0", "CUDA_DEVICE_MEMORY_LIMIT=1g"]
    (bundle / "config.json").write_text(json.dumps(spec))
    state = tmp_path / "runc-state"
    ctr = f"wheel-{os.getpid()}"
    out = tmp_path / "out.txt"
    try:
        # the container keeps create's stdio: a file, not a pipe this test would wait on
        with open(out, "w") as f:
            created = subprocess.run([str(bin_ / "nvctk-runtime"), "--root", str(state),
                                      "create", "--bundle", str(bundle), ctr], env=env,
                                     cwd=bundle, stdout=f, stderr=subprocess.STDOUT, timeout=120)
        assert created.returncode == 0, out.read_text()
        hooks = json.loads((bundle / "config.json").read_text())["hooks"]
        assert [h["path"] for h in hooks["prestart"]] == [str(bin_ / "nvctk-hook")]
        site = Path(_run([str(bin_ / "python"), "-c", "import sysconfig; print("
                          "sysconfig.get_paths()['purelib'])"]).stdout.strip())
        libvgpu = site / "nvctk" / "lib" / "libvgpu.so"
        assert libvgpu.is_file()
        assert str(libvgpu) in (bundle / "nvctk-edits.json").read_text()
        r = _run(["runc", "--root", str(state), "start", ctr], env=env)
        assert r.returncode == 0, r.stderr
        wait.until(lambda: json.loads(_run(["runc", "--root", str(state), "state", ctr]).stdout)
                   ["status"] == "stopped", 10, "the container to stop")
        text = out.read_text()
        assert "GPU 0: NVIDIA H100 80GB HBM3" in text and "libvgpu.so" in text, text
    finally:
        _run([str(bin_ / "nvctk-runtime"), "--root", str(state), "delete", "--force", ctr],
             env=env)
    assert not (state / ctr).exists()


@pytest.mark.slow
def test_wheel_launchers_run_from_a_target_dir(wheel_target: Path, tmp_path: Path) -> None:
    """pip --target: bin/ beside the packages, no python3 there (/usr/bin's is used)."""
    _check_passthrough(wheel_target / "bin" / "nvctk-runtime", tmp_path)
    _check_hook(wheel_target / "bin" / "nvctk-hook")


# --- the Debian package ---------------------------------------------------------


@pytest.fixture(scope="module")
def deb(built_deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package built from this tree (once per run: support/packages.py), copied to a dir
    of this module's (test_deb_contents extracts beside it)."""
    return Path(shutil.copy(built_deb, tmp_path_factory.mktemp("deb")))


@pytest.mark.slow
def test_deb_contents(deb: Path) -> None:
    listing = _run(["dpkg-deb", "-c", str(deb)]).stdout
    files = {line.split()[5].removeprefix(".") for line in listing.splitlines()}
    for need in ("/usr/bin/nvctk-runtime", "/usr/bin/nvctk", "/usr/bin/nvctk-hook",
                 "/usr/lib/nvctk/libvgpu.so", "/etc/nvctk/config.toml",
                 "/usr/lib/nvctk/python/nvctk/cli/runtime.py",
                 "/usr/lib/nvctk/python/nvctk/cli/main.py",
                 "/usr/lib/nvctk/python/nvctk/cli/hook.py",
                 "/usr/lib/nvctk/python/nvctk/lib/libvgpu.so",
                 "/usr/lib/nvctk/python/click/__init__.py"):
        assert need in files, need
    assert [f for f in files if f.startswith("/usr/lib/nvctk/python/nvctk/_sys.")
            and f.endswith(".so")], "the compiled nvctk._sys"
    assert not [f for f in files if f.startswith("/usr/lib/nvctk/python/bin")]
    assert not [f for f in files if f.startswith(("/usr/lib/nvctk/python/cli/",
                                                  "/usr/lib/nvctk/python/hooks/"))]
    info = _run(["dpkg-deb", "-f", str(deb), "Package", "Depends"]).stdout
    assert "Package: nvctk" in info and "python3 (>= " in info
    assert _run(["dpkg-deb", "-e", str(deb), str(deb.parent / "ctl")]).returncode == 0
    assert (deb.parent / "ctl" / "conffiles").read_text().split() == ["/etc/nvctk/config.toml"]


@pytest.mark.slow
def test_deb_extracted_runs(deb: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert _run(["dpkg", "-x", str(deb), str(root)]).returncode == 0
    pydir = root / "usr" / "lib" / "nvctk" / "python"
    code = ("import sys; sys.path.insert(0, sys.argv.pop(1)); import nvctk.host.paths, nvctk._sys;"
            "print(nvctk.host.paths.vgpu_library()); from nvctk.cli.main import main;"
            "sys.argv[0] = 'nvctk'; sys.exit(main())")
    r = _run(["/usr/bin/python3", "-I", "-S", "-c", code, str(pydir), "config", "default"])
    assert r.returncode == 0, r.stderr
    lib_line, rest = r.stdout.split("\n", 1)
    assert lib_line == str(root / "usr" / "lib" / "nvctk" / "libvgpu.so")
    assert "runtimes = " in rest
    for exe in LAUNCHERS:
        assert (root / "usr" / "bin" / exe).read_bytes()[:4] == b"\x7fELF"
    # as installed: the package in ../lib/nvctk/python, /usr/bin/python3
    _check_passthrough(root / "usr" / "bin" / "nvctk-runtime", tmp_path)
    _check_hook(root / "usr" / "bin" / "nvctk-hook")
