"""`nvctk top`: the snapshot as a terminal view (rich), per GPU its containers.

Every name is text (rich.text.Text, never markup) with its control characters escaped:
a container's name comes from its Pod's author, and must neither break the view nor
reach the terminal as an escape sequence. The view fits the console's width (80
columns when piped): numbers are never cut, names wrap, the bars go first.
"""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from nvctk.base.errors import literal
from nvctk.monitor import allocation
from nvctk.monitor.model import GpuSample, Snapshot

MIB = 1 << 20
WIDE = 110  # columns from which the bars are shown


def _bar(value: float, whole: float, width: int = 12) -> Text:
    frac = 0.0 if whole <= 0 else max(0.0, min(1.0, value / whole))
    n = round(frac * width)
    return Text("█" * n + "·" * (width - n), style="red" if frac > 0.9 else "cyan")


def over_promised(g: GpuSample) -> list[str]:
    """What its containers were promised beyond the GPU (the page and top flag it)."""
    out = []
    if g.sm_promised > 1.0 + 1e-9:
        out.append(f"SM {g.sm_promised * 100:.0f}%")
    if g.memory_promised > g.memory_total:
        out.append(f"memory {g.memory_promised // MIB}/{g.memory_total // MIB} MiB")
    return out


def _title(g: GpuSample) -> Text:
    t = Text(f"GPU {g.index} · {literal(g.name)} · {literal(g.uuid[:12])}… · ", style="bold")
    t.append(f"mem {g.memory_used // MIB}/{g.memory_total // MIB} MiB · util "
             f"{g.utilization * 100:.0f}% · {g.shares} share(s): {g.memory_promised // MIB} MiB, "
             f"SM {g.sm_promised * 100:.0f}% promised")
    over = over_promised(g)
    if over:
        t.append(" · OVER-PROMISED " + ", ".join(over), style="bold red")
    if not g.healthy:
        t.append(f" · UNHEALTHY (XID {g.last_xid})", style="bold red")
    return t


def _who(who: str, claim: str, outside: bool = False) -> Text:
    """The container's name; a DRA claim it got its device by (the kubelet's word) on a
    line of its own below, so the column stays narrow; a GPU the kubelet did not
    allocate flagged below it (nvctk.monitor.allocation)."""
    t = Text(literal(who))
    if claim:
        t.append("\nclaim " + literal(claim), style="dim")
    if outside:
        t.append("\n" + allocation.FLAG, style="bold red")
    return t


def render(snap: Snapshot, width: int = 80) -> Group:
    wide = width >= WIDE
    parts: list[Table | Text] = [Text(
        f"{literal(snap.hostname)} · driver {literal(snap.driver_version)} · {len(snap.gpus)} GPU(s) · "
        f"{len(snap.containers)} container(s) · SM shares over {snap.interval:.1f} s",
        style="bold")]
    for g in snap.gpus:
        parts.append(_title(g))
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False, expand=False)
        t.add_column("container", overflow="fold", min_width=12)
        t.add_column("kind", no_wrap=True)
        t.add_column("device", no_wrap=True)
        # two-line headers: the figures, not their titles, set the widths
        t.add_column("MiB\nused/cap", justify="right", no_wrap=True)
        if wide:
            t.add_column("", no_wrap=True)
        t.add_column("SM\nused/lim", justify="right", no_wrap=True)
        if wide:
            t.add_column("", no_wrap=True)
        t.add_column("procs", justify="right", no_wrap=True)
        t.add_column("last", justify="right", no_wrap=True)
        rows = 0
        for c in snap.containers:
            for d in c.devices:
                if d.gpu_index != g.index:
                    continue
                rows += 1
                who = f"{c.namespace}/{c.pod}/{c.container}" if c.pod else c.name
                cap = d.memory_limit if d.memory_limit is not None else d.memory_total
                cells: list[Text] = [
                    _who(who, c.claim, c.outside_allocations), Text(c.kind),
                    Text(literal(d.device_uuid[:12]) if d.device_uuid != g.uuid else f"GPU {g.index}"),
                    Text(f"{d.memory_used // MIB}/{d.memory_limit // MIB}" if d.memory_limit is not None
                         else f"{d.memory_used // MIB}/-")]
                if wide:
                    cells.append(_bar(d.memory_used, cap))
                cells.append(Text(f"{d.sm_utilization * 100:.0f}%/{d.sm_limit * 100:.0f}%"
                                  if d.sm_limit is not None else f"{d.sm_utilization * 100:.0f}%/-"))
                if wide:
                    cells.append(_bar(d.sm_utilization, 1.0))
                cells += [Text(str(len(d.processes))),
                          Text("-" if d.last_kernel_seconds is None else f"{d.last_kernel_seconds:.1f}s")]
                t.add_row(*cells)
        if not rows:
            t.add_row(Text("(no containers)"), *[Text("")] * (len(t.columns) - 1))
        parts.append(t)
    for p in snap.problems:
        parts.append(Text(f"problem: {literal(p)}", style="yellow"))
    return Group(*parts)
