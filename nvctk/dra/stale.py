"""Claims whose NodeUnprepareResources never came: unprepared once they are gone.

The kubelet unprepares a claim when its last Pod on the node is gone. A kubelet that
lost its state (its dir wiped, a crash between the Pod's end and the call) never does,
and the claim's CDI spec and share ledger (a tmpfs mount) would stay for ever. So every
`interval` seconds the plugin looks at each claim it recorded:

- the kubelet still names it (pod-resources List: a Pod on the node holds it): kept,
  whatever the API server says; when the kubelet cannot be asked, nothing is swept;
- the API server has it with the recorded uid: kept; cannot say (down, slow): kept;
- gone from the API server (404), or made again under another uid: stale. A claim found
  stale at sweeps `grace` seconds apart, with the kubelet never naming it in between,
  is unprepared as the kubelet would have.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from nvctk.base.errors import NvctkError
from nvctk.dra.claims import ClaimSource
from nvctk.dra.driver import Driver
from nvctk.dra.kube import KubeError, NotFound
from nvctk.dra.record import RecordError

log = logging.getLogger("nvctk.dra")

INTERVAL_S = 60.0
GRACE_S = 300.0

# (namespace, name) of every claim a Pod on the node holds, as the kubelet says; OSError
# or another exception when it cannot be asked
KubeletClaims = Callable[[], set[tuple[str, str]]]


class Sweeper:
    def __init__(self, driver: Driver, source: ClaimSource, kubelet_claims: KubeletClaims,
                 grace: float = GRACE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.driver = driver
        self.source = source
        self.kubelet_claims = kubelet_claims
        self.grace = grace
        self.clock = clock
        self.stale_since: dict[str, float] = {}  # uid -> when first found stale
        self.stopping = threading.Event()

    def sweep(self) -> list[str]:
        """One look at every recorded claim (module docstring); the uids unprepared."""
        try:
            held = self.kubelet_claims()
        except Exception as e:  # no kubelet to ask: what it holds is unknown, keep all
            log.info("stale claims not swept: cannot ask the kubelet which it holds: %s", e)
            return []
        now = self.clock()
        done: list[str] = []
        uids = self.driver.prepared_uids()
        for uid in list(self.stale_since):
            if uid not in uids:
                del self.stale_since[uid]  # unprepared meanwhile
        for uid in uids:
            try:
                rec = self.driver.records.load(uid)
            except RecordError:
                continue  # unprepare reports it when the kubelet asks
            if rec is None:
                continue
            if (rec.namespace, rec.name) in held or not self._gone(rec.namespace, rec.name, uid):
                self.stale_since.pop(uid, None)
                continue
            since = self.stale_since.setdefault(uid, now)
            if now - since < self.grace:
                continue
            try:
                self.driver.unprepare(rec.namespace, rec.name, uid)
            except NvctkError as e:
                log.error("stale claim %s/%s (%s): cannot unprepare it: %s", rec.namespace,
                          rec.name, uid, e)
                continue
            del self.stale_since[uid]
            log.warning("unprepared claim %s/%s (%s): gone from the API server for %.0fs "
                        "and held by no Pod the kubelet knows", rec.namespace, rec.name, uid,
                        now - since)
            done.append(uid)
        return done

    def _gone(self, namespace: str, name: str, uid: str) -> bool:
        try:
            claim = self.source.get_claim(namespace, name, self.driver.api_timeout)
        except NotFound:
            return True
        except KubeError:
            return False  # cannot say: kept
        meta = claim.get("metadata") if isinstance(claim, dict) else None
        return not isinstance(meta, dict) or meta.get("uid") != uid

    def run(self, interval: float = INTERVAL_S) -> None:
        while not self.stopping.wait(interval):
            try:
                self.sweep()
            except Exception:  # one bad sweep never ends the plugin's
                log.exception("stale claims: the sweep failed")

    def stop(self) -> None:
        self.stopping.set()


def kubelet_claims(socket: str) -> KubeletClaims:
    """The claims Pods on the node hold, from the kubelet's pod-resources socket."""
    from nvctk.monitor.podresources import PodResources

    client = PodResources(socket, timeout=5.0)

    def held() -> set[tuple[str, str]]:
        return {(c.namespace, c.name) for a in client.list().values() for c in a.claims}
    return held
