"""The devices this node's DRA plugin found unhealthy, kept across its restarts.

An XID is an event: NVML tells it once. A plugin restarted (a rollout, a crash) would
publish a GPU that fell off the bus, or hit an uncontained error, healthy again. So
each change of nvctk.k8s.health.Health is written to `<plugins-dir>/<driver>/health.json`
(atomically), and a starting plugin marks what it finds there again, for this boot only
(a reboot resets the GPUs) and for devices the host still has:

    {"v": 1, "boot_id": "...", "unhealthy": {"<uuid>": "<reason>", ...}}

A record that cannot be read is logged and ignored: health is then what NVML says.
"""

from __future__ import annotations

import logging
import os

from nvctk.base import fileio, jsonio
from nvctk.dra.record import boot_id
from nvctk.k8s.health import Health

log = logging.getLogger("nvctk.dra")

FILE = "health.json"
VERSION = 1
MAX_BYTES = 1 << 20


def restore(path: str, health: Health, present: set[str], boot: str | None = None
            ) -> dict[str, str]:
    """Mark in `health` what the record at `path` holds for this boot and the devices
    (uuids) `present`; what was marked (uuid -> reason)."""
    try:
        data = fileio.read_regular_file(path, MAX_BYTES, nofollow=True)
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.warning("%s: cannot read the health record: %s; not restored", path, e.strerror or e)
        return {}
    try:
        rec = jsonio.loads(data)
        ok = (isinstance(rec, dict) and rec.get("v") == VERSION
              and isinstance(rec.get("unhealthy"), dict)
              and all(isinstance(k, str) and isinstance(v, str)
                      for k, v in rec["unhealthy"].items()))
    except ValueError:
        ok = False
    if not ok:
        log.warning("%s: not a health record; not restored", path)
        return {}
    if rec.get("boot_id") != (boot_id() if boot is None else boot):
        return {}  # another boot: the GPUs were reset since
    out = {u: r for u, r in rec["unhealthy"].items() if u in present}
    for uuid, reason in sorted(out.items()):
        health.mark({uuid}, reason)
    return out


def save(path: str, health: Health, boot: str | None = None) -> None:
    """Write what `health` holds now (Health.on_change); an error is logged, not raised:
    the plugin goes on, only a restart would forget."""
    unhealthy = health.snapshot()
    rec = {"v": VERSION, "boot_id": boot_id() if boot is None else boot, "unhealthy": unhealthy}
    try:
        os.makedirs(os.path.dirname(path), 0o750, exist_ok=True)
        fileio.atomic_write(path, jsonio.dumps(rec, sort_keys=True).encode(), 0o600)
    except OSError as e:
        log.error("%s: cannot record the devices' health: %s", path, e.strerror or e)


def keep(path: str, health: Health, present: set[str]) -> dict[str, str]:
    """Restore the record into `health`, then keep it written on each change."""
    restored = restore(path, health, present)
    health.on_change = lambda: save(path, health)
    if restored:
        log.warning("still unhealthy since before the plugin started: %s",
                    ", ".join(f"{u} ({r})" for u, r in sorted(restored.items())))
    return restored
