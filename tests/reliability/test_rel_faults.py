"""Issue 13 §2: nvctk-runtime and nvctk-hook SIGKILLed at random points of a container
start, in a loop, through the real runc on the simulated host.

After every kill: config.json is byte for byte the original or the complete new one;
after the loop (and the collection the next vGPU create or `nvctk vgpu gc` runs, a
documented limit): no mount left under the state dir or the bundles, no vGPU state dir,
no process working on the test's runc root, the host's mount table as it was; and the
next container starts.

NVML init failure and a read-only state dir: test_rel_host_faults.py. Clear errors for
a missing driver, a missing runc, an unusable or full state dir are tested where the
code is (tests/integration/test_runtime_create.py, test_hostile_input.py, test_vgpu_concurrency.py);
docs/reliability.md lists where.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from support import reliability as relkit
from support import wait

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runc, device nodes)")]

MEM = "CUDA_DEVICE_MEMORY_LIMIT=512m"


def _settle(la: relkit.Lab) -> None:
    """Every container of the lab deleted, then nothing of runc's left on its root."""
    for cid in la.listed():
        la.delete(cid)
    wait.until(lambda: not relkit.procs_mentioning(la.root), 20,
                      "runc processes of the lab to end")


def _assert_clean(la: relkit.Lab, host_mounts: list[str]) -> None:
    r = la.gc()
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert la.state_entries() == [], la.state_entries()
    assert relkit.mounts_under(la.state_dir) == []
    assert relkit.mounts_under(str(la.tmp)) == []
    assert relkit.mounts_from(la.tmp, Path(la.state_dir).parents[1]) == host_mounts
    assert relkit.procs_mentioning(la.root) == []


def _unserved(spec: bytes) -> bytes:
    """A spec with its prestart server's token (nvctk.hook.served: new at every create)
    zeroed."""
    return re.sub(rb'"--served", ?"[0-9a-f]{32}"', b'"--served","0"', spec)


def test_runtime_sigkill_loop(sim_host: Any, tmp_path: Path, base: str) -> None:
    rounds = relkit.n(8, 150)
    rng = random.Random(13)
    host_mounts = relkit.mounts_from(tmp_path, sim_host.root)
    with relkit.lab(tmp_path, sim_host.config_path) as la:
        b = la.bundle(None, ["NVIDIA_VISIBLE_DEVICES=0", MEM], base=base,
                      args=["/bin/sh", "-c", "sleep 1000"])
        original = (b / "config.json").read_bytes()
        cid = la.new_id()
        t0 = time.monotonic()
        r = la.run(b, cid, sub="create")
        span = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        new = _unserved((b / "config.json").read_bytes())
        assert new != original and json.loads(new)
        la.delete(cid)
        outcomes = {"original": 0, "new": 0}
        for _ in range(rounds):
            (b / "config.json").write_bytes(original)
            cid = la.new_id()
            p = subprocess.Popen(la.argv(b, cid, "create"), env=la.env(),
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
            time.sleep(rng.uniform(0, span * 1.2))
            p.send_signal(signal.SIGKILL)
            p.wait()
            data = _unserved((b / "config.json").read_bytes())
            # never a mix: the original bytes, or exactly what a whole create writes (but
            # for its own prestart server's token)
            assert data in (original, new), data[:200]
            outcomes["original" if data == original else "new"] += 1
            _settle(la)
        la.start_ok(["NVIDIA_VISIBLE_DEVICES=0", MEM], base)
        _settle(la)
        _assert_clean(la, host_mounts)
    relkit.record("fault", "nvctk-runtime SIGKILL during create (vGPU)", injected=rounds,
                  spec_original=outcomes["original"], spec_complete_new=outcomes["new"],
                  spec_mixed=0, leaks=0, create_span_ms=round(span * 1000, 1))


HOOK_WRAPPER = """#!/bin/sh
# nvctk-hook, SIGKILLed after the delay in {delay} (prestart only)
if [ "$1" = prestart ] && [ -s {delay} ]; then
  d=$(cat {delay})
  ( sleep "$d"; kill -9 $$ ) </dev/null >/dev/null 2>&1 &
fi
exec {hook} "$@"
"""


def test_hook_sigkill_loop(sim_host: Any, tmp_path: Path, base: str) -> None:
    rounds = relkit.n(8, 150)
    rng = random.Random(14)
    delay = tmp_path / "delay"
    wrapper = tmp_path / "hookwrap"
    wrapper.write_text(HOOK_WRAPPER.format(delay=delay, hook=relkit.HOOK))
    wrapper.chmod(0o755)
    host_mounts = relkit.mounts_from(tmp_path, sim_host.root)
    with relkit.lab(tmp_path, sim_host.config_path,
                    **{"hook-path": f'hook-path = "{wrapper}"'}) as la:
        # a GPU container with a vGPU cap: the hook's whole path (mounts, pins, ldconfig)
        b = la.bundle(None, ["NVIDIA_VISIBLE_DEVICES=0", MEM], base=base,
                      args=["/bin/sh", "-c", "test -e /dev/nvidia0"])
        t0 = time.monotonic()
        r = la.run(b)
        span = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        killed = survived = 0
        for _ in range(rounds):
            # the hook runs some 5-15 ms of the start (its launcher waits on the prestart
            # nvctk-runtime serves, nvctk.hook.served): aim inside it
            delay.write_text(f"{rng.uniform(0, min(span, 0.015)):.3f}\n")
            cid = la.new_id()
            r = la.run(b, cid)
            assert relkit.clean_failure(r.stderr), r.stderr
            if r.returncode == 0:
                survived += 1  # the hook finished first
            else:
                killed += 1
                assert "prestart" in r.stderr or "hook" in r.stderr, r.stderr
            _settle(la)
            # what the killed hook mounted was in the container's namespace only
            assert relkit.mounts_from(tmp_path, sim_host.root) == host_mounts
        delay.write_text("")
        la.start_ok(["NVIDIA_VISIBLE_DEVICES=0", MEM], base)
        _settle(la)
        _assert_clean(la, host_mounts)
    assert killed > 0, "no kill landed inside the hook: the test proved nothing"
    relkit.record("fault", "nvctk-hook prestart SIGKILL during start (vGPU)", injected=rounds,
                  start_failed=killed, hook_finished_first=survived, leaks=0,
                  start_span_ms=round(span * 1000, 1))
