"""Prometheus text exposition (format 0.0.4) written straight from a snapshot.

prometheus-client builds a labels dict per sample and escapes every label on every
render: at 8 GPUs x 128 containers that alone was most of a scrape. Here a series'
label set is escaped once and shared by every family that carries it, and a family is
a list of ready lines. The format itself is prometheus-client's (its CONTENT_TYPE_LATEST
and float spelling), so any Prometheus reads it as before.
"""

from __future__ import annotations

from prometheus_client.utils import floatToGoString


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

    def text(self) -> str:
        out: list[str] = []
        for help_text, kind, name, lines in self._families.values():
            h = help_text.replace("\\", r"\\").replace("\n", r"\n")
            out.append(f"# HELP {name} {h}\n# TYPE {name} {kind}\n")
            out += lines
        return "".join(out)
