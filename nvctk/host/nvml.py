"""What the host's GPUs are, asked of NVML (real pynvml) loaded from the driver root.

The driver root's own libnvidia-ml.so.1 is found through the root's ld.so.cache
and handed to pynvml, so a driver root other than / (a simulated host, a driver
container) is queried with its own library, never the host's. For such roots
NVSIM_DEV_DIR=<root>/dev is set while NVML runs: the simulated NVML reads its
device nodes there; the real driver ignores the variable.

GPU creates go through nvctk.host.cache.load_host, which serves these answers from a
validated cache and imports this module (and pynvml) only on a miss.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

import pynvml

from nvctk.base.errors import DriverError
from nvctk.base.inroot import resolve_in_root
from nvctk.host import ldcache

# The records live in nvctk.host.inventory (which never imports pynvml);
# re-exported here for the callers that name them nvml.HostInfo & co.
from nvctk.host.inventory import GpuInfo, HostInfo, MigInfo

NVML_SONAME = "libnvidia-ml.so.1"
MIB = 1024 * 1024
GIB = 1024 * MIB

# NVML brand enum -> the lower-case names NVIDIA_REQUIRE_BRAND / brand=... use
BRANDS: dict[int, str] = {
    0: "unknown",
    1: "quadro",
    2: "tesla",
    3: "nvs",
    4: "grid",
    5: "geforce",
    6: "titan",
    7: "nvidiavapps",
    8: "nvidiavpc",
    9: "nvidiavcs",
    10: "nvidiavws",
    11: "nvidiacloudgaming",
    12: "quadrortx",
    13: "nvidiartx",
    14: "nvidia",
    15: "geforcertx",
    16: "titanrtx",
}

_lock = threading.Lock()  # one NVML session at a time: pynvml's library is process-global


def find_library(driver_root: str) -> str:
    """Host path of the root's libnvidia-ml.so.1, via the root's ld.so.cache."""
    root = os.path.abspath(driver_root)
    where = ldcache.cache_path(root)
    try:
        entries = ldcache.read(root)
    except ldcache.CacheError as err:
        raise DriverError(f"no NVIDIA driver found at driver root {root}: {err}")
    for entry in entries:
        if entry.name == NVML_SONAME and entry.arch == "x86-64":
            path = resolve_in_root(root, entry.path)
            if os.path.isfile(path):
                return path
            raise DriverError(
                f"no NVIDIA driver found: {where} lists {NVML_SONAME} at {entry.path}, "
                f"but {path} does not exist"
            )
    raise DriverError(f"no NVIDIA driver found: {NVML_SONAME} is not in {where}")


def _text(v: str | bytes) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else v


T = TypeVar("T")


def _optional(fn: Callable[[], T], default: T) -> T:
    """fn() unless NVML says Not Supported / Not Found / Function Not Found."""
    try:
        return fn()
    except pynvml.NVMLError as e:
        if e.value in (
            pynvml.NVML_ERROR_NOT_SUPPORTED,
            pynvml.NVML_ERROR_NOT_FOUND,
            pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        ):
            return default
        raise


def mig_profile_name(gi_slices: int, ci_slices: int, mig_memory_mib: int, gpu_memory_bytes: int) -> str:
    """NVIDIA's naming (go-nvlib): memory as a fraction of the GPU rounded up to 1/8,
    times the GPU's memory in whole GiB; "<ci>c." prefix when the CI is smaller than the GI."""
    frac = (mig_memory_mib * MIB) / gpu_memory_bytes
    frac = math.ceil(frac * 8) / 8
    total_gb = (gpu_memory_bytes + GIB - 1) // GIB
    gb = round(frac * total_gb)
    name = f"{gi_slices}g.{gb}gb"
    return name if ci_slices in (0, gi_slices) else f"{ci_slices}c.{name}"


def _mig_devices(handle: Any, gpu_memory_bytes: int) -> tuple[MigInfo, ...]:
    out: list[MigInfo] = []
    count = _optional(lambda: pynvml.nvmlDeviceGetMaxMigDeviceCount(handle), 0)
    for i in range(count):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except pynvml.NVMLError as e:
            if e.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                continue
            raise
        mem_mib = pynvml.nvmlDeviceGetMemoryInfo(mig).total // MIB
        # NVML names a MIG device "<GPU name> MIG <profile>"; else derive it from attributes
        name = _text(_optional(partial(pynvml.nvmlDeviceGetName, mig), ""))
        profile = name.rsplit(" MIG ", 1)[1].strip() if " MIG " in name else ""
        if not profile:
            attrs = _optional(partial(pynvml.nvmlDeviceGetAttributes, mig), None)
            if attrs is not None:
                profile = mig_profile_name(
                    attrs.gpuInstanceSliceCount, attrs.computeInstanceSliceCount,
                    int(attrs.memorySizeMB) or mem_mib, gpu_memory_bytes,
                )
        out.append(
            MigInfo(
                index=len(out),
                uuid=_text(pynvml.nvmlDeviceGetUUID(mig)),
                gpu_instance=pynvml.nvmlDeviceGetGpuInstanceId(mig),
                compute_instance=pynvml.nvmlDeviceGetComputeInstanceId(mig),
                profile=profile,
                memory_mib=mem_mib,
            )
        )
    return tuple(out)


def _gpu(index: int) -> GpuInfo:
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h).total
    major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
    brand = _optional(lambda: pynvml.nvmlDeviceGetBrand(h), 0)
    mode = _optional(lambda: pynvml.nvmlDeviceGetMigMode(h), [0, 0])
    mig_enabled = mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE
    return GpuInfo(
        index=index,
        uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
        name=_text(pynvml.nvmlDeviceGetName(h)),
        minor=pynvml.nvmlDeviceGetMinorNumber(h),
        pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(h).busId),
        memory_mib=mem // MIB,
        compute_capability=f"{major}.{minor}",
        brand=BRANDS.get(brand, "unknown"),
        mig_enabled=mig_enabled,
        mig_devices=_mig_devices(h, mem) if mig_enabled else (),
    )


@contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def _pynvml_for(lib_path: str) -> tuple[Any, ctypes.CDLL]:
    """A pynvml module bound to the library at lib_path.

    pynvml loads "libnvidia-ml.so.1" through the dynamic loader unless its `nvmlLib`
    is already set, and keeps that library (and the function pointers it looked up)
    for the life of its module. So the first library gets the imported pynvml, and
    each other library its own instance of the module (importlib's public API; only a
    process that queries several driver roots, like the tests, pays for a second).
    Were `nvmlLib` gone in a later pynvml, this says so instead of letting pynvml load
    whatever libnvidia-ml.so.1 the host's loader finds."""
    if lib_path in _bound:
        return _bound[lib_path]
    try:
        lib = ctypes.CDLL(lib_path)
    except OSError as e:
        raise DriverError(f"cannot load {lib_path}: {e}")
    if "nvmlLib" not in vars(pynvml):  # loud, not a silent load of the host's library
        raise DriverError("this nvidia-ml-py (pynvml) cannot be given a library to use")
    mod: Any = pynvml
    if _bound or vars(pynvml)["nvmlLib"] is not None:
        spec = importlib.util.find_spec("pynvml")
        if spec is None or spec.loader is None:
            raise DriverError("pynvml (nvidia-ml-py) is not importable")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    mod.nvmlLib = lib
    _bound[lib_path] = (mod, lib)
    return mod, lib


_bound: dict[str, tuple[Any, ctypes.CDLL]] = {}  # library path -> (pynvml module, library)


def held(driver_root: str) -> Any:
    """The pynvml module bound to the root's library, NVML initialised and left so for the
    caller's life (a monitor's, a health watcher's thread): NVML's init is
    reference-counted, so other sessions' shutdowns do not end it. The module lock is held
    only while the (simulated) NVML enumerates."""
    lib = find_library(driver_root)
    root = os.path.abspath(driver_root)
    with _lock, _env("NVSIM_DEV_DIR", None if root == "/" else f"{root}/dev"):
        mod, _ = _pynvml_for(lib)
        mod.nvmlInit()
    return mod


@contextmanager
def session(driver_root: str) -> Iterator[str]:
    """NVML from the root's library, initialised for the duration; yields the library path.
    The module-level name `pynvml` is the module bound to that library inside the block."""
    global pynvml
    lib_path = find_library(driver_root)
    root = os.path.abspath(driver_root)
    dev_dir = None if root == "/" else os.path.join(root, "dev")
    with _lock, _env("NVSIM_DEV_DIR", dev_dir):
        saved = pynvml
        mod, _lib = _pynvml_for(lib_path)
        pynvml = mod
        try:
            try:
                mod.nvmlInit()
            except mod.NVMLError as e:
                hint = ""
                if e.value == mod.NVML_ERROR_DRIVER_NOT_LOADED:
                    hint = (" (is the nvidia kernel module loaded? NVML needs "
                            f"{os.path.join(dev_dir or '/dev', 'nvidiactl')})")
                raise DriverError(f"NVML at {lib_path}: init failed: {e}{hint}")
            try:
                yield lib_path
            finally:
                try:
                    mod.nvmlShutdown()
                except mod.NVMLError:
                    pass
        finally:
            pynvml = saved


def query_host(driver_root: str) -> HostInfo:
    """Driver and CUDA versions and every GPU with its MIG devices; DriverError when the
    root has no usable NVML (the message says where it looked)."""
    with session(driver_root) as lib_path:
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
            cuda = pynvml.nvmlSystemGetCudaDriverVersion()
            count = pynvml.nvmlDeviceGetCount()
            gpus = tuple(_gpu(i) for i in range(count))
        except pynvml.NVMLError as e:
            raise DriverError(f"NVML at {lib_path}: {e}")
    return HostInfo(
        driver_version=driver,
        cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}",
        gpus=gpus,
    )
