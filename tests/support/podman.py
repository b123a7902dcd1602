"""podman with private storage and config, for the CDI e2e test and the bench."""

from __future__ import annotations

import os
from pathlib import Path

# root in this VM lacks CAP_SYS_RESOURCE: podman's default RLIMIT_NOFILE/NPROC raise
# would fail, so no default ulimits; cgroupfs, as there may be no systemd
CONTAINERS_CONF = """\
[containers]
default_ulimits = []
[engine]
cgroup_manager = "cgroupfs"
events_logger = "none"
runtime = "runc"
[network]
network_config_dir = "{net}"
"""
STORAGE_CONF = """\
[storage]
driver = "vfs"
graphroot = "{root}"
runroot = "{runroot}"
"""


def private_podman(exe: str, work: Path) -> tuple[dict[str, Path], dict[str, str], list[str]]:
    """(dirs, env, argv prefix) of a podman whose storage and config live under work
    (a short path: podman refuses a runroot longer than 50 characters); dirs has root,
    runroot, tmp, net and varlib (a /var/lib of its own for image imports)."""
    dirs = {k: work / k for k in ("root", "runroot", "tmp", "net", "varlib")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    (work / "containers.conf").write_text(CONTAINERS_CONF.format(net=dirs["net"]))
    (work / "storage.conf").write_text(STORAGE_CONF.format(root=dirs["root"],
                                                           runroot=dirs["runroot"]))
    (work / "registries.conf").write_text("")
    env = {**os.environ, "CONTAINERS_CONF": str(work / "containers.conf"),
           "CONTAINERS_STORAGE_CONF": str(work / "storage.conf"),
           "CONTAINERS_REGISTRIES_CONF": str(work / "registries.conf")}
    # the flags repeat storage.conf: a podman reading another file still stays here
    base = [exe, "--root", str(dirs["root"]), "--runroot", str(dirs["runroot"]),
            "--tmpdir", str(dirs["tmp"]), "--storage-driver", "vfs",
            "--cgroup-manager", "cgroupfs", "--events-backend", "none", "--runtime", "runc"]
    return dirs, env, base
