"""bench/container_start.py's report: medians and p90s of every case, overheads over
runc, and the ratios the README reports."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from runtime_lifecycle import Case, pctl
from start_nct import NODRM


def report(say: Callable[[str], None], cases: list[Case], passthrough: list[Case], n: int,
           n_pass: int, elapsed: float, have_nct: bool, breakdown_ok: bool) -> None:
    med = {c.label: statistics.median(c.samples) * 1000 for c in [*cases, *passthrough]}
    p90 = {c.label: pctl(c.samples, 0.9) * 1000 for c in [*cases, *passthrough]}
    say(f"round-robin interleaved runs: {n} per container case, {n_pass} per passthrough "
        f"case ({elapsed:.0f} s); times in ms")
    say("lifecycle: create --bundle --pid-file -> start -> waitpid(init) -> delete, each "
        "step through the runtime under test; container runs `true`")
    say("")

    def row(label: str, base: str | None) -> None:
        extra = f"  overhead {med[label] - med[base]:7.2f}" if base and label != base else ""
        say(f"  {label:<42} median {med[label]:7.2f}  p90 {p90[label]:7.2f}{extra}")

    say("passthrough (overhead = minus runc list)")
    for c in passthrough:
        row(c.label, None if c is passthrough[0] else "runc list")
    say("")
    say("container lifecycle (overhead = minus runc, no GPU)")
    for c in cases[:len(cases) - (3 if breakdown_ok else 0)]:
        row(c.label, "runc, no GPU")
    say("")

    report_ratios(say, med, have_nct)
    if breakdown_ok:
        say("")
        say("where nvctk's 1-GPU start goes")
        for c in cases[-3:]:
            row(c.label, None)
        hook, no_hook = med["runc, edited spec, hook"], med["runc, edited spec, no hook"]
        served = med["nvctk-runtime, 1 GPU"] - med["shim alone"] - no_hook
        say(f"  so: runtime {med['shim alone']:.1f}, hook served by the runtime {served:.1f} "
            f"(by itself {hook - no_hook:.1f}), device nodes "
            f"{no_hook - med['runc, no GPU']:.1f}, bare interpreter start "
            f"{med[passthrough[0].label]:.1f} ms")


def report_ratios(say: Callable[[str], None], med: dict[str, float], have_nct: bool) -> None:
    """The ratios of medians the README reports, with their goals."""

    def ov(label: str) -> float:
        return med[label] - med["runc, no GPU"]

    def ratio(text: str, a: float, b: float, goal: str = "") -> None:
        say(f"  {text:<52} {a / b:5.2f} x{f'  (goal {goal})' if goal else ''}")

    say("ratios (of medians)")
    legacy, cdi = ov("nvctk-runtime, 1 GPU"), ov("nvctk-runtime cdi mode, 1 GPU")
    ratio("GPU start overhead nvctk cdi mode / legacy mode", cdi, legacy)
    say(f"  {'  cdi mode minus legacy mode':<52} {cdi - legacy:5.2f} ms  (goal <= 1.00)")
    # nvctk's spec gives every capability but compat32: legacy mode with caps=all is the
    # like-for-like start (7 device nodes and 77 mounts, 21 of them 32-bit libraries,
    # against the spec's 7 and 69; legacy's default capabilities: 4 and 26)
    say(f"  {'  cdi mode minus legacy mode with caps=all':<52} "
        f"{cdi - ov('nvctk-runtime, 1 GPU, caps=all'):5.2f} ms")
    if have_nct:
        ratio("GPU start overhead nvctk / NCT cdi", legacy, ov("NCT cdi, 1 GPU"), "<= 0.40")
        ratio("  same, nvctk with caps=all / NCT cdi", ov("nvctk-runtime, 1 GPU, caps=all"),
              ov("NCT cdi, 1 GPU"))
        ratio("GPU start overhead nvctk cdi mode / NCT cdi", cdi, ov("NCT cdi, 1 GPU"),
              "<= 0.40")
        ratio("  same, NCT's spec without the DRM nodes", cdi, ov(f"NCT {NODRM}, 1 GPU"))
        ratio("GPU start overhead NCT jit-cdi / NCT cdi", ov("NCT jit-cdi, 1 GPU"),
              ov("NCT cdi, 1 GPU"))
        pt = med["nvctk-runtime list"] - med["runc list"]
        ratio("passthrough overhead nvctk / NCT", pt,
              med["nvidia-container-runtime list"] - med["runc list"], "<= 0.20")
    ratio("start nvctk 8 GPUs / 1 GPU", med["nvctk-runtime, 8 GPUs"],
          med["nvctk-runtime, 1 GPU"], "<= 1.20")
    ratio("start nvctk 1 GPU / runc", med["nvctk-runtime, 1 GPU"], med["runc, no GPU"])
    if have_nct:
        ratio("start NCT cdi 1 GPU / runc", med["NCT cdi, 1 GPU"], med["runc, no GPU"])
