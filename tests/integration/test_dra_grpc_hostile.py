"""The DRA kubelet plugin over gRPC against bad input and a failing world: bad claims each get
their error and touch nothing, the API server down, slow or trickling, a full or read-only
CDI dir, a corrupt record. (The rest: test_dra_grpc_prepare.py, test_dra_grpc_shares.py,
test_dra_grpc_health.py; shared: tests/support/dranode.py.)"""

from __future__ import annotations

import os
import subprocess

import pytest

import support.dranode as _dranode
from nvctk.dra.claims import MemoryClaims
from nvctk.dra.kube import Kube, Retry
from nvctk.sim.host import SimHost
from support.apiserver import client_for, running
from support.dranode import DRIVER, Start, _mps, _share, _sharing, claim, result

pytestmark = pytest.mark.slow

FAST = Retry(attempts=4, base=0.001, cap=0.01, deadline=30, timeout=5)

start = _dranode.start  # fixtures


BAD = [
    ("gone", None, "not found"),
    ("uid", claim("uid", "uid-other", [result("gpu-1")]), "has uid 'uid-other'"),
    ("unknown", claim("unknown", "uid-unknown", [result("gpu-9")]), "unknown device 'gpu-9'"),
    ("pool", claim("pool", "uid-pool", [result("gpu-1", pool="node-b")]), "pool 'node-b'"),
    ("unalloc", {"metadata": {"uid": "uid-unalloc"}}, "not allocated"),
    ("over", _share("over", {"memory": "1Ti"}), "consumedCapacity memory 1Ti is outside"),
    ("nan", _share("nan", {"memory": "lots"}), "'lots' is not a quantity"),
    # quantities outside the decimal range: a clear error naming the claim and field
    ("huge", _share("huge", {"memory": "1e999999999"}),
     "claim ns/huge: status.allocation.devices.results[0]: consumedCapacity memory: "
     "'1e999999999' is not a quantity within"),
    ("tiny", _share("tiny", {"memory": "1e-999999999"}), "'1e-999999999' is not a quantity within"),
    ("smhuge", _share("smhuge", {"smShare": "1e99999999999"}),
     "consumedCapacity smShare: '1e99999999999' is not a quantity within"),
    ("longq", _share("longq", {"memory": "9" * 5000}), "longer than 64 characters"),
    ("migshare", _share("migshare", {"memory": "1Gi"}, "gpu-0-mig-0"),
     "a share of MIG device gpu-0-mig-0"),
    ("smname", _share("smname", {"sm": "50"}),
     "consumedCapacity 'sm': device gpu-1 has no such capacity"),
    ("params", claim("params", "uid-params", [result("gpu-1")],
                     config=[_sharing("Everything", "gpu")]),
     "unknown sharing strategy 'Everything'"),
    ("vgpu", claim("vgpu", "uid-vgpu", [result("gpu-1")], config=[_sharing("VGpu")]),
     "consumes no part of device gpu-1"),
    ("mpsmig", claim("mpsmig", "uid-mpsmig", [result("gpu-0-mig-0")], config=[_mps()]),
     "MPS on MIG device gpu-0-mig-0"),
    ("excl", claim("excl", "uid-excl", [result("gpu-1", shareID="s1")],
                   config=[_sharing("Exclusive")]),
     "Exclusive, but device gpu-1"),
]


def test_bad_claims_each_get_their_error_and_touch_nothing(start: Start,
                                                           sim_host_mig: SimHost) -> None:
    src = MemoryClaims({("ns", name): c for name, c, _ in BAD if c is not None})
    src.claims[("ns", "good")] = claim("good", "uid-good", [result("gpu-0")], config=[
        {"opaque": {"driver": "other.example.com", "parameters": {"anything": 1}}},  # not ours
        _sharing("TimeSlicing")])
    n = start(sim_host_mig, src)
    refs = [("ns", name, f"uid-{name}") for name, _, _ in BAD] + [("ns", "good", "uid-good")]
    got = n.kubelet.prepare(refs)
    for name, _, why in BAD:
        err = got[f"uid-{name}"].error
        assert why in err, (name, err)
        assert "Traceback" not in err and "internal error" not in err
        assert not got[f"uid-{name}"].devices
    assert got["uid-good"].error == "" and got["uid-good"].devices
    assert n.specs() == [f"k8s.{DRIVER}-claim_uid-good.json"]
    assert n.driver.prepared_uids() == ["uid-good"]
    # a uid that is no file name is refused, not used as a path; matched whole
    for uid in ("../../etc/passwd", "uid-good\n", "uid-good\nx", "\nuid-good", "uid good"):
        bad = n.kubelet.prepare([("ns", "good", uid)])[uid]
        assert "is not one" in bad.error, (uid, bad.error)
    assert n.specs() == [f"k8s.{DRIVER}-claim_uid-good.json"]
    assert sorted(os.listdir(n.driver.records.dir)) == ["uid-good.json"]


def test_api_server_down_or_slow_and_unprepare_still_works(start: Start,
                                                          sim_host: SimHost) -> None:
    """The official client against the API-server double: a server failing twice is
    retried (nvctk.dra.kube's back-off); one that stays down is that claim's error; a
    prepared claim is unprepared without it."""
    with running() as api:
        api.add_claim(claim("c", "uid-c", [result("gpu-0")], ns="ns"))
        api.add_claim(claim("d", "uid-d", [result("gpu-1")], ns="ns"))
        n = start(sim_host, Kube(client_for(api), FAST))
        api.fail(2)  # 503, 503, then the claim
        assert n.kubelet.prepare([("ns", "c", "uid-c")])["uid-c"].error == ""
        assert n.kubelet.unprepare([("ns", "c", "uid-c")]) == {"uid-c": ""}
        # slow: the first read outlasts its timeout and is asked again
        n.driver.source = Kube(client_for(api), Retry(attempts=4, base=0.001, cap=0.01,
                                                      deadline=30, timeout=0.5))
        api.stall(1)
        assert n.kubelet.prepare([("ns", "c", "uid-c")])["uid-c"].error == ""
        api.release.set()
        api.fail(100)  # down for good
        err = n.kubelet.prepare([("ns", "d", "uid-d")])["uid-d"].error
        assert "reading ResourceClaim ns/d" in err and "503" in err, err
        assert n.kubelet.unprepare([("ns", "c", "uid-c")]) == {"uid-c": ""}
        assert n.specs() == []
        api.release.set()


# alone: it holds a dozen trickling connections and their threads in this process, whose
# scheduling a second test on the other core disturbs
@pytest.mark.exclusive
def test_slow_api_answers_starve_no_other_claim(start: Start, sim_host: SimHost) -> None:
    """Claims whose API-server answers trickle for ever, more of them at once than the
    gRPC server used to have workers (8), and in one request beside a healthy claim:
    the healthy claims are prepared while the slow ones still wait, and each slow one
    ends as its own error at the driver's deadline."""
    import concurrent.futures as cf

    slow = 12
    with running() as api:
        api.add_claim(claim("ok", "uid-ok", [result("gpu-0")], ns="ns"))
        api.add_claim(claim("ok2", "uid-ok2", [result("gpu-1")], ns="ns"))
        # the slow ones outlast the test's healthy calls, however loaded the machine: a
        # total deadline and a per-read timeout (each byte of the trickle renews it) far
        # past the test's, so only the double's release ends them
        n = start(sim_host, Kube(client_for(api), Retry(attempts=4, base=0.001, cap=0.01,
                                                        deadline=600, timeout=300)))
        n.driver.api_timeout = 600
        # a byte a claim every 0.5 s: slow, never done, and cheap; only the slow claims'
        # reads (ok2's, read beside sx's in one request, could take one: then a slow
        # claim was answered at once, 404, as CI saw)
        api.trickle(slow, pause=0.5, path="/resourceclaims/s")
        with cf.ThreadPoolExecutor(slow + 1) as pool:
            try:
                # the slow calls' own gRPC deadline far past the test's: only the plugin
                # ends them
                pending = [pool.submit(n.kubelet.prepare, [("ns", f"s{i}", f"uid-s{i}")],
                                       "v1", 600) for i in range(slow - 1)]
                mixed = pool.submit(n.kubelet.prepare, [("ns", "sx", "uid-sx"),
                                                        ("ns", "ok2", "uid-ok2")], "v1", 600)
                for _ in range(slow):  # every slow answer has started
                    assert api.trickling.acquire(timeout=60)
                got = n.kubelet.prepare([("ns", "ok", "uid-ok")])
                assert got["uid-ok"].error == "" and got["uid-ok"].devices
                assert not any(f.done() for f in pending) and not mixed.done()
            finally:
                api.release.set()  # the double ends its bodies: the reads end
            errs = [f.result(timeout=60)[f"uid-s{i}"].error for i, f in enumerate(pending)]
            both = mixed.result(timeout=60)
        assert all("reading ResourceClaim ns/s" in e for e in errs), errs
        assert "reading ResourceClaim ns/sx" in both["uid-sx"].error
        assert both["uid-ok2"].error == "" and both["uid-ok2"].devices


def _mount_tmpfs(path: str, opts: str) -> None:
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], check=True)


@pytest.mark.root
def test_full_or_read_only_cdi_dir(start: Start, sim_host: SimHost,
                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    top = tmp_path_factory.mktemp("drafull")
    cdi = str(top / "cdi")
    _mount_tmpfs(cdi, "size=4k,nr_inodes=8")
    try:
        fd = os.open(os.path.join(cdi, "filler"), os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"x" * 1024):
                pass
        except OSError:  # full
            pass
        finally:
            os.close(fd)
        src = MemoryClaims({("ns", "c"): claim("c", "uid-c", [result("gpu-0")])})
        n = start(sim_host, src, top=top)
        err = n.kubelet.prepare([("ns", "c", "uid-c")])["uid-c"].error
        assert "CDI spec for the claim: cannot write" in err and "No space left" in err
        assert sorted(os.listdir(cdi)) == ["filler"]  # no half-written spec, no temp file
        assert n.driver.prepared_uids() == []
        subprocess.run(["mount", "-o", "remount,ro", cdi], check=True)
        err = n.kubelet.prepare([("ns", "c", "uid-c")])["uid-c"].error
        assert "Read-only file system" in err
    finally:
        subprocess.run(["umount", cdi], check=True)


def test_corrupt_record_is_that_claims_error_only(start: Start, sim_host: SimHost) -> None:
    """A corrupt record: its unprepare says so (naming the file), removes what the claim
    can have by its uid alone and keeps the record aside; the kubelet's retry then finds
    the claim done; another claim is untouched; a prepare makes the claim anew."""
    src = MemoryClaims({("ns", "a"): claim("a", "uid-a", [result("gpu-0")]),
                        ("ns", "b"): claim("b", "uid-b", [result("gpu-1")])})
    n = start(sim_host, src)
    got = n.kubelet.prepare([("ns", "a", "uid-a"), ("ns", "b", "uid-b")])
    assert not got["uid-a"].error and not got["uid-b"].error
    rec = n.driver.records.path("uid-a")
    with open(rec, "wb") as f:
        f.write(b'{"v": 1, "uid": ')
    out = n.kubelet.unprepare([("ns", "a", "uid-a"), ("ns", "b", "uid-b")])
    assert out["uid-b"] == ""
    assert out["uid-a"] == (f"{rec}: corrupt (not JSON): the claim's CDI spec and vGPU ledger "
                            f"(named by its uid) are removed; the record is kept as "
                            f"{rec}.corrupt")
    assert n.specs() == [] and os.path.exists(rec + ".corrupt")
    assert n.kubelet.unprepare([("ns", "a", "uid-a")]) == {"uid-a": ""}
    # a prepare over a record of another version makes the claim anew
    with open(rec, "wb") as f:
        f.write(b'{"v": 7}')
    assert n.kubelet.prepare([("ns", "a", "uid-a")])["uid-a"].error == ""
    assert n.driver.records.load("uid-a") is not None
