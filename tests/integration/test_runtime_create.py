"""nvctk-runtime end to end on a built simulated host, with a recording fake runtime
(and the real runc where it applies)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import support.runtime as _runtime
from nvctk.base import config as nvconfig
from nvctk.base import stamped
from nvctk.edits import Edits
from nvctk.edits_file import EDITS_FILE
from nvctk.sim.host import SimHost
from nvctk.spec.record import EDITS_ANNOTATION
from support.launchers import Launchers
from support.runtime import (
    BIN,
    NVD,
    RUNTIME,
    Env,
    assert_passed_through,
    create_argv,
    path_with_fake_runc,
    snapshot,
    validate_schema,
)

bundle, env = _runtime.bundle, _runtime.env  # fixtures


def test_gpu_create_edits_spec(env: Env, bundle: Callable[..., Path], sim_host: SimHost) -> None:
    uuid1 = sim_host.topology.gpus[1].uuid
    b = bundle({NVD: uuid1})
    argv = create_argv(env, b)
    r = env.run(*argv)
    assert r.returncode == 0, r.stderr
    assert env.recorded() == argv  # runc got exactly our argv
    spec = json.loads((b / "config.json").read_text())
    plan = Edits.from_json((b / EDITS_FILE).read_text())
    assert plan.gpu_uuids == (uuid1,)
    paths = [d["path"] for d in spec["linux"]["devices"]]
    assert paths == ["/dev/nvidiactl", "/dev/nvidia1", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    rules = spec["linux"]["resources"]["devices"]
    for d in spec["linux"]["devices"]:
        assert {"allow": True, "type": "c", "major": d["major"], "minor": d["minor"],
                "access": "rwm"} in rules
    assert rules[0] == {"allow": False, "access": "rwm"}  # runc spec's deny-all stays first
    hooks = spec["hooks"]["prestart"]
    assert len(hooks) == 1
    # the token of the server this create forked (nvctk.hook.served): new at each create
    token = hooks[0]["args"][3]
    assert re.fullmatch("[0-9a-f]{32}", token), token
    assert hooks[0] == {
        "path": os.path.join(BIN, "nvctk-hook"),
        "args": ["nvctk-hook", "prestart", "--served", token],
        "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                f"NVCTK_CONFIG={env.config}"],
        "timeout": 60,
    }
    validate_schema(spec)

    # idempotent: a second create adds nothing (but its own server's token)
    first = (b / "config.json").read_text()
    assert env.run(*argv).returncode == 0
    again = (b / "config.json").read_text()
    second = json.loads(again)["hooks"]["prestart"][0]["args"][3]
    assert second != token
    assert again.replace(second, token) == first


@pytest.mark.parametrize("value", [None, "void", "", "NONE-SET-BELOW"])
def test_no_gpu_leaves_file_untouched(env: Env, bundle: Callable[..., Path],
                                      value: str | None) -> None:
    b = bundle({} if value is None else {NVD: value} if value != "NONE-SET-BELOW"
               else {"NVIDIA_DRIVER_CAPABILITIES": "all"})
    assert_passed_through(env, b)


def test_no_gpu_with_broken_config_still_runs(env: Env, bundle: Callable[..., Path]) -> None:
    """A config the loader refuses: a no-GPU create runs the default runtimes."""
    b = bundle({})
    env.config.write_text(env.config.read_text() + "\nthis is not toml\n")
    argv = create_argv(env, b)
    r = subprocess.run([RUNTIME, *argv], capture_output=True, text=True, timeout=60,
                       env=path_with_fake_runc(env))
    assert r.returncode == 0, r.stderr  # nvctk did not refuse
    assert env.recorded() == argv


ERRORS: list[tuple[dict[str, str], str]] = [
    ({NVD: "0,7"}, "unknown device '7'"),
    ({NVD: "GPU-deadbeef"}, "unknown device 'GPU-deadbeef'"),
    ({NVD: "0", "NVIDIA_REQUIRE_CUDA": "cuda>=12.6"}, r"cuda>=12\.6 \(host cuda 12\.4\)"),
    ({NVD: "1", "NVIDIA_REQUIRE_ARCH": "arch<8.0"}, r"arch<8\.0 \(host arch 9\.0\)"),
    ({NVD: "0", "NVIDIA_REQUIRE_X": "cuda>>1"}, "requirement 'cuda>>1'"),
    ({NVD: "0", "NVIDIA_REQUIRE_X": "cuda"}, "malformed requirement 'cuda'"),
    ({NVD: "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,bogus"}, "unknown driver capability 'bogus'"),
    ({"CUDA_VERSION": "99.0"}, r"cuda>=99\.0"),
]


@pytest.mark.parametrize(("envvars", "message"), ERRORS)
def test_errors_leave_spec_and_log(env: Env, bundle: Callable[..., Path],
                                   envvars: dict[str, str], message: str) -> None:
    b = bundle(envvars)
    before = snapshot(b / "config.json")
    r = env.run(*create_argv(env, b))
    assert r.returncode == 1
    assert re.search(message, r.stderr), r.stderr
    assert r.stderr.startswith("nvctk-runtime: ")
    assert env.recorded() is None  # runc never started
    assert snapshot(b / "config.json") == before
    assert not (b / EDITS_FILE).exists()
    lines = env.log.read_text().splitlines()
    last = json.loads(lines[-1])
    assert last["level"] == "error" and re.search(message, last["msg"])
    assert last["msg"].startswith("nvctk: ")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", last["time"])
    own_log = Path(env.sim.root, "nvctk.log").read_text()
    assert re.search(message, own_log)


def test_bad_spec_goes_to_runc_unless_it_may_ask_for_a_gpu(env: Env, tmp_path: Path) -> None:
    b = tmp_path / "b"
    b.mkdir()
    (b / "config.json").write_text("{not json")
    argv = create_argv(env, b)
    r = env.run(*argv)
    assert r.returncode == 0, r.stderr  # runc decides (and words its own error)
    assert env.recorded() == argv
    assert (b / "config.json").read_text() == "{not json"
    env.record.unlink()
    bad = '{"process": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]}, not json'
    (b / "config.json").write_text(bad)
    r = env.run(*argv)
    assert r.returncode == 1 and "config.json" in r.stderr and "invalid JSON" in r.stderr
    assert "NVIDIA_VISIBLE_DEVICES" in r.stderr
    assert env.recorded() is None
    assert (b / "config.json").read_text() == bad


def test_broken_config_fails_gpu_create(env: Env, bundle: Callable[..., Path]) -> None:
    b = bundle({NVD: "0"})
    before = snapshot(b / "config.json")
    env.config.write_text(env.config.read_text() + "\nbogus-key = 1\n")
    r = env.run(*create_argv(env, b))
    assert r.returncode == 1 and "bogus-key" in r.stderr
    assert snapshot(b / "config.json") == before


def test_no_runtime_found(env: Env, bundle: Callable[..., Path]) -> None:
    b = bundle({NVD: "0"})
    before = snapshot(b / "config.json")
    env.config.write_text(re.sub(r"(?m)^runtimes = .*$", 'runtimes = ["/nonexistent/runc"]',
                                 env.config.read_text()))
    r = env.run(*create_argv(env, b))
    assert r.returncode == 1 and "no low-level runtime found" in r.stderr
    assert "/nonexistent/runc" in json.loads(env.log.read_text().splitlines()[-1])["msg"]
    assert snapshot(b / "config.json") == before
    # nvctk-runtime itself is never chosen, even when configured
    env.config.write_text(re.sub(r"(?m)^runtimes = .*$", f'runtimes = ["{RUNTIME}"]',
                                 env.config.read_text()))
    r = env.run("--root", str(env.tmp), "state", "x")
    assert r.returncode == 1 and "no low-level runtime found" in r.stderr


def test_docker_gpus_hook_replaced(env: Env, bundle: Callable[..., Path]) -> None:
    def docker(spec: dict[str, Any]) -> None:
        spec["hooks"] = {"prestart": [
            {"path": "/usr/bin/nvidia-container-runtime-hook",
             "args": ["nvidia-container-runtime-hook", "prestart"],
             "env": ["PATH=/usr/bin", "LD_PRELOAD=/x.so"]},
            {"path": "/usr/bin/libnetwork-setkey", "args": ["libnetwork-setkey", "-exec-root"]},
        ]}

    # what `docker run --gpus 1` puts into the env
    b = bundle({NVD: "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}, edit=docker)
    r = env.run(*create_argv(env, b))
    assert r.returncode == 0, r.stderr
    spec = json.loads((b / "config.json").read_text())
    names = [os.path.basename(h["path"]) for h in spec["hooks"]["prestart"]]
    assert names == ["libnetwork-setkey", "nvctk-hook"]
    assert "/dev/nvidia0" in [d["path"] for d in spec["linux"]["devices"]]


def test_bundle_named_create_and_relative(env: Env, bundle: Callable[..., Path]) -> None:
    b = bundle({NVD: "1"}, name="create")
    argv = ["--root", "create", "create", "--bundle", "create", "create"]
    r = env.run(*argv, cwd=str(b.parent))
    assert r.returncode == 0, r.stderr
    assert env.recorded() == argv
    assert (b / EDITS_FILE).exists()


def test_create_from_cwd_with_relative_root(env: Env, bundle: Callable[..., Path]) -> None:
    b = bundle({NVD: "0"}, edit=lambda s: s["root"].update(path="./rootfs"))
    r = env.run("create", "c9", cwd=str(b))  # no --bundle: the cwd
    assert r.returncode == 0, r.stderr
    plan = Edits.from_json((b / EDITS_FILE).read_text())
    assert plan.lib_dir == "/usr/lib/x86_64-linux-gnu"  # found rootfs/etc/debian_version


def test_passthrough_with_broken_config(env: Env) -> None:
    """The defaults apply: the first of ("runc", "crun") on PATH runs, here a recording
    "runc"; the warning goes to nvctk's log, never to stderr (go-runc merges it into
    the output it parses)."""
    argv = ["--root", "/run/x", "--log", str(env.log), "state", "c1"]
    for broken in ('runtimes = ["' + str(env.fake) + '"]\n' + "garbage ===\n", "runtimes = [\n"):
        env.config.write_text(broken)
        env.record.unlink(missing_ok=True)
        r = subprocess.run([RUNTIME, *argv], capture_output=True, text=True, timeout=60,
                           env=path_with_fake_runc(env))
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert env.recorded() == argv


def test_passthrough_real_runc(tmp_path: Path) -> None:
    if not shutil.which("runc"):
        pytest.skip("runc not installed")
    env = {**os.environ, "NVCTK_CONFIG": str(tmp_path / "absent.toml")}
    argv = ["--root", str(tmp_path), "state", "nonexistent-nvctk"]
    ours = subprocess.run([RUNTIME, *argv], env=env, capture_output=True, text=True)
    theirs = subprocess.run(["runc", *argv], capture_output=True, text=True)
    assert ours.returncode == theirs.returncode != 0
    assert "container does not exist" in ours.stderr and "container does not exist" in theirs.stderr
    assert ours.stdout == theirs.stdout


# What a GPU create must not import: each costs every GPU container's start
# milliseconds (dataclasses ~27 ms with inspect/ast, pynvml ~45, typing ~20, ...).
HEAVY = ("dataclasses", "typing", "re", "json", "tomllib", "enum", "inspect", "subprocess",
         "tempfile", "shutil", "hashlib", "pynvml", "ctypes", "collections", "functools",
         "contextlib")
# nvctk's own modules that bring those in, or NVML, or the hook's mount code and the
# vGPU key: only for vGPU or a host-cache miss (the create resolves the image's
# /etc/debian_version with nvctk.oci.rootfs, inside the rootfs by the kernel)
HEAVY_NVCTK = ("nvctk.host.nvml", "nvctk.vgpu.state", "nvctk.vgpu.gc", "nvctk.hook.prestart",
               "nvctk.hook.poststop", "nvctk.hook.mount", "nvctk.vgpu.authority")


def imported_modules(importtime_stderr: str) -> set[str]:
    """Module names of `python -X importtime` output ("import time: self | cumul | name")."""
    out = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:"):
            name = line.rsplit("|", 1)[-1].strip()
            if name != "imported package":
                out.add(name)
    return out


def _importtime_create(env: Env, b: Path, tmp_path: Path, **keys: str) -> set[str]:
    """Modules a create of bundle b imports (`-X importtime`), the second of two creates:
    the first may fill the host cache (NVML). keys: top-level config keys (cdi_spec_dirs
    for cdi-spec-dirs) to set, TOML values."""
    text = env.config.read_text()
    for key, value in {"runtimes": '["/bin/true"]', **keys}.items():
        key = key.replace("_", "-")
        text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
        text = text if n else f"{key} = {value}\n{text}"
    # a host cache of this test's own
    text = re.sub(r"(?m)^state-dir = .*\n", "", text) + f'state-dir = "{tmp_path / "state"}"\n'
    config = tmp_path / "true.toml"
    config.write_text(text)
    # settled, as a node's config is: the first create leaves the parsed-config cache
    # (written here, in-process: a config written this instant is racy, not cached yet)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(stamped, "RACY_NS", -(10**12))
        nvconfig.load(str(config))
    # the launcher, its python3 adding -X importtime
    launchers = Launchers(tmp_path / "launchers", ("-X", "importtime"))
    cmd = [str(launchers.bin / "nvctk-runtime"), "create", "--bundle", str(b), "c-imports"]
    run_env = {**os.environ, "NVCTK_CONFIG": str(config)}
    for _ in range(2):
        r = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-3000:]
    return imported_modules(r.stderr)


def test_gpu_create_imports_nothing_heavy(env: Env, bundle: Callable[..., Path],
                                          tmp_path: Path) -> None:
    b = bundle({NVD: "0"})
    imported = _importtime_create(env, b, tmp_path)
    assert "nvctk.runtime.create" in imported and "nvctk.plan.make" in imported  # the GPU create ran
    assert sorted(n for n in imported if n.split(".")[0] in HEAVY) == []
    assert sorted(n for n in imported if n in HEAVY_NVCTK) == []
    plan = Edits.from_json((b / EDITS_FILE).read_text())
    assert plan.gpu_uuids == (env.sim.topology.gpus[0].uuid,)


def test_cdi_mode_create_imports_nothing_heavy(env: Env, bundle: Callable[..., Path],
                                                tmp_path: Path) -> None:
    """CDI mode seals its record (a MAC) without hashlib: that is OpenSSL, ~2 ms."""
    from support.exe import nvctk_exe

    spec_dir = tmp_path / "cdi"
    r = subprocess.run([*nvctk_exe(), "cdi", "generate", "--output", str(spec_dir / "nv.json")],
                       env={**os.environ, "NVCTK_CONFIG": str(env.config)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    b = bundle({NVD: "0"})
    imported = _importtime_create(env, b, tmp_path, mode='"cdi"',
                                  cdi_spec_dirs=f'["{spec_dir}"]')
    assert "nvctk.runtime.create" in imported and "nvctk.cdi.resolve" in imported
    assert sorted(n for n in imported if n.split(".")[0] in HEAVY) == []
    assert sorted(n for n in imported if n in HEAVY_NVCTK) == []
    record = json.loads(json.loads((b / "config.json").read_text())["annotations"][EDITS_ANNOTATION])
    assert record["cdi"] is True and len(record["mac"]) == 64  # sealed all the same


def test_no_gpu_create_imports_no_planning(env: Env, bundle: Callable[..., Path],
                                           tmp_path: Path) -> None:
    b = bundle({})
    imported = _importtime_create(env, b, tmp_path)
    assert "nvctk.runtime.create" in imported and "nvctk.request.parse" in imported
    assert sorted(n for n in imported if n.split(".")[0] in HEAVY) == []
    # (nvctk.edits is data on modules the create has loaded anyway: ~0.2 ms)
    # nor the prestart's server (nvctk.hook.served); nvctk._sys is loaded, for reading
    # config.json (jsonio decodes with jansson there), as _json was before it
    planning = {"nvctk.plan.make", "nvctk.host.discover", "nvctk.host.driver", "nvctk.host.ldcache", "nvctk.host.cache",
                "nvctk.hook.mount", "nvctk.hook.served", *HEAVY_NVCTK}
    assert sorted(imported & planning) == []
    assert not (b / EDITS_FILE).exists()

