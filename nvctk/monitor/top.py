"""`nvctk top`: the snapshot as a terminal view (rich), per GPU its containers."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from nvctk.monitor.model import Snapshot

MIB = 1 << 20


def _bar(value: float, whole: float, width: int = 12) -> Text:
    frac = 0.0 if whole <= 0 else max(0.0, min(1.0, value / whole))
    n = round(frac * width)
    return Text("█" * n + "·" * (width - n), style="red" if frac > 0.9 else "cyan")


def render(snap: Snapshot) -> Group:
    parts: list[Table | Text] = [Text(
        f"{snap.hostname} · driver {snap.driver_version} · {len(snap.gpus)} GPU(s) · "
        f"{len(snap.containers)} container(s) · SM shares over {snap.interval:.1f} s",
        style="bold")]
    for g in snap.gpus:
        title = (f"GPU {g.index} · {g.name} · {g.uuid[:12]}… · mem {g.memory_used // MIB}/"
                 f"{g.memory_total // MIB} MiB · util {g.utilization * 100:.0f}% · {g.shares} share(s):"
                 f" {g.memory_promised // MIB} MiB, SM {g.sm_promised * 100:.0f}% promised"
                 + ("" if g.healthy else f" · UNHEALTHY (XID {g.last_xid})"))
        t = Table(title=title, title_justify="left", expand=False)
        for col, just in (("container", "left"), ("kind", "left"), ("device", "left"),
                          ("mem MiB used/cap", "right"), ("", "left"), ("SM used/limit", "right"),
                          ("", "left"), ("procs", "right"), ("last kernel", "right")):
            t.add_column(col, justify=just)  # type: ignore[arg-type]
        rows = 0
        for c in snap.containers:
            for d in c.devices:
                if d.gpu_index != g.index:
                    continue
                rows += 1
                who = f"{c.namespace}/{c.pod}/{c.container}" if c.pod else c.name
                cap = d.memory_limit if d.memory_limit is not None else d.memory_total
                t.add_row(
                    who, c.kind, d.device_uuid[:12] if d.device_uuid != g.uuid else f"GPU {g.index}",
                    f"{d.memory_used // MIB}/{d.memory_limit // MIB}" if d.memory_limit is not None
                    else f"{d.memory_used // MIB}/-",
                    _bar(d.memory_used, cap),
                    f"{d.sm_utilization * 100:.0f}%/{d.sm_limit * 100:.0f}%" if d.sm_limit is not None
                    else f"{d.sm_utilization * 100:.0f}%/-",
                    _bar(d.sm_utilization, 1.0),
                    str(len(d.processes)),
                    "-" if d.last_kernel_seconds is None else f"{d.last_kernel_seconds:.1f}s",
                )
        if not rows:
            t.add_row("(no containers)", "", "", "", "", "", "", "", "")
        parts.append(t)
    for p in snap.problems:
        parts.append(Text(f"problem: {p}", style="yellow"))
    return Group(*parts)
