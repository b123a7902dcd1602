"""nvctk cdi generate / list, and the nvctk-hook subcommands its spec calls."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from nvctk.cdi import generate, load
from nvctk.host.inventory import GpuInfo, MigInfo, proc_bus_id
from nvctk.host.select import Selected
from nvctk.sim.host import SimHost
from support.fs import node_id, plant
from support.sim import show_sim_pci

SHARED = Path(__file__).resolve().parents[3] / "shared"
SCHEMA_DIR = SHARED / "schemas" / "cdi"
NCT_BIN = SHARED / "peers" / "nct" / "bin"
HOOK = os.path.join(os.path.dirname(sys.executable), "nvctk-hook")

GPU = GpuInfo(3, "GPU-aaaa", "H100", 3, "00000000:1B:00.0", 81920, "9.0", "nvidia", True,
              (MigInfo(1, "MIG-bbbb", 2, 0, "3g.40gb", 40960),))


@pytest.mark.parametrize(("strategy", "mig", "want"), [
    ("index", False, "3"), ("index", True, "3:1"),
    ("uuid", False, "GPU-aaaa"), ("uuid", True, "MIG-bbbb"),
    ("type-index", False, "gpu3"), ("type-index", True, "mig3:1"),
])
def test_device_names(strategy: str, mig: bool, want: str) -> None:
    sel = Selected(GPU, GPU.mig_devices[0] if mig else None)
    assert generate.device_names(sel, strategy) == want


def test_unknown_strategy_is_an_error() -> None:
    with pytest.raises(load.CdiError, match="unknown device name strategy 'name'"):
        generate.device_names(Selected(GPU), "name")


def _spec(names: list[str], **edits: Any) -> dict[str, Any]:
    return {"cdiVersion": "", "kind": "nvidia.com/gpu",
            "devices": [{"name": n, "containerEdits": {}} for n in names],
            "containerEdits": edits}


@pytest.mark.parametrize(("spec", "want"), [
    (_spec(["gpu0"], deviceNodes=[{"path": "/dev/nvidia0"}]), "0.3.0"),
    (_spec(["gpu0"], mounts=[{"hostPath": "/a", "containerPath": "/a", "type": "bind"}]),
     "0.4.0"),
    (_spec(["0"]), "0.5.0"),
    (_spec(["gpu0"], deviceNodes=[{"path": "/dev/nvidia0", "hostPath": "/x/dev/nvidia0"}]),
     "0.5.0"),
    ({**_spec(["gpu0"]), "annotations": {"a": "b"}}, "0.6.0"),
])
def test_min_version(spec: dict[str, Any], want: str) -> None:
    assert generate.min_version(spec) == want


# --- generate on the simulated host ------------------------------------------------------------


def _generate(run_nvctk: Callable[..., Any], sim: SimHost, out: Path, *args: str) -> Any:
    r = run_nvctk("cdi", "generate", "--output", str(out), *args, config=sim.config_path)
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(out.read_text())


@pytest.fixture(scope="module")
def spec_yaml(sim_host: SimHost, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from support.exe import nvctk_exe

    out = tmp_path_factory.mktemp("cdi") / "nvidia.yaml"
    r = subprocess.run([*nvctk_exe(), "cdi", "generate", "--output", str(out)],
                       env={**os.environ, "NVCTK_CONFIG": sim_host.config_path},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return out


def test_spec_file_mode_and_no_leftovers(spec_yaml: Path) -> None:
    assert stat.S_IMODE(spec_yaml.stat().st_mode) == 0o644
    assert sorted(p.name for p in spec_yaml.parent.iterdir()) == [spec_yaml.name]


@pytest.mark.skipif(not SCHEMA_DIR.is_dir(), reason="../shared/schemas/cdi is absent")
@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_spec_validates_against_official_schema(sim_host_mig: SimHost, tmp_path: Path,
                                                 run_nvctk: Callable[..., Any],
                                                 fmt: str) -> None:
    import jsonschema
    from referencing import Registry
    from referencing.jsonschema import DRAFT7

    spec = _generate(run_nvctk, sim_host_mig, tmp_path / f"s.{fmt}", "--format", fmt)
    if fmt == "json":
        json.loads((tmp_path / "s.json").read_text())  # really JSON
    schema = json.loads((SCHEMA_DIR / "schema.json").read_text())
    defs = json.loads((SCHEMA_DIR / "defs.json").read_text())
    registry: Registry[Any] = Registry().with_resource("defs.json",
                                                       DRAFT7.create_resource(defs))
    jsonschema.Draft7Validator(schema, registry=registry).validate(spec)
    assert spec["cdiVersion"] == "0.5.0"  # hostPath on device nodes, names like "0"


def test_spec_devices_and_edits(sim_host_mig: SimHost, tmp_path: Path,
                                run_nvctk: Callable[..., Any]) -> None:
    topo = sim_host_mig.topology
    spec = _generate(run_nvctk, sim_host_mig, tmp_path / "s.yaml",
                     "--device-name-strategy", "type-index", "--vendor", "example.com",
                     "--class", "accel")
    assert spec["kind"] == "example.com/accel"
    devs = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    g0, g1 = topo.gpus
    assert set(devs) == {"gpu0", "gpu1", "all"} | {f"mig0:{m.index}" for m in g0.mig_devices}
    paths = {n: [x["path"] for x in e["deviceNodes"]] for n, e in devs.items()}
    assert paths["gpu1"] == ["/dev/nvidia1", f"/dev/dri/card{g1.minor}",
                             f"/dev/dri/renderD{128 + g1.minor}"]
    m0 = g0.mig_devices[0]
    assert paths["mig0:0"] == ["/dev/nvidia0", f"/dev/nvidia-caps/nvidia-cap{m0.gi_cap_minor}",
                               f"/dev/nvidia-caps/nvidia-cap{m0.ci_cap_minor}"]
    assert set(paths["all"]) == {p for n, ps in paths.items() if n != "all" for p in ps}
    node = devs["gpu1"]["deviceNodes"][0]
    assert node == {"path": "/dev/nvidia1", "hostPath": f"{sim_host_mig.root}/dev/nvidia1",
                    "type": "c", "major": 195, "minor": 1, "fileMode": 0o666,
                    "permissions": "rwm"}
    common = spec["containerEdits"]
    assert [d["path"] for d in common["deviceNodes"]] == [
        "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"]
    mounts = {m["containerPath"]: m for m in common["mounts"]}
    lib = "/usr/lib/x86_64-linux-gnu"
    v = topo.driver_version
    for name in (f"libcuda.so.{v}", f"libnvidia-ml.so.{v}", f"libGLX_nvidia.so.{v}",
                 f"libnvidia-encode.so.{v}", f"libnvidia-ngx.so.{v}"):
        assert mounts[f"{lib}/{name}"]["options"] == ["ro", "nosuid", "nodev", "rbind", "rprivate"]
    assert any(p.startswith(f"/lib/firmware/nvidia/{v}/gsp") for p in mounts)
    assert mounts["/run/nvidia-persistenced/socket"]["options"] == [
        "nosuid", "nodev", "rbind", "rprivate", "noexec"]
    assert "/usr/bin/nvidia-smi" in mounts
    # one createRuntime hook per device, none in the common edits: a one-device container
    # runs one hook (the common links, the device's own and ldconfig)
    assert "hooks" not in common
    bus = proc_bus_id(g1.pci_bus_id)
    for e in devs.values():
        (hook,) = e["hooks"]
        assert hook["hookName"] == "createRuntime" and hook["path"] == HOOK
        assert hook["env"] == [f"NVCTK_CONFIG={sim_host_mig.config_path}"]
        assert hook["args"][:2] == ["nvctk-hook", "cdi-edits"]
        assert hook["args"][-2:] == ["--folder", lib]
        assert f"libcuda.so.1::{lib}/libcuda.so" in hook["args"]
    drm = ["--link", f"../card{g1.minor}::/dev/dri/by-path/pci-{bus}-card",
           "--link", f"../renderD{128 + g1.minor}::/dev/dri/by-path/pci-{bus}-render"]
    args = devs["gpu1"]["hooks"][0]["args"]
    assert any(args[i:i + 4] == drm for i in range(len(args)))
    assert not any(f"pci-{bus}-card" in a for a in devs["gpu0"]["hooks"][0]["args"])


def test_generate_to_stdout_and_bad_vendor(sim_host: SimHost,
                                           run_nvctk: Callable[..., Any]) -> None:
    r = run_nvctk("cdi", "generate", "--format", "json", config=sim_host.config_path)
    assert r.returncode == 0, r.stderr
    assert [d["name"] for d in json.loads(r.stdout)["devices"]][-1] == "all"
    r = run_nvctk("cdi", "generate", "--vendor", "a/b", config=sim_host.config_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "vendor" in r.stderr


def test_generate_on_a_host_without_nvidia_modeset(tmp_path: Path,
                                                  run_nvctk: Callable[..., Any]) -> None:
    """Headless hosts load no nvidia-modeset.ko (an H100 with driver 580, seen): `cdi
    generate` failed there with 'device node /dev/nvidia-modeset is missing'."""
    from nvctk.sim import host as simhost
    from nvctk.sim.topology import make_topology

    sim = simhost.init(str(tmp_path / "host"), make_topology(gpus=1))
    os.unlink(os.path.join(sim.dev_dir, "nvidia-modeset"))
    r = run_nvctk("cdi", "generate", "--format", "json", config=sim.config_path)
    assert r.returncode == 0, r.stderr
    nodes = [n["path"] for n in json.loads(r.stdout)["containerEdits"]["deviceNodes"]]
    assert "/dev/nvidiactl" in nodes and "/dev/nvidia-modeset" not in nodes


def test_generate_unwritable_output_is_a_clear_error(sim_host: SimHost, tmp_path: Path,
                                                     run_nvctk: Callable[..., Any]) -> None:
    (tmp_path / "file").write_text("")
    r = run_nvctk("cdi", "generate", "--output", str(tmp_path / "file" / "x.yaml"),
                  config=sim_host.config_path)
    assert r.returncode == 1 and r.stderr.startswith("nvctk: cannot write"), r.stderr


@pytest.mark.parametrize("kind", ["chardev", "fifo", "dir", "symlink"])
def test_generate_never_replaces_what_is_not_a_regular_file(
        sim_host: SimHost, tmp_path: Path, run_nvctk: Callable[..., Any], kind: str) -> None:
    """`--output /dev/null` once replaced the host's /dev/null with a spec file."""
    out = tmp_path / "out.yaml"
    plant(out, kind)
    before = node_id(out)
    r = run_nvctk("cdi", "generate", "--output", str(out), config=sim_host.config_path)
    assert r.returncode == 1 and "not a regular file" in r.stderr, r.stderr
    assert node_id(out) == before


# --- list ----------------------------------------------------------------------------------


def test_list(spec_yaml: Path, tmp_path: Path, sim_host: SimHost,
              run_nvctk: Callable[..., Any]) -> None:
    d1, d2 = tmp_path / "a", tmp_path / "b"
    d1.mkdir()
    d2.mkdir()
    shutil.copy(spec_yaml, d1 / "nvidia.yaml")
    (d2 / "broken.yaml").write_text("kind: [\n")
    (d2 / "nokind.json").write_text('{"cdiVersion": "0.5.0", "devices": []}')
    (d2 / "dup.yaml").write_text(yaml.safe_dump({
        "cdiVersion": "0.5.0", "kind": "x.com/y",
        "devices": [{"name": "a", "containerEdits": {}}, {"name": "a", "containerEdits": {}}]}))
    (d2 / "other.json").write_text(json.dumps({
        "cdiVersion": "0.5.0", "kind": "x.com/y",
        "devices": [{"name": "a", "containerEdits": {}}]}))
    (d2 / "ignored.txt").write_text("x")
    r = run_nvctk("cdi", "list", "--spec-dir", str(d1), "--spec-dir", str(d2),
                  "--spec-dir", str(tmp_path / "missing"))
    assert r.returncode == 0, r.stderr
    gpus = sim_host.topology.gpus
    assert r.stdout.split() == sorted(
        ["nvidia.com/gpu=0", "nvidia.com/gpu=1", "nvidia.com/gpu=all", "x.com/y=a"]
        + [f"nvidia.com/gpu={g.uuid}" for g in gpus])
    warnings = r.stderr.splitlines()
    assert len(warnings) == 3 and all(w.startswith("warning: ") for w in warnings), warnings
    assert any("broken.yaml: not a CDI spec: not valid YAML" in w for w in warnings)
    assert any("nokind.json: missing kind" in w for w in warnings)
    assert any("dup.yaml: device 'a' appears twice" in w for w in warnings)


# --- the hooks -----------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "msg"), [
    (["create-symlinks"], "--link is required"),
    (["create-symlinks", "--link", "a::relative"], "want TARGET::/ABSOLUTE/PATH"),
    (["create-symlinks", "--link", "::/x"], "want TARGET::/ABSOLUTE/PATH"),
    (["create-symlinks", "--link"], "--link needs a value"),
    (["create-symlinks", "--folder", "/x"], "unexpected argument '--folder'"),
    (["update-ldcache", "--folder", "lib"], "want one absolute container path"),
    (["update-ldcache", "--folder", "/a", "--folder", "/b"], "want one absolute"),
    (["cdi-edits"], "--link or --folder or --pin is required"),
    (["cdi-edits", "--link", "a::/x", "--folder", "/a", "--folder", "/b"], "want one absolute"),
    (["cdi-edits", "--mount", "/x"], "unexpected argument '--mount'"),
])
def test_hook_bad_arguments(args: list[str], msg: str) -> None:
    r = subprocess.run([HOOK, *args], input=b"", capture_output=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert msg in r.stderr.decode() and b"Traceback" not in r.stderr


def test_hook_bad_state_is_a_clear_error() -> None:
    r = subprocess.run([HOOK, "update-ldcache", "--folder", "/usr/lib"], input=b"{",
                       capture_output=True, timeout=30)
    assert r.returncode == 1 and r.stderr.startswith(b"nvctk-hook: update-ldcache: ")
    assert b"Traceback" not in r.stderr


def _apply_cdi(spec: dict[str, Any], names: list[str], oci_spec: dict[str, Any]) -> None:
    """What a CDI-aware engine does with the spec (test stand-in for podman/containerd)."""
    edits = [spec["containerEdits"]] + [d["containerEdits"] for d in spec["devices"]
                                        if d["name"] in names]
    linux = oci_spec["linux"]
    for e in edits:
        for n in e.get("deviceNodes", ()):
            linux.setdefault("devices", []).append(
                {k: n[k] for k in ("path", "type", "major", "minor")})
            linux["resources"]["devices"].append(
                {"allow": True, "type": n["type"], "major": n["major"], "minor": n["minor"],
                 "access": "rwm"})
        for m in e.get("mounts", ()):
            oci_spec["mounts"].append({"source": m["hostPath"], "destination": m["containerPath"],
                                       "type": "bind", "options": m["options"]})
        for h in e.get("hooks", ()):
            entry = {k: h[k] for k in ("path", "args", "env") if k in h}
            oci_spec.setdefault("hooks", {}).setdefault(h["hookName"], []).append(entry)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runc") is None,
                    reason="needs root and runc")
def test_runc_container_from_the_cdi_spec(sim_host: SimHost, spec_yaml: Path,
                                          tmp_path: Path) -> None:
    """The spec's edits in a plain runc bundle: one nvctk-hook cdi-edits runs as a
    createRuntime hook (links and ldconfig); the container finds libcuda through
    its ld.so.cache, its DRM by-path links, and nvidia-smi works."""
    from nvctk.sim.rootfs import build_rootfs

    spec = yaml.safe_load(spec_yaml.read_text())
    b = tmp_path / "bundle"
    b.mkdir()
    subprocess.run(["runc", "spec", "--bundle", str(b)], check=True)
    build_rootfs(str(b / "rootfs"))
    oci_spec = json.loads((b / "config.json").read_text())
    g1 = sim_host.topology.gpus[1]
    bus = proc_bus_id(g1.pci_bus_id)
    script = (f"readlink /dev/dri/by-path/pci-{bus}-card; "
              "readlink /usr/lib/x86_64-linux-gnu/libcuda.so; "
              "grep -c libcuda.so.1 /etc/ld.so.cache; nvidia-smi -L")
    oci_spec["process"].update(terminal=False, args=["sh", "-c", script],
                               env=["PATH=/usr/bin:/bin:/sbin"])
    oci_spec["root"] = {"path": "rootfs", "readonly": False}
    _apply_cdi(spec, ["1"], oci_spec)
    oci_spec["mounts"].append({"source": os.path.join(sim_host.root, "run/nvidia-sim"),
                               "destination": "/run/nvidia-sim", "type": "bind",
                               "options": ["rbind"]})
    (b / "config.json").write_text(json.dumps(oci_spec))
    cid = "nvctk-cdi-" + uuid.uuid4().hex[:8]
    try:
        r = subprocess.run(["runc", "--root", str(tmp_path / "root"), "run", "--bundle", str(b),
                            cid], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "NVCTK_CONFIG": sim_host.config_path})
    finally:
        subprocess.run(["runc", "--root", str(tmp_path / "root"), "delete", "--force", cid],
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"../card{g1.minor}"
    assert lines[1] == "libcuda.so.1"
    assert int(lines[2]) >= 1
    assert [x for x in lines[3:] if x.startswith("GPU ")] == [f"GPU 0: {g1.name} (UUID: {g1.uuid})"]


# --- side by side with NVIDIA's nvidia-ctk ----------------------------------------------------


@pytest.mark.skipif(not (NCT_BIN / "nvidia-ctk").exists(),
                    reason="../shared/peers/nct (NVIDIA's toolkit build) is absent")
def test_side_by_side_with_nvidia_ctk(sim_host: SimHost, tmp_path: Path,
                                      run_nvctk: Callable[..., Any]) -> None:
    """(The 2-GPU sim without MIG: nvidia-ctk asks the simulated NVML for MIG profile
    attributes it does not answer.)"""
    root = sim_host.root
    nct_out = tmp_path / "nct.yaml"
    r = subprocess.run(
        [str(NCT_BIN / "nvidia-ctk"), "cdi", "generate", f"--driver-root={root}",
         f"--dev-root={root}", f"--nvidia-cdi-hook-path={NCT_BIN / 'nvidia-cdi-hook'}",
         f"--output={nct_out}"], capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: show_sim_pci(root))
    assert r.returncode == 0, r.stderr
    nct = yaml.safe_load(nct_out.read_text())
    ours = _generate(run_nvctk, sim_host, tmp_path / "ours.yaml")

    def nodes(spec: dict[str, Any]) -> dict[str, set[tuple[str, str, int, int]]]:
        out = {}
        common = {(n["path"], n.get("hostPath", n["path"]), n.get("major", 0),
                   n.get("minor", 0)) for n in spec["containerEdits"].get("deviceNodes", ())}
        for d in spec["devices"]:
            own = {(n["path"], n.get("hostPath", n["path"]), n.get("major", 0),
                    n.get("minor", 0)) for n in d["containerEdits"].get("deviceNodes", ())}
            out[d["name"]] = own | common
        return out

    assert nct["kind"] == ours["kind"]
    assert nodes(ours) == nodes(nct)
    ours_src = {m["hostPath"] for m in ours["containerEdits"]["mounts"]}
    nct_files = {m["hostPath"] for m in nct["containerEdits"]["mounts"]}
    # every file NVIDIA's spec mounts, configuration files included (the OpenCL
    # ICD, the .x86_64 Vulkan ICD, three EGL platform files and two X configs were
    # missing), but for the Vulkan layers file NVIDIA also takes from icd.d, where the
    # simulated host has a second copy: ours comes from implicit_layer.d, where the
    # loader reads layers (docs/decisions.md)
    layers_in_icd = f"{root}/usr/share/vulkan/icd.d/nvidia_layers.json"
    assert nct_files - ours_src - {layers_in_icd} == set()
    assert f"{root}/usr/share/vulkan/implicit_layer.d/nvidia_layers.json" in ours_src


# --- hostile spec files: each is one unreadable spec, never a hang or a traceback ----------

_GOOD = ("cdiVersion: 0.5.0\nkind: x.io/c\ndevices:\n- name: a\n  containerEdits:\n"
         "    env: [A=1]\n")


def _hostile_files(d: Path) -> dict[str, Callable[[Path], None]]:
    return {
        "fifo": lambda p: os.mkfifo(p),
        "devzero": lambda p: p.symlink_to("/dev/zero"),
        "too-big": lambda p: p.write_bytes(b" " * ((4 << 20) + 1)),
        "deep": lambda p: p.write_text("a: " + "[" * 20000 + "]" * 20000 + "\n"),
        "deep-mapping": lambda p: p.write_text(
            "".join(" " * i + "a:\n" for i in range(3000)) + " " * 3000 + "b\n"),
        "bigint": lambda p: p.write_text("a: " + "9" * 5000 + "\n"),
        "aliases": lambda p: p.write_text(
            f"s: &s {'x' * 100000}\nargs: [" + ", ".join(["*s"] * 300) + "]\n"),
    }


@pytest.mark.parametrize("case", list(_hostile_files(Path())))
def test_hostile_spec_file_is_one_unreadable_spec(tmp_path: Path, case: str) -> None:
    import signal

    d = tmp_path / "d"
    d.mkdir()
    (d / "good.yaml").write_text(_GOOD)
    _hostile_files(d)[case](d / "x.yaml")
    signal.alarm(20)  # a hang fails the test instead of the suite
    try:
        with pytest.raises(load.CdiError, match=r"x\.yaml: "):
            load.load_spec_file(str(d / "x.yaml"))
        names, warnings = load.list_devices((str(d),))
        assert names == ["x.io/c=a"] and len(warnings) == 1 and "x.yaml" in warnings[0]
        assert [r.name for r in load.resolve(("x.io/c=a",), (str(d),))] == ["x.io/c=a"]
    finally:
        signal.alarm(0)


def test_generate_for_a_vendor_nvctk_does_not_apply_says_so(sim_host: SimHost, tmp_path: Path,
                                                            run_nvctk: Callable[..., Any]) -> None:
    r = run_nvctk("cdi", "generate", "--output", str(tmp_path / "s.yaml"), "--vendor",
                  "example.com", config=sim_host.config_path)
    assert r.returncode == 0, r.stderr
    assert "add example.com there for containers to name example.com/gpu devices" in r.stderr
    r = run_nvctk("cdi", "generate", "--output", str(tmp_path / "n.yaml"),
                  config=sim_host.config_path)
    assert r.returncode == 0 and "note:" not in r.stderr, r.stderr
