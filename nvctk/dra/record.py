"""nvctk's own record of the claims it prepared: what NodeUnprepareResources undoes (the
kubelet sends only the claim's namespace, name and uid) and what a repeated
NodePrepareResources answers again.

One file per claim, `<dir>/<uid>.json`, written by nvctk.base.fileio.atomic_write (a
crash leaves the old record or the new one, never half of one), so that a corrupt
record is that claim's error and no other's. The record is versioned and carries the
boot id: a record from before a reboot names CDI specs in a tmpfs that is gone.

    {"v": 1, "boot_id": "...", "namespace": "...", "name": "...", "uid": "...",
     "cdi_spec": "/var/run/cdi/...json", "ledger": null | "<state-dir>/dra/<uid>",
     "devices": [{"requests": [...], "pool": "...", "device": "gpu-0",
                  "cdi_ids": ["k8s.gpu.nvctk.io/claim=<uid>-gpu-0"], "share_id": null}]}
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from nvctk.base import fileio, jsonio
from nvctk.base.errors import NvctkError, shown

VERSION = 1
BOOT_ID = "/proc/sys/kernel/random/boot_id"
MAX_RECORD = 1 << 20
# a claim uid names the record file: an uuid's characters only, never a path
_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # matched whole (fullmatch)


class RecordError(NvctkError):
    pass


@dataclass(frozen=True)
class PreparedDevice:
    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True)
class Prepared:
    namespace: str
    name: str
    uid: str
    cdi_spec: str
    devices: tuple[PreparedDevice, ...]
    boot_id: str = ""
    ledger: str | None = None  # a share's vGPU ledger dir (nvctk.vgpu.state.install_ledger)

    def to_json(self) -> bytes:
        return (jsonio.dumps({
            "v": VERSION, "boot_id": self.boot_id, "namespace": self.namespace,
            "name": self.name, "uid": self.uid, "cdi_spec": self.cdi_spec, "ledger": self.ledger,
            "devices": [{"requests": list(d.requests), "pool": d.pool, "device": d.device,
                         "cdi_ids": list(d.cdi_ids), "share_id": d.share_id}
                        for d in self.devices]}, sort_keys=True) + "\n").encode()


def boot_id() -> str:
    try:
        return fileio.read_regular_file(BOOT_ID, 4096).decode().strip()
    except OSError:
        return ""


def check_uid(uid: str) -> None:
    if not isinstance(uid, str) or not _UID.fullmatch(uid):
        raise RecordError(f"claim uid {shown(uid)} is not one (letters, digits, '-', '.', '_')")


def _strs(v: object) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def parse(data: bytes, where: str) -> Prepared:
    try:
        rec = jsonio.loads(data)
    except (ValueError, RecursionError):
        raise RecordError(f"{where}: corrupt (not JSON)") from None
    if not isinstance(rec, dict) or rec.get("v") != VERSION:
        raise RecordError(f"{where}: not a version {VERSION} record of nvctk's "
                          f"(v = {shown(rec.get('v') if isinstance(rec, dict) else rec)})")
    keys = ("boot_id", "namespace", "name", "uid", "cdi_spec")
    devs = rec.get("devices")
    if not isinstance(devs, list):
        raise RecordError(f"{where}: corrupt (no device list)")
    ok = all(isinstance(rec.get(k), str) for k in keys) and all(
        isinstance(d, dict) and _strs(d.get("requests")) and _strs(d.get("cdi_ids"))
        and isinstance(d.get("pool"), str) and isinstance(d.get("device"), str)
        and (d.get("share_id") is None or isinstance(d.get("share_id"), str)) for d in devs) \
        and (rec.get("ledger") is None or isinstance(rec.get("ledger"), str))
    if not ok:
        raise RecordError(f"{where}: corrupt (fields missing or of the wrong type)")
    return Prepared(rec["namespace"], rec["name"], rec["uid"], rec["cdi_spec"],
                    tuple(PreparedDevice(tuple(d["requests"]), d["pool"], d["device"],
                                         tuple(d["cdi_ids"]), d["share_id"]) for d in devs),
                    rec["boot_id"], rec.get("ledger"))


class Records:
    """The record files of one driver, in `directory` (made 0700)."""

    def __init__(self, directory: str) -> None:
        self.dir = directory

    def path(self, uid: str) -> str:
        check_uid(uid)
        return os.path.join(self.dir, uid + ".json")

    def load(self, uid: str) -> Prepared | None:
        """The claim's record; None when there is none; RecordError when it is unreadable
        or not nvctk's."""
        p = self.path(uid)
        try:
            data = fileio.read_regular_file(p, MAX_RECORD, nofollow=True)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RecordError(f"{p}: cannot read: {e.strerror or e}") from None
        rec = parse(data, p)
        if rec.uid != uid:
            raise RecordError(f"{p}: corrupt (it names claim uid {shown(rec.uid)})")
        return rec

    def save(self, rec: Prepared) -> None:
        os.makedirs(self.dir, 0o700, exist_ok=True)
        fileio.atomic_write(self.path(rec.uid), rec.to_json(), 0o600)

    def remove(self, uid: str) -> None:
        """The record goes (last, once the claim's files are gone); gone already is fine."""
        try:
            os.unlink(self.path(uid))
        except FileNotFoundError:
            return
        fileio.sync_directory(self.dir)

    def uids(self) -> list[str]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(n[:-5] for n in names if n.endswith(".json") and _UID.match(n[:-5]))
