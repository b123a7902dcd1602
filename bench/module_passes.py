#!/usr/bin/env python3
"""Which nvctk modules a create, a prestart and a DRA prepare pass through, in order.

Run as root from the repo with its venv (it builds a simulated host in /tmp):

    .venv/bin/python bench/module_passes.py --out bench/results/module_passes.txt

sets this tree's figures beside the before column kept in BEFORE (issue 37's start,
0e839a3), which was made with that tree's own venv and nvctk:

    git worktree add /work/main-before 0e839a3 && make -C /work/main-before setup
    /work/main-before/.venv/bin/python bench/module_passes.py --tree /work/main-before \
        --json bench/results/module_passes.before.json

Traced in-process with sys.setprofile (every thread): each Python function call whose
code belongs to an nvctk module (module bodies, i.e. imports, left out) appends the
module when it differs from the last one appended. Reported per path: the modules
visited, the transitions (appends - 1), and the returns: calls that enter a module
already visited, coming from another (the "goes back to a module it already left").

The paths, each after one untraced warm-up (a node's steady state: host inventory and
config caches filled, lazy imports done):
- create, legacy mode and CDI mode: nvctk.runtime.create.prepare_bundle on a fresh
  bundle asking for GPU 0 (the runtime's create minus argv parsing and runc);
- prestart: the hook's prestart run by itself (nvctk.hook.prestart.main), and served:
  what nvctk-runtime's prestart server runs (prestart.ready while runc starts, then
  prestart.answer), each in a forked child, on a copy of the legacy create's bundle, for
  a fake container (`unshare -m sleep`); the processes they fork are traced too, each
  from its fork to its os._exit (the ldconfig child execs ldconfig: not Python then);
- DRA: one NodePrepareResources of one whole GPU through the kubelet plugin's gRPC
  server (bench/dra_prepare.py's set-up), the handler thread's calls.

Not traced: the processes the launchers start (they run `python3 -I -S`: no site, no
env hook), so the served prestart's server is not seen as a process of its own.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
BEFORE = HERE / "bench" / "results" / "module_passes.before.json"


class Trace:
    """The nvctk modules entered, per thread, in order (consecutive repeats merged)."""

    def __init__(self) -> None:
        self.seqs: dict[int, list[str]] = {}
        self.active = True  # False: the hook is in place (threads started inherit it), idle

    def _prof(self, frame: Any, event: str, arg: Any) -> None:
        if not self.active or event != "call" or frame.f_code.co_name == "<module>":
            return
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("nvctk"):
            return
        seq = self.seqs.setdefault(threading.get_ident(), [])
        if not seq or seq[-1] != name:
            seq.append(name)

    @contextmanager
    def on(self) -> Iterator[None]:
        threading.setprofile(self._prof)
        sys.setprofile(self._prof)
        try:
            yield
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]


def summary(seq: list[str]) -> dict[str, Any]:
    seen: set[str] = set()
    back: dict[str, int] = {}
    for m in seq:
        if m in seen:
            back[m] = back.get(m, 0) + 1
        seen.add(m)
    return {"modules": len(seen), "transitions": max(len(seq) - 1, 0),
            "returns": sum(back.values()), "order": list(dict.fromkeys(seq)), "seq": seq,
            "back": dict(sorted(back.items(), key=lambda kv: -kv[1]))}


def traced_in_child(fn: Callable[[], None]) -> list[list[str]]:
    """fn run in a forked child under the trace: the sequence of that child, then of
    each process it forks that ends with os._exit (the hook's worker and ldconfig
    child), each from its fork on, reported through a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.close(r)
        t = Trace()
        marks: dict[int, int] = {}
        real_exit = os._exit

        def own() -> list[str]:
            seq = t.seqs.get(threading.get_ident(), [])
            return seq[marks.get(os.getpid(), 0):]

        def send(seq: list[str]) -> None:
            try:
                os.write(w, (json.dumps(seq) + "\n").encode())
            except OSError:  # a child that closed the pipe reports nothing
                pass

        def exit_(code: int) -> None:
            sys.setprofile(None)
            send(own())
            real_exit(code)

        os.register_at_fork(after_in_child=lambda: marks.__setitem__(
            os.getpid(), len(t.seqs.get(threading.get_ident(), []))))
        os._exit = exit_  # type: ignore[assignment]
        code = 0
        try:
            with t.on():
                fn()
        except BaseException as e:
            sys.stderr.write(f"module_passes: child: {e!r}\n")
            code = 1
        send(own())
        real_exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError("the traced child failed")
    seqs = [json.loads(line) for line in b"".join(chunks).decode().splitlines()]
    return [seqs[-1], *seqs[:-1]]  # the traced process first, then its children


def plain_spec(root: str, env: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(["runc", "spec", "--bundle", d], check=True)
        spec = json.loads((Path(d) / "config.json").read_text())
    spec["root"] = {"path": root, "readonly": False}
    spec["process"]["terminal"] = False
    spec["process"]["args"] = ["true"]
    spec["process"]["env"] = ["PATH=/usr/local/bin:/usr/bin:/bin", *env]
    return spec


@contextmanager
def fake_container() -> Iterator[int]:
    """A process in a mount namespace of its own (as runc leaves the container before
    its prestart hooks): its pid."""
    own = os.stat("/proc/self/ns/mnt").st_ino
    p = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "600"])
    try:
        for _ in range(1000):
            try:
                if os.stat(f"/proc/{p.pid}/ns/mnt").st_ino != own:
                    break
            except FileNotFoundError:
                pass
            time.sleep(0.01)
        yield p.pid
    finally:
        p.kill()
        p.wait()


def oci_state(bundle: str, pid: int) -> bytes:
    return json.dumps({"ociVersion": "1.0.2", "id": "mp-legacy", "status": "creating",
                       "pid": pid, "bundle": bundle}).encode()


def the_hook(bundle: str) -> Callable[[], None]:
    """nvctk-hook prestart by itself, on a fake container's pid."""
    from nvctk.hook import prestart

    def run() -> None:
        with fake_container() as pid:
            err = io.StringIO()
            code = prestart.main([], stdin=io.BytesIO(oci_state(bundle, pid)), stderr=err)
            if code != 0:
                raise RuntimeError(f"prestart: {code}: {err.getvalue()}")
    return run


def the_server(bundle: str) -> Callable[[], None]:
    """What nvctk-runtime's prestart server runs (nvctk.hook.server): the bundle made
    ready while runc starts, then the hook's state answered."""
    from nvctk.hook import prestart

    def run() -> None:
        prepared = prestart.ready(bundle)
        with fake_container() as pid:
            code, err = prestart.answer(oci_state(bundle, pid), prepared)
            if code != 0:
                raise RuntimeError(f"served prestart: {code}: {err}")
    return run


class Node:
    """A simulated host of 2 GPUs with a rootfs, nvctk's config for legacy and CDI mode,
    and bundles made on it."""

    def __init__(self, tmp: Path) -> None:
        from nvctk.base import config as nvconfig
        from nvctk.sim import host as simhost
        from nvctk.sim.rootfs import build_rootfs
        from nvctk.sim.topology import make_topology

        self.tmp, self.n = tmp, 0
        self.sim = simhost.init(str(tmp / "sim"), make_topology(gpus=2))
        self.rootfs = str(tmp / "rootfs")
        build_rootfs(self.rootfs, with_sample=self.sim.sample)
        os.environ[nvconfig.CACHE_VAR] = str(tmp / "cache")
        config = nvconfig.load(self.sim.config_path)
        self.config = config.replace(state_dir=str(tmp / "state"), log_file=str(tmp / "nvctk.log"),
                                     hook_path=str(Path(sys.executable).parent / "nvctk-hook"))
        spec_dir = tmp / "cdi"
        spec_dir.mkdir()
        # the venv's launcher: it finds nvctk-hook beside it, for the spec's hooks
        subprocess.run([str(Path(sys.executable).parent / "nvctk"), "cdi", "generate", "--output",
                        str(spec_dir / "nvidia.json")],
                       env={**os.environ, "NVCTK_CONFIG": self.sim.config_path}, check=True,
                       capture_output=True)
        self.cdi_config = self.config.replace(mode="cdi", cdi_spec_dirs=(str(spec_dir),))

    def bundle(self, env: list[str]) -> str:
        self.n += 1
        b = self.tmp / f"bundle{self.n}"
        b.mkdir()
        (b / "config.json").write_text(json.dumps(plain_spec(self.rootfs, env)))
        return str(b)

    def create(self, cfg: Any, env: list[str], cid: str) -> tuple[str, list[str]]:
        """A create (after a warm one), traced; the bundle it made ready."""
        from nvctk.runtime.create import prepare_bundle

        runc_root = str(self.tmp / "runc")
        prepare_bundle(self.bundle(env), cfg, container_id=f"{cid}-warm", runtime_root=runc_root)
        b = self.bundle(env)
        t = Trace()
        with t.on():
            prepare_bundle(b, cfg, container_id=cid, runtime_root=runc_root)
        return b, t.seqs.get(threading.get_ident(), [])

    def copies(self, bundle: str, *names: str) -> list[str]:
        out = []
        for name in names:
            out.append(str(self.tmp / f"bundle-{name}"))
            subprocess.run(["cp", "-a", bundle, out[-1]], check=True)
        return out


def measure(tmp: Path) -> dict[str, Any]:
    node = Node(tmp)
    out: dict[str, Any] = {}
    gpu = ["NVIDIA_VISIBLE_DEVICES=0"]
    legacy_bundle, out["create, legacy mode"] = node.create(node.config, gpu, "mp-legacy")
    _, out["create, CDI mode"] = node.create(node.cdi_config, gpu, "mp-cdi")
    for what, make, names in (("prestart", the_hook, ("hook-warm", "hook")),
                              ("served prestart", the_server, ("served-warm", "served"))):
        for b in node.copies(legacy_bundle, *names):  # the first is the warm run
            first, *children = traced_in_child(make(b))
        out[f"{what}: the {'hook' if make is the_hook else 'server'}"] = first
        for i, seq in enumerate(children, 1):
            out[f"{what}: forked child {i}" + (" (worker)" if i == 1 else "")] = seq
    out["DRA NodePrepareResources, 1 GPU"] = dra(tmp, node.sim)
    return {k: summary(v) for k, v in out.items()}


def dra(tmp: Path, sim: Any) -> list[str]:
    sys.path.insert(0, str(HERE / "tests"))
    sys.path.insert(0, str(HERE / "bench"))
    import dra_prepare as dp

    from nvctk.base.config import Config
    from nvctk.dra.kube import Kube, Retry
    from nvctk.dra.node import make_driver
    from nvctk.dra.server import Plugin
    from nvctk.host import nvml
    from nvctk.k8s.health import Health
    from support import apiserver
    from support.apiserver import client_for, running
    from support.drakubelet import FakeDraKubelet

    apiserver._Handler.disable_nagle_algorithm = True
    d = tmp / "dra"
    d.mkdir()
    # the plugin's gRPC threads start under the (idle) hook: a profile set later would
    # not reach threads already running (3.11 has no setprofile_all_threads)
    t = Trace()
    t.active = False
    with t.on(), running() as api:
        cfg = Config(driver_root=sim.root, hook_path="/usr/bin/nvctk-hook",
                     state_dir=f"{d}/state", authority_key=f"{d}/authority.key")
        health = Health()
        kube = Kube(client_for(api), Retry(attempts=3, base=0.01, cap=0.05, deadline=10))
        driver, _, _ = make_driver(dp.DRIVER, dp.NODE, kube, f"{d}/p", f"{d}/cdi", health,
                                   cfg=cfg, host=nvml.query_host(sim.root))
        plugin = Plugin(driver, health, f"{d}/p", f"{d}/r")
        plugin.start()
        kl = FakeDraKubelet(f"{d}/r")
        kl.register(dp.DRIVER)
        try:
            for name in ("warm", "traced"):
                obj = api.add_claim(dp.claim(name, ["gpu-0"], False))
                ref = [("bench", name, obj["metadata"]["uid"])]
                t.seqs.clear()
                t.active = name == "traced"
                got = kl.prepare(ref)
                t.active = False
                assert not next(iter(got.values())).error, got
        finally:
            kl.close()
            plugin.stop()
    main_thread = threading.get_ident()
    seqs = [s for tid, s in t.seqs.items() if tid != main_thread]
    return max(seqs, key=len) if seqs else []


def report(after: dict[str, Any], before: dict[str, Any] | None, labels: tuple[str, str]
           ) -> str:
    lines = [
        "# nvctk modules each path passes through (bench/module_passes.py): function calls",
        "# whose code is an nvctk module's, traced with sys.setprofile, consecutive calls in",
        "# one module merged; returns = entries into a module already visited, from another.",
        "# The processes the launchers start are not traced: the create as prepare_bundle,",
        "# the prestart as the hook's body run by itself and as the prestart server runs it",
        "# (ready, then answer), each in a forked child, with the worker it forks; DRA as one",
        "# gRPC NodePrepareResources. Each after one untraced warm-up.",
        "",
    ]
    cols = [(labels[0], before), (labels[1], after)] if before else [(labels[1], after)]
    lines.append(f"{'path':44} " + "  ".join(f"{c:>26}" for c, _ in cols))
    lines.append(f"{'':44} " + "  ".join(f"{'modules/transitions/returns':>26}" for _ in cols))
    for path in dict.fromkeys([*after, *(before or {})]):
        cells = []
        for _, data in cols:
            s = data.get(path) if data else None
            cells.append(f"{s['modules']:>8} {s['transitions']:>8} {s['returns']:>8}"
                         if s else f"{'-':>26}")
        lines.append(f"{path:44} " + "  ".join(f"{c:>26}" for c in cells))
    for label, data in cols:
        lines += ["", f"## {label}: the modules in order of first visit, per path"]
        for path, s in (data or {}).items():
            lines.append(f"{path}: " + " ".join(m.removeprefix("nvctk.") for m in s["order"]))
            back = s.get("back") or summary(s["seq"])["back"]
            lines.append("  returns, most first: " + ", ".join(
                f"{m.removeprefix('nvctk.')} {k}" for m, k in list(back.items())[:6]))
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", help="the checkout whose nvctk to trace (default: this one)")
    ap.add_argument("--json", help="write the raw result here")
    ap.add_argument("--before", default=str(BEFORE) if BEFORE.exists() else None,
                    help="a --json result to set beside this tree's (default: BEFORE)")
    ap.add_argument("--labels", default="before (0e839a3),after",
                    help="the two columns' names, comma-separated")
    ap.add_argument("--out", help="write the report here")
    a = ap.parse_args()
    tree = Path(a.tree).resolve() if a.tree else HERE
    sys.path.insert(0, str(tree))
    if a.tree:  # that tree's nvctk, not an editable install's
        for m in [m for m in sys.modules if m == "nvctk" or m.startswith("nvctk.")]:
            del sys.modules[m]
    with tempfile.TemporaryDirectory(prefix="modpass", dir="/tmp") as tmp:
        result = measure(Path(tmp))
    import nvctk
    assert Path(nvctk.__file__).resolve().is_relative_to(tree), nvctk.__file__
    if a.json:
        Path(a.json).write_text(json.dumps(result))
    before = json.loads(Path(a.before).read_text()) if a.before else None
    labels = tuple(a.labels.split(",", 1))
    text = report(result, before, (labels[0], labels[1]))
    print(text, end="")
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
