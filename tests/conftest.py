"""Shared fixtures.

Simulated hosts (nvctk.sim.host.SimHost; need root for device nodes):
    sim_host       session-scoped, 2 whole GPUs (H100 80GB), driver 550.54.15,
                   CUDA 12.4, built once per test session. Treat it as read-only.
    sim_host_mig   session-scoped, 2 GPUs; GPU 0 has MIG devices 3g.40gb, 2g.20gb,
                   1g.10gb (MIG indexes 0, 1, 2); GPU 1 is whole.
    make_sim       function-scoped factory: make_sim(**make_topology_kwargs) builds a
                   fresh sim under tmp_path (for tests that change or break it).
    sim_env        {**os.environ, "NVCTK_CONFIG": sim_host's config.toml}, for
                   subprocesses of nvctk's executables.
Containers:
    rootfs         factory: rootfs(debian=True, with_sample=None|True|path, files=None)
                   builds a busybox + glibc rootfs under tmp_path and returns its path;
                   with_sample=True copies sim_host's cuda-vectoradd to
                   /usr/local/bin/cuda-vectoradd (see nvctk.sim.rootfs).
Packages:
    built_deb      session-scoped: packaging/deb/build.sh's .deb, built once per run (all
                   xdist workers share it: support/packages.py); copy it before writing beside it.
    built_image    session-scoped: `make image`'s OCI archive (localhost/nvctk:VERSION), the
                   same way (packaging/image/build.sh from built_deb's package).
CLI:
    run_nvctk      run_nvctk(*args, env=None, config=None) -> CompletedProcess (text),
                   runs the installed `nvctk` console script; config=PATH sets NVCTK_CONFIG.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nvctk.runtime import passthrough
from nvctk.sim import host
from nvctk.sim.rootfs import build_rootfs
from nvctk.sim.topology import make_topology
from support import packages
from support.exe import nvctk_exe

MIG_LAYOUT = {0: ["3g.40gb", "2g.20gb", "1g.10gb"]}

# A test process that used gRPC (the device plugin's and DRA driver's tests) has gRPC's
# fork handlers registered: each later fork starts a gRPC thread in the child, and the
# prestart's worker, forked by a server the hook tests fork from this process, then
# cannot setns into a mount namespace (EINVAL for a process of more than one thread: CI
# saw it once a file split put a gRPC test before test_hook_served.py on one worker).
# nvctk's own processes that fork the worker (nvctk-runtime, nvctk-hook) never load
# gRPC; the tests' processes must not carry it into theirs either. Read by gRPC when it
# is first imported, which is after this.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "0"


PHASES = ("parallel", "exclusive")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--phase", choices=PHASES, default=None,
        help="parallel: leave out the tests marked exclusive (for pytest -n); exclusive: "
             "only those (run alone). `make test` runs both (tests/README.md).")


def pytest_configure(config: pytest.Config) -> None:
    # an xdist worker runs as `python -c`: in-process code that looks for nvctk's
    # executables beside sys.argv[0] (nvctk.host.paths.find_hook) gets what plain pytest
    # gives it, the venv's bin dir
    if os.environ.get("PYTEST_XDIST_WORKER"):
        sys.argv[0] = os.path.join(os.path.dirname(sys.executable), "pytest")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    phase = config.getoption("--phase")
    if phase is None:
        return
    want = phase == "exclusive"
    keep = [i for i in items if (i.get_closest_marker("exclusive") is not None) == want]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (the simulated host has device nodes)")


@pytest.fixture(scope="session", autouse=True)
def passthrough_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """nvctk-runtime's passthrough cache (nvctk.runtime.passthrough) in a directory of the
    session's, not the host's /run/nvctk: every test config would leave a file there.
    Children (the runtime, daemons the tests start) inherit it from the environment."""
    old = os.environ.get(passthrough.CACHE_VAR)
    d = Path(passthrough.use_cache_dir(str(tmp_path_factory.mktemp("passthrough"))))
    yield d
    if old is None:
        os.environ.pop(passthrough.CACHE_VAR, None)
    else:
        os.environ[passthrough.CACHE_VAR] = old


@pytest.fixture(scope="session")
def sim_host(tmp_path_factory: pytest.TempPathFactory) -> host.SimHost:
    _need_root()
    return host.init(str(tmp_path_factory.mktemp("sim") / "host"), make_topology(gpus=2))


@pytest.fixture(scope="session")
def sim_host_mig(tmp_path_factory: pytest.TempPathFactory) -> host.SimHost:
    _need_root()
    return host.init(
        str(tmp_path_factory.mktemp("simmig") / "host"), make_topology(gpus=2, mig=MIG_LAYOUT)
    )


@pytest.fixture(scope="session")
def built_deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return packages.built_deb(packages.run_dir(tmp_path_factory))


@pytest.fixture(scope="session")
def built_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return packages.built_image(packages.run_dir(tmp_path_factory))


@pytest.fixture
def make_sim(tmp_path: Path) -> Callable[..., host.SimHost]:
    _need_root()
    counter = itertools.count()

    def make(**kwargs: Any) -> host.SimHost:
        return host.init(str(tmp_path / f"sim{next(counter)}"), make_topology(**kwargs))

    return make


@pytest.fixture
def sim_env(sim_host: host.SimHost) -> dict[str, str]:
    return {**os.environ, **sim_host.env}


@pytest.fixture
def rootfs(tmp_path: Path, request: pytest.FixtureRequest) -> Callable[..., str]:
    counter = itertools.count()

    def make(
        debian: bool = True,
        with_sample: bool | str | None = None,
        files: dict[str, str] | None = None,
    ) -> str:
        sample: str | None
        if with_sample is True:
            sample = request.getfixturevalue("sim_host").sample
        else:
            sample = with_sample or None
        return build_rootfs(
            str(tmp_path / f"rootfs{next(counter)}"), debian=debian, with_sample=sample, files=files
        )

    return make


@pytest.fixture
def base(rootfs: Callable[..., str]) -> str:
    """A Debian-like rootfs for bundles to copy (the reliability suite's
    support.reliability.Lab.bundle(None, ..., base=))."""
    return str(rootfs())


@pytest.fixture
def run_nvctk() -> Iterator[Callable[..., subprocess.CompletedProcess[str]]]:
    def run(
        *args: str, env: dict[str, str] | None = None, config: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        e = dict(os.environ if env is None else env)
        if config is not None:
            e["NVCTK_CONFIG"] = config
        return subprocess.run(
            [*nvctk_exe(), *args], env=e, capture_output=True, text=True, timeout=60
        )

    yield run
