"""The Debian package on a clean Debian 12, and the installer image in containerd.

A root made with debootstrap (packaging/debian-base.sh, cached a week under
/var/cache/nvctk-build) gets the .deb through `apt-get install ./nvctk_*.deb`;
inside it (a mount namespace pivoted into it, so no mount outlives a step):
`nvctk --version`, `nvctk sim init`, `nvctk info`, and a GPU container with a
memory cap run by the installed /usr/bin/nvctk-runtime with the root's own runc
(Debian's, as a host would have it). Then an upgrade and a remove keep
an edited config, and purge + autoremove leave the root as it was before.
A mirror that cannot be reached skips these tests, saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support import wait
from support.daemons import Containerd, containerd
from support.packages import IMAGE, VERSION

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chroot, debootstrap, runc)"),
]

REPO = Path(__file__).resolve().parents[2]
# A step runs in a private mount namespace whose root is the Debian root (pivot_root,
# not chroot: the hook joins the container's mount namespace, and setns() gives it
# that namespace's root, which a chroot would not change), with /proc, /sys
# (cgroups) and /dev; every mount ends with the step.
ENTER = """
root=$1; shift
mount --bind "$root" "$root"
mount -t proc proc "$root/proc"
mount --rbind /sys "$root/sys"
mount --rbind /dev "$root/dev"
mkdir -p "$root/.oldroot"
cd "$root"
pivot_root . .oldroot
exec /usr/sbin/chroot . /bin/sh -ec 'umount -l /.oldroot; rmdir /.oldroot
  exec env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive HOME=/root "$@"' \
  step "$@"
"""
# what a package leaves in apt's and dpkg's own books, logs, and this test's own dirs
NOT_COMPARED = ("proc", "sys", "dev", "tmp", "sim", "bundle", "var/lib/dpkg", "var/lib/apt",
                "var/cache", "var/log/apt", "var/log/dpkg.log", "var/log/alternatives.log",
                "run/runc", "etc/ld.so.cache")


def _run(argv: list[str], timeout: float = 300,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def in_root(root: Path, script: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`sh -ec script` with root as its /."""
    return _run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-ec", ENTER,
                 "in_root", str(root), "sh", "-ec", script], timeout=timeout)


def ok(root: Path, script: str, timeout: float = 300) -> str:
    r = in_root(root, script, timeout)
    assert r.returncode == 0, f"{script}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    return r.stdout


def _tree(root: Path) -> set[str]:
    """Every path under root, relative, but those NOT_COMPARED."""
    out: set[str] = set()
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        rel = "" if rel == "." else rel + "/"
        dirs[:] = [n for n in dirs if rel + n not in NOT_COMPARED]
        out.update(rel + n for n in dirs + files if rel + n not in NOT_COMPARED)
    return out


@pytest.fixture(scope="module")
def deb(built_deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package built from this tree (once per run: support/packages.py), copied to a dir
    of this module's (the image is built beside it)."""
    return Path(shutil.copy(built_deb, tmp_path_factory.mktemp("deb")))


def _base(variant: str) -> Path:
    for tool in ("debootstrap", "unshare", "chroot"):
        if not shutil.which(tool):
            pytest.skip(f"needs {tool} (make apt)")
    r = _run(["bash", str(REPO / "packaging" / "debian-base.sh"), variant], timeout=900)
    if r.returncode == 3:
        pytest.skip(f"no Debian mirror: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip())


@pytest.fixture
def debian_root(tmp_path: Path) -> Iterator[Path]:
    """A fresh root from the cached test base (gcc, libc6-dev, busybox-static installed)."""
    base = _base("test")
    root = tmp_path / "root"
    root.mkdir()
    assert _run(["tar", "-C", str(root), "--numeric-owner", "-xpf", str(base)]).returncode == 0
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_deb_lintian_clean(deb: Path) -> None:
    """No error or warning but the overrides, each with its reason, in the package."""
    if not shutil.which("lintian"):
        pytest.skip("needs lintian (make apt)")
    r = _run(["lintian", "--fail-on", "error,warning", "--tag-display-limit", "0", str(deb)])
    tags = [line for line in r.stdout.splitlines() if line[:2] in ("E:", "W:")]
    assert r.returncode == 0 and not tags, r.stdout + r.stderr


def test_deb_maintainer_scripts_never_configure_an_engine(deb: Path, tmp_path: Path) -> None:
    assert _run(["dpkg-deb", "-e", str(deb), str(tmp_path / "c")]).returncode == 0
    postinst = (tmp_path / "c" / "postinst").read_text()
    assert "nvctk configure --runtime containerd" in postinst
    for script in ("postinst", "prerm", "postrm"):
        text = (tmp_path / "c" / script).read_text()
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        for engine_file in ("/etc/containerd", "/etc/docker", "/etc/crio", "systemctl"):
            # the message names them; no command touches them
            touching = [ln for ln in code.splitlines() if engine_file in ln
                        and not ln.startswith(("  nvctk configure", "(--set"))]
            assert not touching, (script, touching)


def _upgraded(deb: Path, tmp: Path) -> Path:
    """The same package as version VERSION+1 (for an upgrade over an edited config)."""
    tree = tmp / "tree"
    assert _run(["dpkg-deb", "-R", str(deb), str(tree)]).returncode == 0
    control = tree / "DEBIAN" / "control"
    control.write_text(control.read_text().replace(f"Version: {VERSION}\n",
                                                   f"Version: {VERSION}+1\n"))
    new = tmp / f"nvctk_{VERSION}+1.deb"
    # uncompressed: what is checked is the upgrade, not the package's compression (which
    # lintian checks in the built one); xz took ~17 s of the run
    assert _run(["dpkg-deb", "--root-owner-group", "-Znone", "-b", str(tree), str(new)]).returncode == 0
    return new


# the bundle test_deb_in_a_clean_debian runs: a GPU container with a memory cap
_CAPPED_BUNDLE = """
python3 -I -S -c "import sys; sys.path.append('/usr/lib/nvctk/python')
from nvctk.sim.rootfs import build_rootfs; build_rootfs('/bundle/rootfs')"
cd /bundle && runc spec
python3 - <<'PY'
import json
spec = json.load(open('/bundle/config.json'))
spec['process']['terminal'] = False
spec['process']['args'] = ['sh', '-c', 'nvidia-smi -L; cat /etc/ld.so.preload']
spec['process']['env'] += ['NVIDIA_VISIBLE_DEVICES=1', 'CUDA_DEVICE_MEMORY_LIMIT=1g']
json.dump(spec, open('/bundle/config.json', 'w'))
PY
"""


def test_deb_in_a_clean_debian(deb: Path, debian_root: Path, tmp_path: Path) -> None:
    root = debian_root
    before = _tree(root)
    shutil.copy(deb, root / "tmp" / deb.name)
    out = ok(root, f"apt-get install -y --no-install-recommends /tmp/{deb.name}")
    # postinst says how to wire an engine, and does not do it
    assert "nvctk configure --runtime containerd" in out
    assert not (root / "etc/containerd").exists() and not (root / "etc/docker").exists()
    assert (root / "usr/lib/nvctk/libvgpu.so").is_file()
    assert 'vgpu-library = "/usr/lib/nvctk/libvgpu.so"' in (root / "etc/nvctk/config.toml").read_text()
    # bytecode from postinst: the first container start does not compile nvctk
    assert list((root / "usr/lib/nvctk/python/nvctk/runtime/__pycache__").glob("create.cpython-*.pyc"))

    assert ok(root, "nvctk --version").strip() == f"nvctk {VERSION}"
    ok(root, "nvctk sim init /sim --gpus 2")
    info = json.loads(ok(root, "NVCTK_CONFIG=/sim/config.toml nvctk info --json"))
    assert len(info["gpus"]) == 2, info

    # a GPU container with a memory cap: the installed runtime, hook and libvgpu
    ok(root, _CAPPED_BUNDLE)
    r = in_root(root, "NVCTK_CONFIG=/sim/config.toml /usr/bin/nvctk-runtime run --bundle /bundle "
                      "deb-test 2>&1; echo rc=$?")
    assert r.stdout.rstrip().endswith("rc=0"), r.stdout + r.stderr
    assert "GPU 0: NVIDIA H100 80GB HBM3" in r.stdout, r.stdout  # one GPU, as index 0
    assert "libvgpu.so" in r.stdout, r.stdout
    spec = json.loads((root / "bundle/config.json").read_text())
    assert [h["path"] for h in spec["hooks"]["prestart"]] == ["/usr/bin/nvctk-hook"]
    # a passthrough (no Python) leaves the runtime's cache; remove takes it
    ok(root, "/usr/bin/nvctk-runtime list >/dev/null")
    assert list((root / "run/nvctk/passthrough").iterdir())

    # an edited conffile survives an upgrade and a remove; purge takes it
    conf = root / "etc/nvctk/config.toml"
    conf.write_text(conf.read_text() + "log-level = \"debug\"\n")
    new = _upgraded(deb, tmp_path)
    shutil.copy(new, root / "tmp" / new.name)
    ok(root, f"apt-get install -y --no-install-recommends /tmp/{new.name}")
    assert ok(root, "nvctk --version").strip() == f"nvctk {VERSION}"
    assert 'log-level = "debug"' in conf.read_text()
    ok(root, "apt-get remove -y nvctk")
    assert 'log-level = "debug"' in conf.read_text()
    for gone in ("usr/bin/nvctk", "usr/bin/nvctk-runtime", "usr/bin/nvctk-hook", "usr/lib/nvctk",
                 "run/nvctk"):
        assert not (root / gone).exists(), gone
    ok(root, "apt-get purge -y nvctk && apt-get autoremove --purge -y")
    (root / "tmp" / deb.name).unlink()
    (root / "tmp" / new.name).unlink()
    left = _tree(root) - before
    assert left == set(), sorted(left)


# --- the installer image --------------------------------------------------------------


@pytest.fixture(scope="module")
def image(built_image: Path) -> Path:
    return built_image


def test_image_is_an_oci_archive(image: Path) -> None:
    with tarfile.open(image) as t:
        layout = json.load(t.extractfile("oci-layout"))  # type: ignore[arg-type]
        index = json.load(t.extractfile("index.json"))  # type: ignore[arg-type]
    assert layout["imageLayoutVersion"] == "1.0.0"
    (manifest,) = index["manifests"]
    assert manifest["annotations"]["org.opencontainers.image.ref.name"] == IMAGE


def _installer(ctd: Containerd, name: str, host: Path, *args: str
               ) -> subprocess.CompletedProcess[str]:
    """The image's installer run once by containerd against the scratch host dir."""
    return ctd.ctr("run", "--rm", "--mount", f"type=bind,src={host},dst=/host,options=rbind:rw",
                   name, "nvctk-installer-test", *args, timeout=300)


def _assert_unwired(config: Path) -> None:
    """The host's containerd config names nvctk no more and keeps its own comment."""
    cfg = config.read_text()
    assert "nvctk" not in cfg and "# the host's own comment" in cfg, cfg


def test_image_installs_onto_a_host_through_containerd(image: Path, tmp_path: Path) -> None:
    """Import into a real containerd, run the installer against a scratch host dir:
    nvctk lands under its prefix and the host's containerd config names it."""
    if not shutil.which("ctr"):
        pytest.skip("needs containerd")
    host = tmp_path / "host"
    (host / "etc/containerd").mkdir(parents=True)
    (host / "etc/containerd/config.toml").write_text("version = 2\n# the host's own comment\n")
    name = IMAGE
    with containerd(tmp_path / "ctd") as ctd:
        r = ctd.ctr("images", "import", str(image), timeout=300)
        assert r.returncode == 0, r.stderr
        assert name in ctd.ctr("images", "ls", "-q").stdout.split()
        r = _installer(ctd, name, host)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"installed nvctk {VERSION} in /usr/local/nvctk" in r.stdout, r.stdout
        prefix = host / "usr/local/nvctk"
        installed = (host / "etc/containerd/config.toml").read_text()
        _check_installed(prefix, installed, tmp_path)
        assert (prefix / ".nvctk-installer").is_file()
        # a Kubernetes node's config: a container's env selects no GPU (issue 39)
        node_cfg = (host / "etc/nvctk/config.toml").read_text()
        assert "accept-envvar-when-unprivileged = false" in node_cfg.splitlines(), node_cfg
        assert "accept-volume-mount-devices = true" in node_cfg.splitlines(), node_cfg
        # a prefix it did not make (the host's /usr/local) is refused, in the image too
        (host / "usr/local/bin").mkdir(exist_ok=True)
        (host / "usr/local/bin/site-tool").write_text("kept\n")
        r = _installer(ctd, name, host, "/usr/lib/nvctk/install.sh", "--prefix", "/usr/local",
                       "--uninstall")
        assert r.returncode == 2 and "not made by nvctk-installer" in r.stderr, r.stdout + r.stderr
        assert (host / "usr/local/bin/site-tool").read_text() == "kept\n"
        # --uninstall (what --wait does on SIGTERM) takes back the runtime and the files
        r = _installer(ctd, name, host, "/usr/lib/nvctk/install.sh", "--uninstall")
        assert r.returncode == 0, r.stdout + r.stderr
        assert not prefix.exists() and not (host / "etc/nvctk/config.toml").exists()
        _assert_unwired(host / "etc/containerd/config.toml")

        # --wait: a DaemonSet's container; installed while it runs, undone on SIGTERM
        config = host / "etc/containerd/config.toml"

        def wired_in() -> bool:
            return "nvctk-runtime" in config.read_text() and (prefix / "bin/nvctk").is_file()

        _wait_then_sigterm(ctd, name, host, tmp_path, "nvctk-installer-wait", wired_in)
        assert not prefix.exists()
        _assert_unwired(config)

        # SIGTERM while it is still copying (a Pod deleted as it starts): the shell is
        # the container's PID 1, so a signal it has no trap for yet would be dropped
        parent = prefix.parent

        def copying() -> bool:
            return parent.is_dir() and any(p.name.startswith("nvctk.new.")
                                           for p in parent.iterdir())

        _wait_then_sigterm(ctd, name, host, tmp_path, "nvctk-installer-early", copying,
                           poll=0.005)
        assert sorted(p.name for p in parent.iterdir()) == ["bin"]  # the host's own
        _assert_unwired(config)


def _wait_then_sigterm(ctd: Containerd, image: str, host: Path, tmp_path: Path, cid: str,
                       ready: Callable[[], bool], poll: float = 0.05) -> None:
    """`install.sh --wait` in a detached container, SIGTERMed once ready() holds; returns
    when it has stopped (its output, kept in a file, is the failure message)."""
    log = tmp_path / f"{cid}.log"
    r = ctd.ctr("run", "-d", "--log-uri", f"file://{log}", "--mount",
                f"type=bind,src={host},dst=/host,options=rbind:rw",
                image, cid, "/usr/lib/nvctk/install.sh", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    assert _until(ready, poll=poll), _read(log)
    assert ctd.ctr("task", "kill", "-s", "SIGTERM", cid).returncode == 0
    assert _until(lambda: "STOPPED" in ctd.ctr("task", "ls").stdout), _read(log)
    ctd.ctr("task", "delete", cid)
    ctd.ctr("containers", "delete", cid)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"{path}: none"


def _until(predicate: Callable[[], bool], timeout: float = 30, poll: float = 0.05) -> bool:
    try:
        return bool(wait.until(predicate, timeout, "the condition", poll=poll))
    except AssertionError:
        return False


def _check_installed(prefix: Path, cfg: str, tmp_path: Path) -> None:
    for exe in ("nvctk", "nvctk-runtime", "nvctk-hook", "python3"):
        assert (prefix / "bin" / exe).read_bytes()[:4] == b"\x7fELF", exe
    assert (prefix / "lib/nvctk/libvgpu.so").is_file()
    assert (prefix / "lib/nvctk/python/nvctk/lib/libvgpu.so").resolve() == \
        (prefix / "lib/nvctk/libvgpu.so").resolve()
    assert "# the host's own comment" in cfg
    assert 'BinaryName = "/usr/local/nvctk/bin/nvctk-runtime"' in cfg, cfg
    # the copied tree runs on this host with its own interpreter
    env = {"PATH": "/usr/bin:/bin", "NVCTK_CONFIG": str(tmp_path / "none.toml")}
    r = _run([str(prefix / "bin/nvctk"), "config", "default"], env=env)
    assert r.returncode == 0 and "runtimes = " in r.stdout, r.stderr


# --- the installer owns only what it made -------------------------------------
# install.sh run directly against a scratch host dir (--host): each refusal comes before
# anything is read or written, so a wrong answer could only touch that scratch dir.


def _host_tree(host: Path) -> dict[str, bytes]:
    return {str(p.relative_to(host)): (p.read_bytes() if p.is_file() else b"")
            for p in sorted(host.rglob("*"))}


@pytest.mark.parametrize("prefix,args,why", [
    ("/", [], "is the host's root"),
    ("/usr/local", [], "exists and was not made by nvctk-installer"),
    ("/usr/local", ["--uninstall"], "exists and was not made by nvctk-installer"),
    ("/usr", ["--uninstall"], "exists and was not made by nvctk-installer"),
    ("/usr/local/", [], "must be a plain path"),
    ("/usr/local/nvctk/..", ["--uninstall"], "must be a plain path"),
    ("//usr/local", [], "must be a plain path"),
    ("/usr/./local", [], "must be a plain path"),
    ("usr/local/nvctk", [], "must be absolute"),
    ("/srv/link", [], "is a symbolic link on the host"),
    ("/srv/file", ["--uninstall"], "exists and was not made by nvctk-installer"),
    ("/srv/fake", ["--uninstall"], "exists and was not made by nvctk-installer"),
])
def test_installer_refuses_prefixes_it_did_not_make(tmp_path: Path, prefix: str, args: list[str],
                                                   why: str) -> None:
    host = tmp_path / "host"
    for d in ("usr/local/bin", "usr/bin", "etc/containerd", "srv"):
        (host / d).mkdir(parents=True)
    (host / "usr/local/bin/site-tool").write_text("#!/bin/sh\n")
    (host / "usr/bin/ls").write_text("binary\n")
    (host / "etc/containerd/config.toml").write_text("version = 2\n")
    (host / "srv/file").write_text("data\n")
    (host / "srv/link").symlink_to("/usr/local")
    # a mark that is a link is no mark
    (host / "srv/fake").mkdir()
    (host / "srv/fake/.nvctk-installer").symlink_to("/etc/hostname")
    before = _host_tree(host)
    r = _run(["sh", str(REPO / "packaging/image/install.sh"), "--host", str(host),
              "--prefix", prefix, *args])
    assert r.returncode == 2, r.stdout + r.stderr
    assert why in r.stderr and "nothing changed" in r.stderr, r.stderr
    assert _host_tree(host) == before


@pytest.mark.parametrize("setup,args,code,why", [
    # an older image over what a newer one installed (a rollout gone backwards)
    ("newer", [], 2, "holds nvctk 99.0, installed by a newer image"),
    # a node without the driver (or the wrong root): which root, what to do
    ("", ["--driver-root", "/run/nvidia/driver"], 1,
     "driver root {host}/run/nvidia/driver (the host's /run/nvidia/driver): no such directory"),
    ("empty-driver", ["--driver-root", "/run/nvidia/driver"], 1,
     "no NVIDIA driver found at driver root {host}/run/nvidia/driver"),
    # the host's own nvctk config is never overwritten
    ("own-config", ["--driver-root", "/drv"], 2, "exists and is not the installer's"),
    ("", ["--restart-mode", "reload"], 2, "--restart-mode reload: one of signal, systemd, none"),
])
def test_installer_refuses_before_it_installs(tmp_path: Path, setup: str, args: list[str],
                                              code: int, why: str) -> None:
    """Each refusal comes before anything is copied or configured: the host is as it was."""
    host = tmp_path / "host"
    (host / "etc/containerd").mkdir(parents=True)
    (host / "etc/containerd/config.toml").write_text("version = 2\n")
    if setup == "newer":
        (host / "usr/local/nvctk").mkdir(parents=True)
        (host / "usr/local/nvctk/.nvctk-installer").write_text("made by nvctk-installer\n"
                                                               "version 99.0\n")
    elif setup == "empty-driver":
        (host / "run/nvidia/driver").mkdir(parents=True)
    elif setup == "own-config":
        from nvctk.sim import host as simhost
        from nvctk.sim.topology import make_topology

        if os.geteuid() != 0:
            pytest.skip("needs root (the simulated driver has device nodes)")
        simhost.init(str(host / "drv"), make_topology(gpus=1))
        (host / "etc/nvctk").mkdir(parents=True)
        (host / "etc/nvctk/config.toml").write_text('log-level = "debug"\n')
    before = _host_tree(host)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + ":" + os.environ["PATH"]}
    r = _run(["sh", str(REPO / "packaging/image/install.sh"), "--host", str(host), *args],
             env=env)
    assert r.returncode == code, r.stdout + r.stderr
    assert why.format(host=host) in r.stderr, r.stderr
    # (the simulated GPUs' own state, made when NVML was read, is hardware, not the host's)
    after = {k: v for k, v in _host_tree(host).items() if not k.startswith("drv/run/nvidia-sim")}
    assert after == {k: v for k, v in before.items() if not k.startswith("drv/run/nvidia-sim")}


def test_image_configures_a_containerd_2_3_host(image: Path, tmp_path: Path) -> None:
    """A host running containerd 2.3: its config is 2.3.4's own `config default`
    (version 4). The installer wires nvctk in the same way, 2.3.4 loads the result
    with the runtime, and --uninstall gives back the file byte for byte."""
    from support.daemons import CONTAINERD_2_TAR, peer_env, unpack_peer

    if not shutil.which("ctr"):
        pytest.skip("needs containerd")
    bin2 = unpack_peer(CONTAINERD_2_TAR, tmp_path / "bin2")
    if bin2 is None:
        pytest.skip(f"{CONTAINERD_2_TAR} is absent (../shared/peers/containerd)")
    default = subprocess.run([str(bin2 / "containerd"), "config", "default"], capture_output=True,
                             text=True, check=True).stdout
    host = tmp_path / "host"
    (host / "etc/containerd").mkdir(parents=True)
    config = host / "etc/containerd/config.toml"
    config.write_text(default)
    name = IMAGE
    mount = f"type=bind,src={host},dst=/host,options=rbind:rw"
    with containerd(tmp_path / "ctd") as ctd:
        r = ctd.ctr("images", "import", str(image), timeout=300)
        assert r.returncode == 0, r.stderr
        # (through sh: ctr would take a bare "--" for itself)
        r = ctd.ctr("run", "--rm", "--mount", mount, name, "nvctk-installer-v4", "sh", "-c",
                    "exec /usr/lib/nvctk/install.sh -- --set-as-default", timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        dump = subprocess.run([str(bin2 / "containerd"), "--config", str(config), "config", "dump"],
                              capture_output=True, text=True, timeout=60, env=peer_env(bin2))
        assert dump.returncode == 0, dump.stderr
        import tomllib

        cri = tomllib.loads(dump.stdout)["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]
        assert cri["default_runtime_name"] == "nvidia"
        rt = cri["runtimes"]["nvidia"]
        assert rt["options"]["BinaryName"] == "/usr/local/nvctk/bin/nvctk-runtime"
        assert {"cdi.k8s.io/*", "nvctk.io/*"} <= set(rt["container_annotations"])
        r = ctd.ctr("run", "--rm", "--mount", mount, name, "nvctk-installer-v4u",
                    "/usr/lib/nvctk/install.sh", "--uninstall", timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
    assert config.read_text() == default
    assert not (host / "usr/local/nvctk").exists()
