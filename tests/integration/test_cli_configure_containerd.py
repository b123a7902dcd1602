"""`nvctk configure` on containerd's files (v1, v2, v3, drop-ins, every TOML shape handled
or refused clearly), run through the installed `nvctk` command (real files, no daemons:
test_configure_engines.py loads the results into the real containerd and dockerd).
Docker and CRI-O: test_cli_configure_docker_crio.py; broken inputs:
test_cli_configure_broken.py; remove after a hand edit: test_cli_configure_remove.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

import support.configure as _configure
from support.configure import COMMENTED, RUNTIME, V2, Run, cri_runtime, snapshot, toml

nv = _configure.nv  # fixture

try:
    import tomllib  # an independent parser checks tomlkit's output
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


# --- containerd ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_v2(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """`containerd config default` of the installed containerd (1.6: version 2)."""
    if not shutil.which("containerd"):
        pytest.skip("containerd not installed")
    return subprocess.run(["containerd", "config", "default"], capture_output=True,
                          check=True).stdout


def test_containerd_default_config_gets_runtime_with_copied_options(
        nv: Run, tmp_path: Path, default_v2: bytes) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_bytes(default_v2)
    res = nv("--runtime", "containerd", "--config", str(cfg))
    assert res.returncode == 0, res.stderr
    assert "systemctl restart containerd" in res.stdout
    doc = toml(cfg)
    rt = cri_runtime(doc)
    runc = cri_runtime(doc, "runc")
    assert rt["runtime_type"] == "io.containerd.runc.v2"
    assert rt["options"]["BinaryName"] == RUNTIME
    # every other option and runtime setting is runc's
    assert {k: v for k, v in rt["options"].items() if k != "BinaryName"} == \
        {k: v for k, v in runc["options"].items() if k != "BinaryName"}
    assert doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["default_runtime_name"] == "runc"
    # the original text is untouched around the insertion, and kept as .bak
    assert (tmp_path / "config.toml.bak").read_bytes() == default_v2
    new = cfg.read_bytes()
    assert new.startswith(default_v2[: default_v2.index(b"[plugins.\"io.containerd.grpc.v1.cri\".containerd.untrusted")])
    assert len(new) > len(default_v2)


def test_containerd_second_run_changes_no_byte_and_remove_restores(
        nv: Run, tmp_path: Path, default_v2: bytes) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_bytes(default_v2)
    args = ["--runtime", "containerd", "--config", str(cfg), "--set-as-default", "--cdi"]
    assert nv(*args).returncode == 0
    doc = toml(cfg)
    assert doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["default_runtime_name"] == "nvidia"
    assert doc["plugins"]["io.containerd.grpc.v1.cri"]["enable_cdi"] is True
    first, bak = snapshot(cfg), snapshot(tmp_path / "config.toml.bak")
    res = nv(*args)
    assert res.returncode == 0 and "nothing written" in res.stdout, res.stdout
    assert snapshot(cfg) == first and snapshot(tmp_path / "config.toml.bak") == bak
    res = nv("--runtime", "containerd", "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert cfg.read_bytes() == default_v2


def test_containerd_keeps_comments_and_order(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(COMMENTED)
    assert nv("--runtime", "containerd", "--config", str(cfg), "--set-as-default").returncode == 0
    new = cfg.read_text()
    # the original lines, in order, are all still there (one value changed)
    expected = COMMENTED.replace('default_runtime_name = "runc"', 'default_runtime_name = "nvidia"')
    it = iter(new.splitlines())
    assert all(line in it for line in expected.splitlines()), new
    rt = cri_runtime(tomllib.loads(new))
    assert rt["options"] == {"BinaryName": RUNTIME, "SystemdCgroup": True}
    # the new tables sit with the runtimes, indented like runc's
    assert f'\n    [{V2}.containerd.runtimes.nvidia]\n      runtime_type = "io.containerd.runc.v2"\n' in new
    assert new.index("runtimes.nvidia]") < new.index("# trailing comment")
    assert nv("--runtime", "containerd", "--config", str(cfg), "--remove").returncode == 0
    assert cfg.read_text() == COMMENTED


def test_containerd_remove_refuses_a_foreign_runtime_of_that_name(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    text = COMMENTED + (f'\n[{V2}.containerd.runtimes.nvidia]\n  runtime_type = "io.containerd.runc.v2"\n'
                        f'[{V2}.containerd.runtimes.nvidia.options]\n'
                        '  BinaryName = "/usr/bin/nvidia-container-runtime"\n')
    cfg.write_text(text)
    res = nv("--runtime", "containerd", "--config", str(cfg), "--remove")
    assert res.returncode == 1
    assert "not nvctk's" in res.stderr and "nvidia-container-runtime" in res.stderr, res.stderr
    assert cfg.read_text() == text and not (tmp_path / "config.toml.bak").exists()


def test_containerd_replaces_a_foreign_runtime_and_says_so(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'version = 2\n[{V2}.containerd.runtimes.nvidia.options]\n'
                   '  BinaryName = "/usr/bin/nvidia-container-runtime" # old toolkit\n')
    res = nv("--runtime", "containerd", "--config", str(cfg))
    assert res.returncode == 0, res.stderr
    assert "nvidia-container-runtime" in res.stdout and "now runs" in res.stdout
    rt = cri_runtime(toml(cfg))
    assert rt == {"runtime_type": "io.containerd.runc.v2", "options": {"BinaryName": RUNTIME},
                  "container_annotations": ["cdi.k8s.io/*", "nvctk.io/*"]}
    assert "# old toolkit" in cfg.read_text()


def test_containerd_version1_file_uses_plugin_cri(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[plugins.cri.containerd.runtimes.runc.options]\n  SystemdCgroup = true\n')
    assert nv("--runtime", "containerd", "--config", str(cfg), "--set-as-default").returncode == 0
    doc = toml(cfg)
    assert "version" not in doc
    assert cri_runtime(doc, plugin="cri")["options"] == {"BinaryName": RUNTIME, "SystemdCgroup": True}
    assert doc["plugins"]["cri"]["containerd"]["default_runtime_name"] == "nvidia"


V3_KEYS_DOC = """version = 3
[plugins."io.containerd.cri.v1.runtime".containerd]
  default_runtime_name = "runc"
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
  SystemdCgroup = true
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
"""


def check_v3(doc: dict, default: str) -> None:
    """A v3 config as containerd 2.x documents it (containerd 1.6 here cannot load v3):
    runtimes and default_runtime_name under io.containerd.cri.v1.runtime's
    `containerd` table, enable_cdi on the plugin table, no v2 plugin key."""
    assert doc["version"] == 3
    plugin = doc["plugins"]["io.containerd.cri.v1.runtime"]
    assert "io.containerd.grpc.v1.cri" not in doc["plugins"]
    rt = plugin["containerd"]["runtimes"]["nvidia"]
    assert rt["runtime_type"] == "io.containerd.runc.v2"
    assert rt["options"]["BinaryName"] == RUNTIME
    assert plugin["containerd"]["default_runtime_name"] == default
    assert plugin["enable_cdi"] is True


def test_containerd_version3_file(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(V3_KEYS_DOC)
    assert nv("--runtime", "containerd", "--config", str(cfg), "--set-as-default",
              "--cdi").returncode == 0
    doc = toml(cfg)
    check_v3(doc, "nvidia")
    assert doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["nvidia"][
        "options"]["SystemdCgroup"] is True
    assert doc["plugins"]["io.containerd.cri.v1.images"] == {"snapshotter": "overlayfs"}
    assert nv("--runtime", "containerd", "--config", str(cfg), "--remove").returncode == 0
    assert cfg.read_text() == V3_KEYS_DOC


def test_v3_example_has_the_documented_keys() -> None:
    text = (Path(__file__).parents[2] / "containerd-config.v3.toml.example").read_text()
    doc = tomllib.loads(text.replace("/usr/bin/nvctk-runtime", RUNTIME))
    uncommented = tomllib.loads(
        doc_text := "\n".join(line[2:] if line.startswith("# [") or line.startswith("#   ")
                              else line for line in text.splitlines())
        .replace("/usr/bin/nvctk-runtime", RUNTIME))
    assert doc_text
    check_v3(uncommented, "nvidia")
    assert doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["nvidia"] == {
        "runtime_type": "io.containerd.runc.v2", "options": {"BinaryName": RUNTIME}}


@pytest.fixture
def fake_containerd(tmp_path: Path) -> Callable[[str], dict[str, str]]:
    """PATH with a `containerd` whose --version says `version` (the version detection
    runs the real binary when there is no fake)."""
    def make(version: str) -> dict[str, str]:
        d = tmp_path / f"bin-{version}"
        d.mkdir(exist_ok=True)
        exe = d / "containerd"
        exe.write_text(f"#!/bin/sh\necho 'containerd github.com/containerd/containerd/v2 "
                       f"v{version} 0000'\n")
        exe.chmod(0o755)
        return {**os.environ, "PATH": f"{d}:{os.environ['PATH']}"}
    return make


def test_containerd_missing_file_is_v2_on_containerd_1(nv: Run, tmp_path: Path,
                                                        fake_containerd: Callable) -> None:
    cfg = tmp_path / "sub" / "config.toml"
    res = nv("--runtime", "containerd", "--config", str(cfg), env=fake_containerd("1.7.2"))
    assert res.returncode == 0, res.stderr
    doc = toml(cfg)
    assert doc["version"] == 2 and cri_runtime(doc)["options"] == {"BinaryName": RUNTIME}
    assert "created" in res.stdout
    # remove: the file held nothing else, so it goes (kept as .bak)
    res = nv("--runtime", "containerd", "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert not cfg.exists() and (tmp_path / "sub" / "config.toml.bak").exists()


def test_containerd_empty_file_is_v3_on_containerd_2(nv: Run, tmp_path: Path,
                                                      fake_containerd: Callable) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    res = nv("--runtime", "containerd", "--config", str(cfg), "--set-as-default", "--cdi",
             env=fake_containerd("2.0.4"))
    assert res.returncode == 0, res.stderr
    check_v3(toml(cfg), "nvidia")
    res = nv("--runtime", "containerd", "--config", str(cfg), "--remove", "--set-as-default",
             "--cdi", env=fake_containerd("2.0.4"))
    assert res.returncode == 0, res.stderr
    assert cfg.read_text() == ""


def test_containerd_drop_in_carries_the_cri_table_before_2_1(nv: Run, tmp_path: Path) -> None:
    if not shutil.which("containerd"):
        pytest.skip("containerd not installed")
    cfg = tmp_path / "config.toml"
    cfg.write_text(COMMENTED)
    drop = tmp_path / "conf.d" / "99-nvctk.toml"
    res = nv("--runtime", "containerd", "--config", str(cfg), "--drop-in", str(drop))
    assert res.returncode == 0, res.stderr
    assert "carries a copy" in res.stdout
    main = toml(cfg)
    assert main["imports"] == [f"{tmp_path}/conf.d/*.toml"]
    # the main file changed only by its imports line
    assert cfg.read_text().replace(f'imports = ["{tmp_path}/conf.d/*.toml"]\n', "") == COMMENTED
    di = toml(drop)
    assert di["version"] == 2
    cri = di["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == "registry.k8s.io/pause:3.9"
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is True
    assert cri["containerd"]["runtimes"]["nvidia"]["options"] == {
        "BinaryName": RUNTIME, "SystemdCgroup": True}
    again = (cfg.read_bytes(), drop.read_bytes())
    assert nv("--runtime", "containerd", "--config", str(cfg), "--drop-in", str(drop)).returncode == 0
    assert (cfg.read_bytes(), drop.read_bytes()) == again
    res = nv("--runtime", "containerd", "--config", str(cfg), "--drop-in", str(drop), "--remove")
    assert res.returncode == 0, res.stderr
    assert cfg.read_text() == COMMENTED and not drop.exists()


def test_containerd_drop_in_only_runtime_from_2_1(nv: Run, tmp_path: Path,
                                                  fake_containerd: Callable) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(V3_KEYS_DOC)
    drop = tmp_path / "conf.d" / "nvctk.toml"
    env = fake_containerd("2.1.0")
    res = nv("--runtime", "containerd", "--config", str(cfg), "--drop-in", str(drop), env=env)
    assert res.returncode == 0, res.stderr
    di = toml(drop)
    assert di == {"version": 3, "plugins": {"io.containerd.cri.v1.runtime": {"containerd": {
        "runtimes": {"nvidia": {"runtime_type": "io.containerd.runc.v2",
                                "container_annotations": ["cdi.k8s.io/*", "nvctk.io/*"],
                                "options": {"BinaryName": RUNTIME, "SystemdCgroup": True}}}}}}}


def test_containerd_drop_in_refused_for_version1(nv: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("[plugins.cri]\n  sandbox_image = \"x\"\n")
    res = nv("--runtime", "containerd", "--config", str(cfg), "--drop-in", str(tmp_path / "d.toml"))
    assert res.returncode == 1 and "version 1" in res.stderr
    assert not (tmp_path / "d.toml").exists()


# --- every TOML shape: handled or refused clearly, never a traceback -------


@pytest.mark.parametrize("text,why", [
    ('version = 2\nplugins = {"io.containerd.grpc.v1.cri" = {sandbox_image = "x"}}\n',
     "plugins is an inline table"),
    (f'version = 2\n[{V2}]\ncontainerd = {{default_runtime_name = "runc"}}\n',
     "containerd is an inline table"),
    (f'version = 2\n[{V2}.containerd]\nruntimes = {{runc = {{runtime_type = "io.containerd.runc.v2"}}}}\n',
     "runtimes is an inline table"),
    ('version = 2\n[[plugins]]\nx = 1\n', "plugins is an array of tables"),
    (f'version = 2\n[{V2}.containerd]\n[[{V2}.containerd.runtimes]]\nx = 1\n',
     "runtimes is an array of tables"),
    # one table's parts split by another table: tomlkit cannot place a new one there
    (f'version = 2\n[{V2}.containerd.runtimes.runc]\nruntime_type = "io.containerd.runc.v2"\n'
     f'[metrics]\naddress = ""\n[{V2}.containerd.runtimes.runc.options]\nSystemdCgroup = true\n',
     "cannot edit this layout"),
    # top-level dotted keys: the runtime's new table is fine (checked), but the default
    # would land in that table: refused, not written
    (f'version = 2\n{V2}.containerd.runtimes.runc.runtime_type = "io.containerd.runc.v2"\n',
     "cannot edit this layout safely"),
])
def test_containerd_unusual_toml_shapes_are_refused_clearly(nv: Run, tmp_path: Path, text: str,
                                                            why: str) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    for extra in ([] if "safely" in why else [[]]) + [["--set-as-default", "--cdi"]]:
        res = nv("--runtime", "containerd", "--config", str(cfg), *extra)
        assert res.returncode == 1, res.stdout
        assert why in res.stderr and str(cfg) in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
        assert cfg.read_text() == text and os.listdir(tmp_path) == ["config.toml"]


@pytest.mark.parametrize("text", [
    # dotted keys inside a table, a runtime as an inline table
    f'version = 2\n[{V2}.containerd.runtimes]\nrunc.runtime_type = "io.containerd.runc.v2"\n'
    'runc.options.SystemdCgroup = true\n',
    f'version = 2\n[{V2}.containerd.runtimes]\nrunc = {{runtime_type = "io.containerd.runc.v2", '
    'options = {SystemdCgroup = true}}\n',
])
def test_containerd_other_shapes_are_handled(nv: Run, tmp_path: Path, text: str) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    args = ["--runtime", "containerd", "--config", str(cfg), "--set-as-default", "--cdi"]
    res = nv(*args)
    assert res.returncode == 0, res.stderr
    doc = toml(cfg)
    assert cri_runtime(doc)["options"] == {"BinaryName": RUNTIME, "SystemdCgroup": True}
    assert nv(*args).stdout.count("nothing written") == 1
    cfg.write_text(cfg.read_text() + "# edited\n")  # remove without the .bak's help
    res = nv("--runtime", "containerd", "--config", str(cfg), "--remove")
    assert res.returncode == 0, res.stderr
    assert toml(cfg) == tomllib.loads(text)


def test_containerd_annotations_for_the_node_never_as_pod_annotations(nv: Run, tmp_path: Path) -> None:
    """The device plugin's nvctk.io/ limits travel as container annotations (only the
    kubelet sets those); a Pod's author writes Pod annotations, so no pattern that lets
    nvctk.io/ through is copied into nvctk's runtime, nor kept on an existing entry."""
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'version = 2\n[{V2}.containerd.runtimes.runc]\n'
                   '  runtime_type = "io.containerd.runc.v2"\n'
                   '  pod_annotations = ["nvctk.io/*", "*/*", "example.com/*", "*"]\n'
                   '  container_annotations = ["example.com/x"]\n')
    res = nv("--runtime", "containerd", "--config", str(cfg))
    assert res.returncode == 0 and "no longer passes nvctk's own annotations" in res.stdout
    rt = cri_runtime(toml(cfg))
    # Go's path.Match: * stops at /, so "*" passes no nvctk.io/ key (the edit record's
    # nvctk.io/edits included): kept
    assert rt["pod_annotations"] == ["example.com/*", "*"]
    assert rt["container_annotations"] == ["example.com/x", "cdi.k8s.io/*", "nvctk.io/*"]
    # an existing entry (an older nvctk's, or edited) gets the same
    text = cfg.read_text().replace('container_annotations = ["example.com/x", "cdi.k8s.io/*", '
                                   '"nvctk.io/*"]', 'pod_annotations = ["nvctk.io/*"]', 1)
    text = text.replace('pod_annotations = ["example.com/*", "*"]\n', "", 1)
    cfg.write_text(text)
    res = nv("--runtime", "containerd", "--config", str(cfg))
    assert res.returncode == 0 and "no longer passes nvctk's own annotations" in res.stdout, \
        res.stdout
    rt = cri_runtime(toml(cfg))
    assert rt["pod_annotations"] == [] and "nvctk.io/*" in rt["container_annotations"]


@pytest.mark.parametrize("pattern", ["*/*", "nvctk.*/*", "nvctk.io/*", "nvctk.io/edits",
                                     "nvctk.?o/edit?", "nvctk.io/other", "nvctk.io/vgpu.*"])
@pytest.mark.parametrize("existing", [False, True])
def test_containerd_pod_annotations_never_pass_nvctks_edit_record(
        nv: Run, tmp_path: Path, pattern: str, existing: bool) -> None:
    """runc's pod_annotations = ["*"] copied into nvctk's runtime let any Pod set
    nvctk.io/edits (another container's record, replayed): no pattern that passes one
    of nvctk's own annotations reaches nvctk's runtime, copied from runc or already on
    it, and configure says which it dropped."""
    cfg = tmp_path / "config.toml"
    nvidia = (f'[{V2}.containerd.runtimes.nvidia]\n  runtime_type = "io.containerd.runc.v2"\n'
              f'  pod_annotations = ["example.com/*", "{pattern}"]\n'
              f'  [{V2}.containerd.runtimes.nvidia.options]\n    BinaryName = "{RUNTIME}"\n'
              if existing else "")
    cfg.write_text(f'version = 2\n[{V2}.containerd.runtimes.runc]\n'
                   '  runtime_type = "io.containerd.runc.v2"\n'
                   f'  pod_annotations = ["example.com/*", "{pattern}"]\n' + nvidia)
    res = nv("--runtime", "containerd", "--config", str(cfg))
    assert res.returncode == 0, res.stderr
    assert "no longer passes nvctk's own annotations" in res.stdout and pattern in res.stdout
    assert cri_runtime(toml(cfg))["pod_annotations"] == ["example.com/*"]
    assert toml(cfg)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["runc"][
        "pod_annotations"] == ["example.com/*", pattern]  # runc's own: not nvctk's to judge
