"""`nvctk top`: the snapshot as a terminal view (rich), per GPU its containers.

Every name is text (rich.text.Text, never markup) with its control characters escaped:
a container's name comes from its Pod's author, and must neither break the view nor
reach the terminal as an escape sequence. The view fits the console's width (80
columns when piped): numbers are never cut, names wrap, the bars go first. Every GPU has
a line of its own; the containers follow in one table, the busiest first (SM share, then
memory). In a terminal (`nvctk top` live) the view also fits its height: the container
rows that fit, scrolled and narrowed to one GPU by keys (View), names cut to their column.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from nvctk.base.errors import literal
from nvctk.monitor import allocation
from nvctk.monitor.model import ContainerSample, DeviceUse, GpuSample, Snapshot

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


def _who(who: str, claim: str, outside: bool = False, compact: bool = False) -> Text:
    """The container's name; a DRA claim it got its device by (the kubelet's word) on a
    line of its own below, so the column stays narrow; a GPU the kubelet did not
    allocate flagged below it (nvctk.monitor.allocation), or, compact (one line a row:
    the terminal's fitted view), as a leading "!"."""
    if compact:
        t = Text("! ", style="bold red") if outside else Text()
        t.append(literal(who))
        return t
    t = Text(literal(who))
    if claim:
        t.append("\nclaim " + literal(claim), style="dim")
    if outside:
        t.append("\n" + allocation.FLAG, style="bold red")
    return t


@dataclass
class View:
    """Where the live view is: the first container row shown, one GPU or all."""

    offset: int = 0
    gpu: int | None = None

    def key(self, k: str, page: int, total: int, gpus: int) -> bool:
        """Applies a key (j/k or arrows: a row, space/b or PgDn/PgUp: a page, g/G: top,
        bottom, a digit: that GPU only, a: all); False for q (quit)."""
        if k in ("q", "Q", "\x03"):
            return False
        step = {"j": 1, "\x1b[B": 1, "k": -1, "\x1b[A": -1, " ": page, "\x1b[6~": page,
                "b": -page, "\x1b[5~": -page}.get(k)
        if step is not None:
            self.offset += step
        elif k == "g":
            self.offset = 0
        elif k == "G":
            self.offset = total
        elif k.isdigit() and int(k) < gpus:
            self.gpu, self.offset = int(k), 0
        elif k == "a":
            self.gpu, self.offset = None, 0
        self.offset = max(0, min(self.offset, max(0, total - page)))
        return True


def rows_of(snap: Snapshot, gpu: int | None = None) -> list[tuple[ContainerSample, DeviceUse]]:
    """Every (container, device) shown, the busiest first: SM share, then memory held."""
    out = [(c, d) for c in snap.containers for d in c.devices if gpu is None or d.gpu_index == gpu]
    out.sort(key=lambda cd: (-cd[1].sm_utilization, -cd[1].memory_used, cd[0].namespace, cd[0].pod,
                             cd[0].container, cd[0].name))
    return out


def _gpus(snap: Snapshot) -> Table:
    """One line per GPU: every GPU is in view whatever the containers' number."""
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, expand=False, show_edge=False)
    for name, just in (("GPU", "right"), ("model", "left"), ("MiB\nused/total", "right"),
                       ("util", "right"), ("shares", "right"), ("promised\nMiB · SM", "right")):
        t.add_column(name, justify=just, no_wrap=name != "model", overflow="fold")  # type: ignore[arg-type]
    for g in snap.gpus:
        t.add_row(str(g.index), literal(g.name), f"{g.memory_used // MIB}/{g.memory_total // MIB}",
                  f"{g.utilization * 100:.0f}%", str(g.shares),
                  f"{g.memory_promised // MIB} · {g.sm_promised * 100:.0f}%")
    return t


def _flags(g: GpuSample) -> Text | None:
    over = over_promised(g)
    if not over and g.healthy:
        return None
    t = Text(f"GPU {g.index} · {literal(g.name)}", style="bold")
    if over:
        t.append(" · OVER-PROMISED " + ", ".join(over), style="bold red")
    if not g.healthy:
        t.append(f" · UNHEALTHY (XID {g.last_xid})", style="bold red")
    return t


def fit(snap: Snapshot, height: int) -> int:
    """How many container rows the live view has room for in `height` lines: the title,
    the GPU table (a two-line header, its rule, a line per GPU), a line per flagged GPU,
    the container table's header and rule, the footer, the problems."""
    flagged = sum(1 for g in snap.gpus if over_promised(g) or not g.healthy)
    used = 1 + (len(snap.gpus) + 3) + flagged + 3 + 1 + len(snap.problems)
    return max(1, height - used)


def render(snap: Snapshot, width: int = 80, height: int | None = None, view: View | None = None) -> Group:
    """The snapshot: its GPUs, one line each, then its containers, the busiest first.
    With a height (the live view) the containers are the rows of `view` that fit it,
    names cut to their column; without, every one, names wrapped."""
    view = view or View()
    wide = width >= WIDE
    parts: list[Table | Text] = [Text(
        f"{literal(snap.hostname)} · driver {literal(snap.driver_version)} · {len(snap.gpus)} GPU(s) · "
        f"{len(snap.containers)} container(s) · SM shares over {snap.interval:.1f} s",
        style="bold"), _gpus(snap)]
    parts += [f for f in (_flags(g) for g in snap.gpus) if f is not None]
    rows = rows_of(snap, view.gpu)
    problems = [Text(f"problem: {literal(p)}", style="yellow") for p in snap.problems]
    n = len(rows) if height is None else fit(snap, height)
    if height is not None:
        view.offset = max(0, min(view.offset, len(rows) - n))
    shown = rows[view.offset:view.offset + n]
    # columns two spaces apart, not three: the names get the room
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, expand=False, show_edge=False, collapse_padding=True)
    t.add_column("GPU", justify="right", no_wrap=True)
    t.add_column("container", overflow="ellipsis" if height is not None else "fold", min_width=12,
                 no_wrap=height is not None)
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
    for c, d in shown:
        who = f"{c.namespace}/{c.pod}/{c.container}" if c.pod else c.name
        cap = d.memory_limit if d.memory_limit is not None else d.memory_total
        cells: list[Text] = [
            Text(str(d.gpu_index)),
            _who(who, c.claim, c.outside_allocations, compact=height is not None), Text(c.kind),
            Text(literal(d.device_uuid[:12]) if d.device_uuid != d.gpu_uuid else "whole"),
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
        t.add_row(Text(""), Text("(no containers)"), *[Text("")] * (len(t.columns) - 2))
    parts.append(t)
    if height is not None:
        where = f"GPU {view.gpu}" if view.gpu is not None else "all GPUs"
        span = f"{view.offset + 1}-{view.offset + len(shown)}" if shown else "0"
        parts.append(Text(f"{span} of {len(rows)} · {where} · busiest first · j k PgUp PgDn g G · "
                          "0-9 a · q", style="dim"))
    return Group(*parts, *problems)
