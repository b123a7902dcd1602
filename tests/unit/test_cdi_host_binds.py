"""CDI mode's check of the container's host binds (nvctk.cdi.check.check_host_binds) on a
kubelet's spec: the mount on top at a target decides, and each path of the rootfs is
looked up once, whatever the number of binds and targets (the end-to-end refusals are
tests/integration/test_cdi_mode_host_dirs.py's)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest

from nvctk.base import inroot
from nvctk.cdi.check import CdiError, check_host_binds

LIB = "/usr/lib/x86_64-linux-gnu"
# what `runc spec` writes
RUNC_MOUNTS: list[dict[str, Any]] = [
    {"destination": "/proc", "type": "proc", "source": "proc"},
    {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid"]},
    {"destination": "/dev/pts", "type": "devpts", "source": "devpts"},
    {"destination": "/dev/shm", "type": "tmpfs", "source": "shm"},
    {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue"},
    {"destination": "/sys", "type": "sysfs", "source": "sysfs"},
    {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup"},
]


def _bind(source: Path, at: str) -> dict[str, Any]:
    return {"destination": at, "type": "bind", "source": str(source),
            "options": ["rbind", "rprivate", "rw"]}


def _kubelet_binds(host: Path) -> list[dict[str, Any]]:
    """The binds every container a kubelet starts carries (files, and the service
    account's directory)."""
    out = []
    for name, at in (("hosts", "/etc/hosts"), ("resolv.conf", "/etc/resolv.conf"),
                     ("hostname", "/etc/hostname"), ("termination-log", "/dev/termination-log")):
        (host / name).write_text("")
        out.append(_bind(host / name, at))
    (host / "sa").mkdir()
    out.append(_bind(host / "sa", "/var/run/secrets/kubernetes.io/serviceaccount"))
    return out


def _edits(libs: int = 40) -> list[tuple[str, dict[str, Any]]]:
    """A GPU's edits as a spec of NVIDIA's has them: libraries, binaries, nodes, links."""
    mounts = [{"hostPath": f"/h{LIB}/lib{i}.so.1", "containerPath": f"{LIB}/lib{i}.so.1",
               "options": ["ro", "nosuid", "nodev", "rbind"]} for i in range(libs)]
    mounts += [{"hostPath": "/h/usr/bin/nvidia-smi", "containerPath": "/usr/bin/nvidia-smi",
                "options": ["ro", "nosuid", "nodev", "rbind"]}]
    nodes = [{"path": p} for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm",
                                   "/dev/dri/card0")]
    hooks = [{"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
              "args": ["nvidia-cdi-hook", "create-symlinks",
                       "--link", f"lib0.so.1::{LIB}/lib0.so", "--link", "x::/usr/lib/x.so"]}]
    return [("spec: device 0", {"mounts": mounts, "deviceNodes": nodes, "hooks": hooks})]


def _rootfs(tmp_path: Path, merged_usr: bool = False) -> Path:
    root = tmp_path / "rootfs"
    for d in ("usr/lib/x86_64-linux-gnu", "usr/bin", "etc", "dev", "var/run"):
        (root / d).mkdir(parents=True, exist_ok=True)
    if merged_usr:
        (root / "lib").symlink_to("usr/lib")
    return root


def _spec(root: Path, binds: list[dict[str, Any]]) -> dict[str, Any]:
    return {"root": {"path": str(root)}, "mounts": [*RUNC_MOUNTS, *binds]}


@pytest.fixture
def host(tmp_path: Path) -> Path:
    d = tmp_path / "host"
    d.mkdir()
    return d


def test_kubelets_binds_refuse_nothing_and_look_each_path_up_once(
        tmp_path: Path, host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: each target was resolved again for every mount of the spec (713 rootfs
    walks for one bind: 6 ms of a create)."""
    looked: collections.Counter[str] = collections.Counter()
    real = inroot._link_target

    def counted(path: str) -> str | None:
        looked[path] += 1
        return real(path)

    monkeypatch.setattr(inroot, "_link_target", counted)
    root = _rootfs(tmp_path)
    check_host_binds(_spec(root, _kubelet_binds(host)), _edits())
    assert looked, "the service account's directory is a host directory: the targets are resolved"
    assert max(looked.values()) == 1, looked.most_common(3)


def test_binds_of_files_only_resolve_nothing(tmp_path: Path, host: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """No host directory on top anywhere: nothing can be created on the host."""
    looked: list[str] = []
    real = inroot._link_target
    monkeypatch.setattr(inroot, "_link_target", lambda p: looked.append(p) or real(p))
    binds = [b for b in _kubelet_binds(host) if not b["destination"].endswith("serviceaccount")]
    check_host_binds(_spec(_rootfs(tmp_path), binds), _edits())
    assert len(looked) <= sum(len(m["destination"].split("/")) for m in RUNC_MOUNTS + binds)


@pytest.mark.parametrize("last", ["/usr", LIB])
def test_the_mount_on_top_decides(tmp_path: Path, last: str) -> None:
    """Two host directories, one bound above the other: the later one is on top at the
    libraries, and the error names it."""
    root = _rootfs(tmp_path)
    dirs = {at: tmp_path / at.strip("/").replace("/", "_") for at in ("/usr", LIB)}
    for d in dirs.values():
        d.mkdir()
    first = next(at for at in dirs if at != last)
    spec = _spec(root, [_bind(dirs[first], first), _bind(dirs[last], last)])
    with pytest.raises(CdiError, match=f"lies on the host directory {dirs[last]} "):
        check_host_binds(spec, _edits())


def test_a_bind_reached_through_a_link_of_the_image(tmp_path: Path, host: Path) -> None:
    root = _rootfs(tmp_path, merged_usr=True)
    spec = _spec(root, [*_kubelet_binds(host), _bind(host, "/lib/x86_64-linux-gnu")])
    with pytest.raises(CdiError, match=f"mount {LIB}/lib0.so.1 lies on the host directory {host} "
                                       r"that the spec's mounts\[12\] binds at /lib/x86_64"):
        check_host_binds(spec, _edits())


def test_a_later_mount_over_the_bind_hides_it(tmp_path: Path, host: Path) -> None:
    root = _rootfs(tmp_path)
    spec = _spec(root, [_bind(host, LIB), {"destination": "/usr", "type": "tmpfs",
                                           "source": "tmpfs"}])
    check_host_binds(spec, _edits())
    assert list(host.iterdir()) == []


def test_what_is_there_already_is_no_refusal(tmp_path: Path, host: Path) -> None:
    """Every target and link already in the host's directory: nothing to create."""
    root = _rootfs(tmp_path)
    for i in range(40):
        (host / f"lib{i}.so.1").write_text("")
    spec = _spec(root, [_bind(host, LIB)])
    with pytest.raises(CdiError, match=f"link {LIB}/lib0.so lies on"):
        check_host_binds(spec, _edits())
    (host / "lib0.so").write_text("")
    check_host_binds(spec, _edits())

