"""nvctk.hook.mount: resolution inside a rootfs, fd-based mounts, masks, undo.

Mounting tests run in a forked child with its own private mount namespace;
the test process's mount table is compared before and after.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from nvctk.base import mounts
from nvctk.edits import Mount
from nvctk.hook import mount as m
from nvctk.hook.worker import ldconfig_first
from nvctk.oci.rootfs import exists_in_rootfs
from support.fs import snapshot
from support.procs import in_private_ns

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount namespaces)")


@pytest.fixture
def canary(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "canary"
    (d / "dir").mkdir(parents=True)
    (d / "file").write_text("canary\n")
    (d / "dir" / "ld.so.preload").write_text("canary\n")
    before = snapshot(d)
    yield d
    assert snapshot(d) == before


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    r = tmp_path / "rootfs"
    for d in ("etc", "usr/lib", "tmp", "proc"):
        (r / d).mkdir(parents=True)
    return r


@pytest.fixture
def host_table() -> Iterator[None]:
    with open("/proc/self/mountinfo") as f:
        before = f.read()
    yield
    with open("/proc/self/mountinfo") as f:
        assert f.read() == before


def real(fd: int) -> str:
    try:
        return mounts.fd_path(fd)
    finally:
        os.close(fd)


# --- resolution -------------------------------------------------------------------
@pytest.mark.parametrize(
    "link",
    [
        "{canary}/dir",  # absolute, aimed at the host
        "../../../../../../../../{canary}/dir",  # relative, climbing out
        "/../../{canary}/../canary/dir",  # absolute with dots
    ],
)
def test_symlinked_dir_resolves_inside(rootfs: Path, canary: Path, link: str) -> None:
    (rootfs / "etc").rmdir()
    os.symlink(link.format(canary=str(canary).lstrip("/")).replace("//", "/"), rootfs / "etc")
    # the same path exists inside the rootfs: resolution must land there
    inside = rootfs / str(canary).lstrip("/") / "dir"
    inside.mkdir(parents=True)
    with m.Root(str(rootfs)) as root:
        fd = root.ensure("/etc/ld.so.preload", "file")
        assert real(fd) == str(inside / "ld.so.preload")
        assert real(root.mkdirs("/etc/sub/deeper")) == str(inside / "sub/deeper")
        assert root.symlink("/etc/libcuda.so", "libcuda.so.1")
    assert os.readlink(inside / "libcuda.so") == "libcuda.so.1"


@pytest.mark.parametrize("link", ["{canary}/dir", "../../../../../{canary}/file"])
def test_dangling_link_out_of_the_rootfs_is_refused(rootfs: Path, canary: Path,
                                                    link: str) -> None:
    os.symlink(link.format(canary=canary), rootfs / "usr/lib/x86_64-linux-gnu")
    with m.Root(str(rootfs)) as root, pytest.raises(OSError) as e:
        root.ensure("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "file")
    assert e.value.errno in (errno.ENOENT, errno.ENOTDIR)


def test_link_chain_stays_inside(rootfs: Path, canary: Path) -> None:
    os.symlink("b", rootfs / "a")
    os.symlink("../../../c", rootfs / "b")
    os.symlink(str(canary), rootfs / "c")  # absolute: inside the root, it is rootfs/<canary>
    (rootfs / str(canary).lstrip("/")).mkdir(parents=True)
    with m.Root(str(rootfs)) as root:
        assert real(root.ensure("/a/file", "file")) == str(rootfs / str(canary).lstrip("/") / "file")


def test_final_dangling_symlink_is_replaced_inside(rootfs: Path, canary: Path) -> None:
    os.symlink(str(canary / "file"), rootfs / "etc/ld.so.preload")
    with m.Root(str(rootfs)) as root:
        assert real(root.ensure("/etc/ld.so.preload", "file")) == str(rootfs / "etc/ld.so.preload")
    assert (rootfs / "etc/ld.so.preload").is_file()
    assert not (rootfs / "etc/ld.so.preload").is_symlink()


def test_symlink_replaces_links_not_files(rootfs: Path, canary: Path) -> None:
    os.symlink(str(canary / "file"), rootfs / "usr/lib/libcuda.so")
    (rootfs / "usr/lib/libfoo.so").write_text("image's own\n")
    with m.Root(str(rootfs)) as root:
        assert root.symlink("/usr/lib/libcuda.so", "libcuda.so.1")
        assert not root.symlink("/usr/lib/libfoo.so", "libfoo.so.1")
    assert os.readlink(rootfs / "usr/lib/libcuda.so") == "libcuda.so.1"
    assert (rootfs / "usr/lib/libfoo.so").read_text() == "image's own\n"


def test_kind_mismatch_is_an_error(rootfs: Path) -> None:
    (rootfs / "usr/lib/libcuda.so.1").mkdir()
    with m.Root(str(rootfs)) as root, pytest.raises(OSError) as e:
        root.ensure("/usr/lib/libcuda.so.1", "file")
    assert e.value.errno == errno.EISDIR


@pytest.mark.exclusive  # compares the host's whole mount table
def test_magic_links_refused(rootfs: Path, canary: Path, host_table: None) -> None:
    os.symlink(f"/proc/self/root{canary}/dir", rootfs / "usr/lib/x86_64-linux-gnu")
    os.symlink("/proc/1/root/", rootfs / "etc/escape")

    def body() -> None:
        mounts.mount_propagation("/", mounts.MS_REC | mounts.MS_PRIVATE)
        os.system(f"mount -t proc proc {rootfs}/proc")
        with m.Root(str(rootfs)) as root:
            for p, errs in (("/usr/lib/x86_64-linux-gnu/ld.so.preload", (errno.ELOOP,)),
                            # pid 1's root: ptrace-denied or a magic link, never followed
                            (f"/etc/escape{canary}/file", (errno.ELOOP, errno.EACCES))):
                try:
                    root.ensure(p, "file")
                except OSError as e:
                    assert e.errno in errs, (p, e)
                else:
                    raise AssertionError(f"{p} resolved through a magic link")

    in_private_ns(body)


# --- mounts -------------------------------------------------------------------------
@pytest.mark.exclusive  # compares the host's whole mount table
def test_bind_onto_fd_tmpfs_mask_and_undo(rootfs: Path, tmp_path: Path, host_table: None) -> None:
    src = tmp_path / "libcuda.so.550.54.15"
    src.write_text("driver\n")
    hostproc = tmp_path / "proc"
    (hostproc / "gpus/0000:01:00.0").mkdir(parents=True)
    (hostproc / "gpus/0000:02:00.0").mkdir(parents=True)
    (hostproc / "gpus/0000:01:00.0/information").write_text("Model: X\n")
    (hostproc / "params").write_text("EnableMSI: 1\nModifyDeviceFiles: 1\n")
    (hostproc / "version").write_text("NVRM 550\n")
    (hostproc / "secret").write_text("no\n")
    (rootfs / "proc/driver/nvidia").mkdir(parents=True)

    def body() -> None:
        mounter = m.Mounter()
        tree = m.clone_source(str(src), m.attrs_for(True, False))
        mask = m.make_proc_mask(str(hostproc), ("0000:01:00.0",))
        with m.Root(str(rootfs)) as root:
            dest = root.ensure("/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15", "file")
            mounter.attach(tree, dest, "libcuda")
            pdest = root.open("/proc/driver/nvidia", os.O_PATH | os.O_DIRECTORY)
            mounter.attach(mask, pdest, "mask")
        lib = rootfs / "usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"
        assert lib.read_text() == "driver\n"
        try:
            lib.write_text("x")
        except OSError as e:
            assert e.errno == errno.EROFS
        else:
            raise AssertionError("writable")
        proc = rootfs / "proc/driver/nvidia"
        assert sorted(os.listdir(proc)) == ["gpus", "params", "version"]
        assert os.listdir(proc / "gpus") == ["0000:01:00.0"]
        assert (proc / "params").read_text() == "EnableMSI: 1\nModifyDeviceFiles: 0\n"
        infos = {i.mount_point: i for i in mounts.read_mountinfo()}
        assert infos[str(proc)].fstype == "tmpfs"
        assert not mounter.undo()
        after = {i.mount_point for i in mounts.read_mountinfo()}
        assert str(proc) not in after and str(lib) not in after
        assert lib.read_text() == ""  # the placeholder again

    in_private_ns(body)


@pytest.mark.exclusive  # compares the host's whole mount table
def test_shared_rootfs_mount_made_slave(tmp_path: Path, host_table: None) -> None:
    """A rootfs on a mount shared with the 'host' must not leak mounts back to it."""
    base = tmp_path / "shared"
    base.mkdir()
    src = tmp_path / "lib.so"
    src.write_text("x\n")

    def body() -> None:
        # this child is the "host": a shared tmpfs holds the rootfs
        mounts.mount_propagation("/", mounts.MS_REC | mounts.MS_PRIVATE)
        assert os.system(f"mount -t tmpfs t {base} && mount --make-shared {base}") == 0
        os.makedirs(base / "rootfs/usr/lib")
        host_before = Path("/proc/self/mountinfo").read_text()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the container: its copy of the tmpfs is a peer of the host's
            os.close(r)
            try:
                mounts.unshare(mounts.CLONE_NEWNS)
                with m.Root(str(base / "rootfs")) as root:
                    assert m.ensure_not_shared(root)
                    assert not m.ensure_not_shared(root)
                    tree = m.clone_source(str(src), m.attrs_for(True, False))
                    m.Mounter().attach(tree, root.ensure("/usr/lib/lib.so", "file"), "lib")
                    assert (base / "rootfs/usr/lib/lib.so").read_text() == "x\n"
                os.write(w, b"ok")
            finally:
                os._exit(0)
        os.close(w)
        assert os.read(r, 10) == b"ok"
        os.waitpid(pid, 0)
        assert Path("/proc/self/mountinfo").read_text() == host_before

    in_private_ns(body)


def test_params_without_modify() -> None:
    assert m.params_without_modify("A: 1\n") == "A: 1\nModifyDeviceFiles: 0\n"
    assert m.params_without_modify("ModifyDeviceFiles : 1\nB: 2") == "ModifyDeviceFiles: 0\nB: 2\n"


def test_parse_mountinfo_escapes_and_tags() -> None:
    line = "36 35 98:0 /mnt1 /mnt\\040x rw,noatime master:1 shared:4 - ext3 /dev/root rw"
    (info,) = mounts.parse_mountinfo(line)
    assert info.mount_point == "/mnt x" and info.shared and info.fstype == "ext3"


def test_parse_mountinfo_dev_root_options() -> None:
    line = "36 35 98:0 /srv/a\\040b /mnt rw,nosuid master:1 - ext4 /dev/root rw"
    (info,) = mounts.parse_mountinfo(line)
    assert (info.dev, info.root, info.options) == ("98:0", "/srv/a b", ("rw", "nosuid"))
    assert not info.read_only
    (info,) = mounts.parse_mountinfo("37 35 0:5 / /x ro,relatime - tmpfs t rw")
    assert info.read_only


def test_parse_mountinfo_a_dash_mount_point_escapes_and_no_optional_field() -> None:
    # the separator is looked for after the optional fields (a mount point may be "-"),
    # and a line's fields are unescaped only where the line has an escape
    got = mounts.parse_mountinfo("40 35 0:7 /a\\011b /- ro,nosuid - tmpfs my\\040src rw\n"
                                 "41 40 0:8 / /y rw shared:2 - proc proc rw")
    assert got == [
        mounts.MountInfo(40, 35, "/-", "tmpfs", (), "0:7", "/a\tb", ("ro", "nosuid"), "my src"),
        mounts.MountInfo(41, 40, "/y", "proc", ("shared:2",), "0:8", "/", ("rw",), "proc"),
    ]


@pytest.mark.parametrize(("plan", "want", "lead"), [
    # libraries first (ldconfig starts once they are in), the rest in the plan's order
    ([("f", "/usr/bin/nvidia-smi"), ("f", "/usr/lib/libcuda.so.550"),
      ("d", "/run/nvidia-persistenced"), ("f", "/usr/lib/libnvidia-ml.so.550"),
      ("f", "/lib/firmware/gsp.bin")],
     ["/usr/lib/libcuda.so.550", "/usr/lib/libnvidia-ml.so.550", "/usr/bin/nvidia-smi",
      "/run/nvidia-persistenced", "/lib/firmware/gsp.bin"], 2),
    # a directory mount on the way to a library: the plan's order, the lead up to the
    # last library
    ([("f", "/opt/nv/libx.so.1"), ("d", "/opt/nv"), ("f", "/opt/nv/liby.so.1"),
      ("f", "/usr/bin/x")],
     ["/opt/nv/libx.so.1", "/opt/nv", "/opt/nv/liby.so.1", "/usr/bin/x"], 3),
    # a directory named like a library is no library; nothing for ldconfig: no lead
    ([("d", "/usr/lib/libfoo.so.d"), ("f", "/usr/bin/x")],
     ["/usr/lib/libfoo.so.d", "/usr/bin/x"], 0),
    ([], [], 0),
])
def test_ldconfig_first_orders_the_libraries_ahead(plan: list[tuple[str, str]],
                                                   want: list[str], lead: int) -> None:
    sources = [(Mount("/h" + p, p, "dir" if k == "d" else "file"), i)
               for i, (k, p) in enumerate(plan)]
    ordered, n = ldconfig_first(sources)
    assert [mnt.container_path for mnt, _ in ordered] == want
    assert n == lead
    assert sorted(fd for _, fd in ordered) == list(range(len(plan)))  # each source once


def _mi(mid: int, point: str, dev: str, root: str = "/") -> mounts.MountInfo:
    return mounts.MountInfo(mid, 1, point, "x", (), dev, root, ("rw",))


def test_own_mount_ids() -> None:
    """What the hook and ldconfig may create files on: the rootfs's mount, binds of its
    own directories onto themselves, file systems only the container has."""
    infos = [
        _mi(1, "/", "8:1"),  # the host's /, holding a plain-directory rootfs /r
        _mi(2, "/dev/shm", "0:20"),
        _mi(3, "/r/etc", "8:1", "/r/etc"),  # the hook's pin of /etc
        _mi(4, "/r/vol", "8:1", "/srv/data"),  # a host dir on the same file system
        _mi(5, "/r/run", "0:40"),  # podman's own /run tmpfs
        _mi(6, "/r/dev/shm", "0:20"),  # Docker's /dev/shm: a bind of a host tmpfs
        _mi(7, "/r/etc/x", "8:1", "/r/other"),  # the rootfs's own dir, elsewhere
        _mi(8, "/rr", "0:41"),  # a sibling that only looks like a prefix
    ]
    assert m.own_mount_ids(infos, "/r", 1) == {1, 3, 5}
    # containerd: the overlay at the rootfs, runc's bind of it on top (the holder)
    infos = [_mi(1, "/", "8:1"), _mi(10, "/c/rootfs", "0:50"), _mi(11, "/c/rootfs", "0:50"),
             _mi(12, "/c/rootfs/etc", "0:50", "/etc"), _mi(13, "/c/rootfs/v", "8:1", "/v")]
    assert m.own_mount_ids(infos, "/c/rootfs", 11) == {10, 11, 12}


@pytest.mark.exclusive  # compares the host's whole mount table
def test_no_create_on_a_bound_host_dir(rootfs: Path, tmp_path: Path, host_table: None) -> None:
    host = tmp_path / "host"
    (host / "sub").mkdir(parents=True)
    (rootfs / "vol").mkdir()
    (rootfs / "etc/inside").symlink_to("/vol/sub")

    def body() -> None:
        assert os.system(f"mount --bind {host} {rootfs}/vol") == 0
        with m.Root(str(rootfs)) as root:
            for do in (lambda: root.ensure("/vol/new", "file"),
                       lambda: root.ensure("/vol/d/new", "dir"),
                       lambda: root.mkdirs("/vol/a/b"),
                       lambda: root.ensure("/etc/inside/new", "file"),  # an image link
                       lambda: root.symlink("/vol/sub/l", "x")):
                with pytest.raises(m.NotOnRootfs) as e:
                    do()
                assert e.value.errno == errno.EXDEV
                assert f"its directory is on {rootfs}/vol" in str(e.value.strerror)
            os.close(root.ensure("/vol/sub", "dir"))  # existing: used, nothing created
            os.close(root.ensure("/etc/new", "file"))  # the rootfs itself: fine
        assert sorted(os.listdir(host)) == ["sub"] and os.listdir(host / "sub") == []

    in_private_ns(body)


@pytest.mark.exclusive  # compares the host's whole mount table
def test_pin_and_ensure_exact(rootfs: Path, canary: Path, host_table: None) -> None:
    (rootfs / "run").mkdir()
    (rootfs / "etc/ld.so.preload").symlink_to(str(canary / "file"))
    (rootfs / "link").symlink_to("etc")
    (rootfs / "notdir").write_text("")

    def body() -> None:
        mounter = m.Mounter()
        with m.Root(str(rootfs)) as root:
            assert root.pin("etc", mounter) and root.pin("run", mounter)
            assert not root.pin("etc", mounter)  # a mount point already
            with pytest.raises(OSError, match="symbolic link") as e:
                root.pin("link", mounter)
            assert e.value.errno == errno.ELOOP
            with pytest.raises(NotADirectoryError):
                root.pin("notdir", mounter)
            with pytest.raises(OSError) as e:
                os.rename(rootfs / "etc", rootfs / "etc2")
            assert e.value.errno == errno.EBUSY
            # the final link of the image is replaced, a link on the way refused
            fd = root.ensure_exact("/etc/ld.so.preload", "file")
            assert real(fd) == str(rootfs / "etc/ld.so.preload")
            assert (rootfs / "etc/ld.so.preload").is_file()
            with pytest.raises(OSError, match="symbolic link in the image on the way"):
                root.ensure_exact("/link/x", "file")
            root.seal_pins()
            with pytest.raises(OSError) as e:
                (rootfs / "etc/new").write_text("x")
            assert e.value.errno == errno.EROFS
        assert len(mounter.attached) == 2 and not mounter.undo()

    in_private_ns(body)


def test_lookups_hold_while_the_host_renames(rootfs: Path, tmp_path: Path) -> None:
    """openat2's RESOLVE_IN_ROOT answers EAGAIN when a rename anywhere on the host races a
    ".." step: a busy node (engines renaming their state files) made a present glibc
    loader look absent, refusing capped containers. Every lookup is answered."""
    os.makedirs(rootfs / "lib/x86_64-linux-gnu")
    (rootfs / "lib/x86_64-linux-gnu/ld.so").write_text("")
    os.makedirs(rootfs / "usr", exist_ok=True)
    os.symlink("../lib/x86_64-linux-gnu/ld.so", rootfs / "usr/ld.so")
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("")
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            os.rename(a, b)
            os.rename(b, a)

    t = threading.Thread(target=churn)
    t.start()
    try:
        misses = sum(not exists_in_rootfs(str(rootfs), "/usr/ld.so") for _ in range(5000))
    finally:
        stop.set()
        t.join()
    assert misses == 0
