"""Prometheus text exposition (format 0.0.4, and OpenMetrics 1.0 when a scraper asks for
it) written straight from a snapshot.

prometheus-client builds a labels dict per sample and escapes every label on every
render: at 8 GPUs x 128 containers that alone was most of a scrape. Here a series'
label set is escaped once and shared by every family that carries it, and a family is
a list of ready lines. The format itself is prometheus-client's (its CONTENT_TYPE_LATEST
and float spelling), so any Prometheus reads it as before. The two formats differ only
in each family's header (OpenMetrics names a counter's family without _total, and a
counter whose samples lack _total, dcgm-exporter's, is `unknown` there) and the closing
`# EOF`: a family's samples are written once and serve both.
"""

from __future__ import annotations

from prometheus_client.utils import floatToGoString

CONTENT_TYPE_OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
EOF_LINE = "# EOF\n"
Segment = tuple[str, str, str]  # a family: its 0.0.4 header, its OpenMetrics header, its samples


def _escape(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        value = value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def label_set(names: tuple[str, ...] | list[str], values: tuple[str, ...] | list[str]) -> str:
    """'{a="1",b="x"}' with the values escaped; '' for no labels."""
    if not names:
        return ""
    return "{" + ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)) + "}"


def number(value: float | int) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return floatToGoString(value)


class Writer:
    """Families in the order first declared, each with its HELP, TYPE and samples."""

    def __init__(self) -> None:
        self._families: dict[str, tuple[str, str, str, list[str]]] = {}

    def family(self, name: str, help_text: str, kind: str = "gauge", total: bool = True) -> list[str]:
        """The sample lines of family `name` (declared now if new). A counter is named
        name_total, header and samples, as prometheus-client names it, unless `total` is
        False (dcgm-exporter's counters keep their field's name)."""
        fam = self._families.get(name)
        if fam is None:
            sample = f"{name}_total" if kind == "counter" and total else name
            fam = self._families[name] = (help_text, kind, sample, [])
        return fam[3]

    def add(self, name: str, help_text: str, labels: str, value: float | int,
            kind: str = "gauge", total: bool = True) -> None:
        fam = self._families.get(name)
        if fam is None:
            self.family(name, help_text, kind, total)
            fam = self._families[name]
        fam[3].append(f"{fam[2]}{labels} {number(value)}\n")

    def segments(self) -> list[Segment]:
        out: list[Segment] = []
        for family, (help_text, kind, sample, lines) in self._families.items():
            h = help_text.replace("\\", r"\\").replace("\n", r"\n")
            classic = f"# HELP {sample} {h}\n# TYPE {sample} {kind}\n"
            om_kind = kind if kind != "counter" or sample != family else "unknown"
            om_help = h.replace('"', r'\"')
            om = f"# HELP {family} {om_help}\n# TYPE {family} {om_kind}\n"
            out.append((classic, om, "".join(lines)))
        return out

    def text(self, openmetrics: bool = False) -> str:
        return join(self.segments(), openmetrics)


def join(segments: list[Segment], openmetrics: bool = False) -> str:
    """The families as one text (without OpenMetrics' # EOF: the caller ends it)."""
    i = 1 if openmetrics else 0
    return "".join(seg[i] + seg[2] for seg in segments)
