"""nvctk.hook.caps under the bounding sets runtimes really start hooks with."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nvctk.hook import caps

REPO = Path(__file__).resolve().parents[2]
KEEP = sorted(caps.needed(caps.STEP_CAPS))


def _in_bounding_set(keep: list[str], code: str) -> subprocess.CompletedProcess[str]:
    """Run python code as root whose bounding set (so its permitted set) is just keep."""
    capsh = shutil.which("capsh")
    if capsh is None:
        pytest.skip("capsh (libcap2-bin) is not installed")
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    drop = [f"cap_{n}" for n, num in caps.NUMBERS.items() if num <= last and n not in keep]
    script = f"import sys; sys.path.insert(0, {str(REPO)!r}); {code}"
    return subprocess.run(
        [capsh, f"--drop={','.join(drop)}", "--", "-c", 'exec "$0" -c "$1"', sys.executable,
         script], capture_output=True, text=True)


def test_restrict_within_an_already_reduced_bounding_set() -> None:
    """containerd run with CapabilityBoundingSet=: no CAP_SETPCAP, nothing left to drop;
    restricting to what is already there must not fail."""
    assert "setpcap" not in KEEP
    code = (f"from nvctk.hook import caps; caps.restrict({KEEP!r}); "
            "print(','.join(caps.current(caps.CAP_PERMITTED)))")
    r = _in_bounding_set(KEEP, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ",".join(KEEP)


def test_restrict_cannot_keep_more_than_the_bounding_set_allows() -> None:
    code = (f"from nvctk.hook import caps; caps.restrict({KEEP!r}); "
            "print(','.join(caps.current(caps.CAP_PERMITTED)))")
    r = _in_bounding_set(KEEP[:-1], code)  # one of them is not there to keep
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ",".join(KEEP[:-1])


def _child(code: str) -> subprocess.CompletedProcess[str]:
    script = f"import sys; sys.path.insert(0, {str(REPO)!r})\n{code}"
    return subprocess.run([sys.executable, "-I", "-S", "-c", script], capture_output=True,
                          text=True, timeout=60)


def _status(text: str, field: str) -> str:
    (line,) = [x for x in text.splitlines() if x.startswith(field + ":")]
    return line.split()[1]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (capabilities to give up)")
def test_restrict_then_steps_then_limit_as_the_kernel_sees_it() -> None:
    """restrict, enter_step, limit_to and drop_all leave exactly the sets they promise,
    read back from /proc/self/status (not from nvctk.hook.caps itself)."""
    code = """
from nvctk.hook import caps
class Log:
    lines = []
    def debug(self, msg): self.lines.append(msg)
log = Log()
def status():
    return open("/proc/self/status").read()
caps.restrict(caps.needed(caps.STEP_CAPS), log)
print("S1", repr(status()))
caps.enter_step("setns", log)
print("S2", repr(status()))
caps.limit_to(["dac_override"])
print("S3", repr(status()))
caps.drop_all()
print("S4", repr(status()))
print("LOG", repr(log.lines))
"""
    r = _child(code)
    assert r.returncode == 0, r.stderr
    st = {line[:2]: eval(line[3:]) for line in r.stdout.splitlines() if line[:1] == "S"}
    logs = eval(next(x for x in r.stdout.splitlines() if x.startswith("LOG"))[4:])

    def mask(names: list[str] | tuple[str, ...] | set[str]) -> int:
        return sum(1 << caps.NUMBERS[n] for n in set(names))

    keep = mask(KEEP)
    assert int(_status(st["S1"], "CapEff"), 16) == 0
    assert int(_status(st["S1"], "CapPrm"), 16) == keep
    assert int(_status(st["S1"], "CapBnd"), 16) == keep
    assert int(_status(st["S1"], "CapInh"), 16) == 0
    assert _status(st["S1"], "NoNewPrivs") == "1"
    assert int(_status(st["S2"], "CapEff"), 16) == mask(caps.STEP_CAPS["setns"])
    assert int(_status(st["S2"], "CapPrm"), 16) == keep
    dac = mask(["dac_override"])
    for field in ("CapEff", "CapPrm"):
        assert int(_status(st["S3"], field), 16) == dac, field
    # CAP_SETPCAP went with restrict: the bounding set stays what restrict left
    assert int(_status(st["S3"], "CapBnd"), 16) == keep
    for field in ("CapEff", "CapPrm", "CapInh"):
        assert int(_status(st["S4"], field), 16) == 0, field
    assert logs[0] == f"caps restricted permitted={','.join(KEEP)} no_new_privs=1"
    assert logs[1] == "caps step=setns effective=" + ",".join(sorted(caps.STEP_CAPS["setns"]))


def test_names_match_the_kernels_numbering() -> None:
    """capability(7)'s numbers, checked against capsh's own table where it is installed."""
    assert caps.NUMBERS["sys_admin"] == 21 and caps.NUMBERS["checkpoint_restore"] == 40
    assert caps.NAMES[caps.NUMBERS["dac_override"]] == "dac_override"
    capsh = shutil.which("capsh")
    if capsh is None:
        return
    for name, num in caps.NUMBERS.items():
        r = subprocess.run([capsh, f"--decode={1 << num:x}"], capture_output=True, text=True)
        if "cap_" in r.stdout:  # capsh of an older libcap may not know the newest
            assert r.stdout.strip().endswith(f"=cap_{name}"), (name, r.stdout)


def test_die_with_parent() -> None:
    """The child of a process that exits is SIGKILLed (PR_SET_PDEATHSIG)."""
    code = """
import os, select, time
from nvctk.hook import caps
r, w = os.pipe()
armed_r, armed_w = os.pipe()
mid = os.fork()
if mid == 0:
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        caps.die_with_parent(parent)
        os.write(w, str(os.getpid()).encode())
        os.write(armed_w, b"1")
        time.sleep(30)
        os._exit(0)
    os.read(armed_r, 1)  # exit only once the child's death signal is armed
    os._exit(0)
os.waitpid(mid, 0)
pid = int(os.read(r, 20))
try:
    fd = os.pidfd_open(pid)
except ProcessLookupError:
    print("gone")
else:  # readable once the process has ended
    print("gone" if select.select([fd], [], [], 5)[0] else "alive")
    if not select.select([fd], [], [], 0)[0]:
        os.kill(pid, 9)
"""
    r = _child(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "gone"
