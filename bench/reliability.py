"""`make reliability`: the reliability suite at full scale, then its report.

Runs tests/reliability/ with NVCTK_RELIABILITY=full (the short version of the same tests
runs in `make test`); each test appends its figures as a JSON line; this script writes
them to bench/results/reliability.json and the table between the markers in
docs/reliability.md. A failing test fails the target (its figures are still written,
with the failure listed).

    python bench/reliability.py [--short] [--pytest-args ARGS]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "reliability.json"
DOC = REPO / "docs" / "reliability.md"
BEGIN, END = "<!-- reliability table: begin -->", "<!-- reliability table: end -->"
SECTIONS = {"fuzz": "Hostile inputs (fuzzing)", "hostile": "Hostile images",
            "fault": "Faults injected", "load": "Load held"}
HEADLINE = ("inputs", "attempts", "injected", "containers", "process_runs", "rounds")
LOSSES = ("crashes", "hangs", "escapes", "spec_mixed", "leaks", "leaked_bytes", "over_cap",
          "wrong_devices", "ledger_end", "lost")


def run_suite(full: bool, extra: list[str]) -> tuple[int, list[dict[str, Any]], float]:
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as f:
        out = f.name
    env = {**os.environ, "NVCTK_RELIABILITY": "full" if full else "short",
           "NVCTK_RELIABILITY_OUT": out}
    t0 = time.monotonic()
    rc = subprocess.run([sys.executable, "-m", "pytest", "tests/reliability", "-q",
                         "-p", "no:cacheprovider", *extra], cwd=REPO, env=env).returncode
    took = time.monotonic() - t0
    rows = [json.loads(x) for x in Path(out).read_text().splitlines() if x.strip()]
    os.unlink(out)
    return rc, rows, took


def _detail(row: dict[str, Any]) -> str:
    skip = {"section", "target", "scale", *HEADLINE, *LOSSES, "refusals"}
    return ", ".join(f"{k} {v}" for k, v in row.items() if k not in skip)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| section | target | tried | escapes / losses | details |",
             "|---|---|---|---|---|"]
    for sec in SECTIONS:
        for r in (x for x in rows if x["section"] == sec):
            tried = next((f"{r[k]} {k.replace('_', ' ')}" for k in HEADLINE if k in r), "")
            losses = sum(int(r[k]) for k in LOSSES if k in r)
            lines.append(f"| {SECTIONS[sec]} | {r['target']} | {tried} | {losses} | "
                         f"{_detail(r)} |")
    return "\n".join(lines)


def totals(rows: list[dict[str, Any]]) -> dict[str, int]:
    def s(sec: str, *keys: str) -> int:
        return sum(int(r.get(k, 0)) for r in rows if r["section"] == sec for k in keys)

    return {"inputs_tried": s("fuzz", "inputs"), "hostile_starts": s("hostile", "attempts"),
            "faults_injected": s("fault", "injected"),
            "containers_under_load": s("load", "containers"),
            "escapes_or_losses": sum(int(r.get(k, 0)) for r in rows for k in LOSSES)}


def write_doc(text: str) -> None:
    doc = DOC.read_text() if DOC.exists() else f"# Reliability\n\n{BEGIN}\n{END}\n"
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    DOC.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="the short version (as make test)")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments")
    a = ap.parse_args()
    rc, rows, took = run_suite(not a.short, shlex.split(a.pytest_args))
    t = totals(rows)
    result: dict[str, Any] = {
              "scale": "short" if a.short else "full", "passed": rc == 0,
              "seconds": round(took, 1), "totals": t, "rows": rows,
              "when": time.strftime("%Y-%m-%d %H:%M:%S %z"), "cpus": os.cpu_count()}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    summary = (f"Scale {result['scale']}, {result['seconds']} s on {os.cpu_count()} CPUs, "
               f"suite {'passed' if rc == 0 else 'FAILED'}: {t['inputs_tried']} inputs "
               f"fuzzed, {t['hostile_starts']} hostile container starts, "
               f"{t['faults_injected']} faults injected, {t['containers_under_load']} "
               f"containers under load; escapes/losses found: {t['escapes_or_losses']}.")
    write_doc(f"{summary}\n\n{table(rows)}")
    print(summary)
    return rc


if __name__ == "__main__":
    sys.exit(main())
