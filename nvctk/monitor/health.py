"""A GPU's board readings beside memory and utilization (temperature, power, energy,
clocks, copy/encoder/decoder utilization, PCIe replays, ECC, remapped rows) and its
GPM profile (Hopper and later), from NVML, for the snapshot.

What the GPU does not report (NVML_ERROR_NOT_SUPPORTED, or the entry point missing from
an older driver) stays None, and its series is left out: a dashboard shows "no data",
never a made-up zero. GPM metrics are rates between two samples: the first collection
has none, each later one covers the span since the previous.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from nvctk.monitor.model import GpuHealth

T = TypeVar("T")

TEMPERATURE_GPU = 0
CLOCK_SM, CLOCK_MEM = 1, 2
ECC_CORRECTED, ECC_UNCORRECTED, ECC_VOLATILE = 0, 1, 0
# GPM metric id -> the profile key (dcgm-exporter's DCGM_FI_PROF_* field it feeds)
GPM_METRICS = {
    1: "graphics",  # GRAPHICS_UTIL, % -> GR_ENGINE_ACTIVE
    2: "sm_active",  # SM_UTIL, % -> SM_ACTIVE
    3: "sm_occupancy",  # SM_OCCUPANCY, % -> SM_OCCUPANCY
    5: "tensor",  # ANY_TENSOR_UTIL, % -> PIPE_TENSOR_ACTIVE
    10: "dram",  # DRAM_BW_UTIL, % -> DRAM_ACTIVE
    20: "pcie_tx",  # PCIE_TX_PER_SEC, MiB/s -> PCIE_TX_BYTES (bytes/s)
    21: "pcie_rx",  # PCIE_RX_PER_SEC, MiB/s -> PCIE_RX_BYTES (bytes/s)
}
_MIB = 1 << 20


class Health:
    """Reads GpuHealth per GPU; holds each GPM-capable GPU's previous sample."""

    def __init__(self, nv: Any, handles: dict[int, Any]) -> None:
        self.nv = nv
        self.handles = handles
        self._gpm: dict[int, tuple[Any, Any]] = {}  # GPU index -> (previous, spare) samples
        self._gpm_taken: set[int] = set()
        for index, h in handles.items():
            try:
                if nv.nvmlGpmQueryDeviceSupport(h).isSupportedDevice:
                    self._gpm[index] = (nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc())
            except (nv.NVMLError, AttributeError):
                pass  # no GPM here (an older GPU or driver): its profile stays empty

    def _get(self, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except self.nv.NVMLError:
            return None

    def read(self, index: int) -> GpuHealth:
        nv, h = self.nv, self.handles[index]
        get = self._get
        power = get(lambda: nv.nvmlDeviceGetPowerUsage(h))
        limit = get(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h))
        util = get(lambda: nv.nvmlDeviceGetUtilizationRates(h))
        enc = get(lambda: nv.nvmlDeviceGetEncoderUtilization(h))
        dec = get(lambda: nv.nvmlDeviceGetDecoderUtilization(h))
        rows = get(lambda: nv.nvmlDeviceGetRemappedRows(h))
        mem = get(lambda: nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2))
        return GpuHealth(
            temperature=get(lambda: int(nv.nvmlDeviceGetTemperature(h, TEMPERATURE_GPU))),
            power=power / 1000 if power is not None else None,
            power_limit=limit / 1000 if limit is not None else None,
            energy=get(lambda: int(nv.nvmlDeviceGetTotalEnergyConsumption(h))),
            sm_clock=get(lambda: int(nv.nvmlDeviceGetClockInfo(h, CLOCK_SM))),
            memory_clock=get(lambda: int(nv.nvmlDeviceGetClockInfo(h, CLOCK_MEM))),
            memory_reserved=int(mem.reserved) if mem is not None else None,
            memory_copy_utilization=util.memory / 100 if util is not None else None,
            encoder_utilization=enc[0] / 100 if enc is not None else None,
            decoder_utilization=dec[0] / 100 if dec is not None else None,
            pcie_replays=get(lambda: int(nv.nvmlDeviceGetPcieReplayCounter(h))),
            ecc_corrected=get(lambda: int(nv.nvmlDeviceGetTotalEccErrors(h, ECC_CORRECTED, ECC_VOLATILE))),
            ecc_uncorrected=get(lambda: int(nv.nvmlDeviceGetTotalEccErrors(h, ECC_UNCORRECTED, ECC_VOLATILE))),
            rows_remapped_corrected=rows[0] if rows is not None else None,
            rows_remapped_uncorrected=rows[1] if rows is not None else None,
            row_remap_failure=bool(rows[3]) if rows is not None else None,
            profile=self._profile(index),
        )

    def _profile(self, index: int) -> dict[str, float]:
        """GPM's metrics since the previous collection, as 0-1 ratios and bytes/s."""
        pair = self._gpm.get(index)
        if pair is None:
            return {}
        nv = self.nv
        prev, spare = pair
        try:
            nv.nvmlGpmSampleGet(self.handles[index], spare)
        except nv.NVMLError:
            return {}
        self._gpm[index] = (spare, prev)  # this one is the next span's start
        if index not in self._gpm_taken:
            self._gpm_taken.add(index)
            return {}
        m = nv.c_nvmlGpmMetricsGet_t()
        m.version = nv.NVML_GPM_METRICS_GET_VERSION
        m.numMetrics = len(GPM_METRICS)
        m.sample1, m.sample2 = prev, spare
        for i, mid in enumerate(GPM_METRICS):
            m.metrics[i].metricId = mid
        try:
            nv.nvmlGpmMetricsGet(m)
        except nv.NVMLError:
            return {}
        out = {}
        for i, key in enumerate(GPM_METRICS.values()):
            x = m.metrics[i]
            if x.nvmlReturn == 0:
                out[key] = x.value * _MIB if key.startswith("pcie") else x.value / 100
        return out

    def close(self) -> None:
        for a, b in self._gpm.values():
            for s in (a, b):
                try:
                    self.nv.nvmlGpmSampleFree(s)
                except self.nv.NVMLError:
                    pass
        self._gpm = {}
