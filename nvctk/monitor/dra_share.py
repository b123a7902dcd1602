"""A DRA share's cap, for the monitor: a share's container gets its GPU, libvgpu and
limits by the claim's CDI spec (nvctk.dra.driver), with no nvctk record in its bundle;
its cap is the claim's ledger's limits file, which the spec binds at libvgpu's fixed
path. Read from the mount's source only where that is a ledger's (<state-dir>/dra/<claim
uid>/ro/limits, which the plugin writes and the containers see read-only): a path a
container could write never sets what the monitor shows.
"""

from __future__ import annotations

from nvctk.base.errors import NvctkError
from nvctk.oci.spec import spec_mounts
from nvctk.vgpu.limits import LIMITS_FILE, read_limits_file
from nvctk.vgpu.state import LEDGERS_DIR, LIMITS_NAME, RO_DIR


def _is_ledger_limits(source: str) -> bool:
    parts = source.split("/")
    return len(parts) >= 5 and parts[0] == "" and parts[-4] == LEDGERS_DIR \
        and parts[-2:] == [RO_DIR, LIMITS_NAME] \
        and ".." not in parts


def share_limits(spec: dict[str, object], n: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(memory bytes, SM percent) per device of a DRA share's container (0: none), or None
    when the spec binds no claim's ledger or it cannot be read (then: no cap shown)."""
    for m in spec_mounts(spec):
        src = m.get("source")
        if m.get("destination") != LIMITS_FILE or not isinstance(src, str) \
                or not _is_ledger_limits(src):
            continue
        try:
            lim = read_limits_file(src, n)
        except (OSError, NvctkError, ValueError):
            return None
        return lim.memory, lim.sm
    return None
