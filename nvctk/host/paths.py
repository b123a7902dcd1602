"""Where nvctk's installed artefacts are: libvgpu.so.

libvgpu.so is found, in order, at
  1. the config's vgpu-library (the Debian package's config names /usr/lib/nvctk/libvgpu.so),
  2. <nvctk package>/lib/libvgpu.so (a wheel: setup.py's build_py puts it there),
  3. <repo>/libvgpu/build/libvgpu.so (an editable install of the development tree),
and is "" when none exists: callers that need it use `require_vgpu_library`, which
fails with a message saying how to get one. nvctk-hook is found by `find_hook`; with the
hooks' config and runc's root it makes this invocation's context for the planner.
"""

from __future__ import annotations

import os

from nvctk.base.config import host_driver_root
from nvctk.base.errors import ConfigError, DriverError
from nvctk.edits import HOOK_NAME, host_path_of
from nvctk.host.facts import DEFAULT_RUNTIME_ROOT, Context

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nvctk.base.config import Config

LIBVGPU = "libvgpu.so"
# the nvctk package dir (this file is nvctk/host/paths.py)
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def vgpu_library_candidates() -> tuple[str, ...]:
    """Where an install puts libvgpu.so when the config does not say (in search order)."""
    return (
        os.path.join(PACKAGE_DIR, "lib", LIBVGPU),
        os.path.join(os.path.dirname(PACKAGE_DIR), "libvgpu", "build", LIBVGPU),
    )


def vgpu_library(config: Config | None = None) -> str:
    """Host path of libvgpu.so: config.vgpu_library if set, else the installed one, else ""."""
    if config is not None and config.vgpu_library:
        return config.vgpu_library
    for path in vgpu_library_candidates():
        if os.path.isfile(path):
            return os.path.realpath(path)
    return ""


def require_vgpu_library(config: Config | None = None) -> str:
    """vgpu_library(config), or a ConfigError naming what was tried and how to fix it."""
    path = vgpu_library(config)
    if config is not None and config.vgpu_library:
        if not os.path.isfile(path):
            where = config.path or "the nvctk config"
            # a FIFO, /dev/zero, a directory: there, but not a library
            why = "not a regular file" if os.path.lexists(path) else "no such file"
            raise ConfigError(f"{where}: vgpu-library {path}: {why}")
        return path
    if not path:
        raise ConfigError(
            "GPU limits need libvgpu.so, which this nvctk install lacks (looked at "
            + ", ".join(vgpu_library_candidates())
            + "): build it with `make -C libvgpu` or set vgpu-library in the nvctk config"
        )
    return path


def find_hook(config: Config, argv0: str | None = None) -> str:
    """config hook-path, else nvctk-hook beside this executable (argv0, else
    sys.argv[0]), else on PATH."""
    if config.hook_path:
        if not os.path.isabs(config.hook_path):
            raise ConfigError(f"{config.path or 'config'}: hook-path must be absolute")
        return config.hook_path
    if argv0 is None:
        import sys  # already loaded: a dict lookup

        argv0 = sys.argv[0]
    if argv0:
        beside = os.path.join(os.path.dirname(os.path.realpath(argv0)), HOOK_NAME)
        if os.access(beside, os.X_OK):
            return beside
    # shutil.which, without importing shutil (start time: bz2, lzma, fnmatch)
    for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
        candidate = os.path.join(d or ".", HOOK_NAME)
        if os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
            return os.path.abspath(candidate)
    raise ConfigError(f"cannot find {HOOK_NAME} (set hook-path in the nvctk config)")


def hook_config_path() -> str | None:
    """NVCTK_CONFIG as the hooks get it: absolute (they run with the bundle as their cwd);
    None when unset."""
    value = os.environ.get("NVCTK_CONFIG")
    return os.path.abspath(value) if value else None


def context(config: Config, *, argv0: str | None = None, hook_path: str | None = None,
            runtime_root: str | None = None, vgpu_state_dir: str = "") -> Context:
    """This invocation's context for the planner (nvctk.host.facts.Context). hook_path:
    nvctk-hook's path when the caller knows it (else find_hook(config, argv0))."""
    return Context(hook_path or find_hook(config, argv0), hook_config_path(),
                   absolute_runtime_root(runtime_root), vgpu_state_dir)


def absolute_runtime_root(runtime_root: str | None) -> str:
    """runc's --root as the hooks need it: runc resolves a relative one against its cwd,
    the hook runs in the bundle."""
    return os.path.normpath(os.path.abspath(runtime_root or DEFAULT_RUNTIME_ROOT))


def spec_hook_env(config: Config, config_path: str | None) -> tuple[str, ...]:
    """The env of the hooks a CDI spec names: the nvctk config they load (None: the
    default path), as the host names it (a file under the driver root this process
    sees elsewhere is the host's file under the host's root)."""
    if not config_path:
        return ()
    path = host_path_of(config.driver_root, host_driver_root(config),
                        os.path.abspath(config_path))
    return (f"NVCTK_CONFIG={path}",)


def check_driver_root(config: Config) -> None:
    """That the driver is where this process looks (a node component's first step): a
    DriverError saying which root, as the host names it, and what to do, before any
    spec or slice is written from a root that is wrong, unreadable or driverless."""
    from nvctk.host import nvml  # start time: a node command's, not the runtime's

    seen, host = config.driver_root, host_driver_root(config)
    on_host = f" (the host's {host})" if host != seen else ""
    if not os.path.isdir(seen):
        why = "not a directory" if os.path.lexists(seen) else "no such directory"
        raise DriverError(f"driver root {seen}{on_host}: {why}: {_driver_root_hint(seen, host)}")
    if not os.access(seen, os.R_OK | os.X_OK):
        raise DriverError(f"driver root {seen}{on_host}: not readable by this process (uid "
                          f"{os.getuid()}): {_driver_root_hint(seen, host)}")
    try:
        nvml.find_library(seen)
    except DriverError as e:
        raise DriverError(f"{e}{on_host}: {_driver_root_hint(seen, host)}")


def _driver_root_hint(seen: str, host: str) -> str:
    if seen != host:
        return (f"mount the host's driver root ({host}: / for a driver installed on the node, "
                f"/run/nvidia/driver for a driver container) at {seen} (the DaemonSet's "
                "driver-root hostPath) and name it in NVCTK_HOST_DRIVER_ROOT; a node without "
                "the NVIDIA driver must not run this Pod (its nodeSelector)")
    return "install the NVIDIA driver, or set driver-root in the nvctk config to where it is"
