"""The node's authority over a container's vGPU share.

A share the node gives (the device plugin's Allocate) travels in a container
annotation under `nvctk.io/`, not only in the env: a Pod's env comes after the
plugin's in the CRI config and replaces it, and an image's ENV reaches the same
merged list. A Pod author cannot set container annotations (Pod annotations go to
the sandbox, and into a container's spec only where the engine's `pod_annotations`
lists them), and the value carries a MAC keyed by a root-only node key
(config `authority-key`), so that no engine's annotation pass-through can forge
one. The runtime applies the strictest of the annotation and the env per GPU.

    nvctk.io/vgpu.<resource name> = {"v": 1, "devices": [[uuid, bytes, percent], ...],
                                     "mac": <hex>}

The MAC (blake2b, 32 bytes, keyed) covers the annotation's key and its canonical
JSON without "mac": a value moved to another key, edited, made on another node or
with an older key does not verify, and the container is refused (a share that
cannot be read must never become no share).
"""

from __future__ import annotations

from nvctk.base import jsonio, keyfile
from nvctk.base.errors import RequestError, shown

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

PREFIX = "nvctk.io/"
VGPU_PREFIX = PREFIX + "vgpu."
VERSION = 1
KEY_BYTES = 32
MAX_VALUE = 16384  # bytes of one annotation's value: 16 devices need under 2 KiB


def annotation_key(resource: str) -> str:
    """`nvctk.io/vgpu.<name>` for resource `<domain>/<name>`."""
    return VGPU_PREFIX + resource.split("/", 1)[-1]


def _mac(key_name: str, body: dict[str, object], key: bytes) -> str:
    return keyfile.mac(key_name + "\n" + jsonio.dumps(body, sort_keys=True), key)


def make(resource: str, devices: list[tuple[str, int, int]], key: bytes) -> tuple[str, str]:
    """The annotation (key, value) granting `devices`: (uuid, memory bytes, SM percent)."""
    name = annotation_key(resource)
    body: dict[str, object] = {"v": VERSION, "devices": [list(d) for d in devices]}
    return name, jsonio.dumps({**body, "mac": _mac(name, body, key)}, sort_keys=True)


def present(annotations: object) -> dict[str, object]:
    """The spec's `nvctk.io/vgpu.*` annotations, as they are (not yet checked)."""
    if not isinstance(annotations, dict):
        return {}
    return {k: v for k, v in annotations.items() if isinstance(k, str) and k.startswith(VGPU_PREFIX)}


def _bad(name: str, why: str) -> RequestError:
    return RequestError(f"annotation {shown(name)}: {why}; refused: the node's vGPU share for "
                        "this container cannot be read")


def shares(annotations: Mapping[str, object], key: bytes | None,
           key_path: str) -> dict[str, tuple[int, int]]:
    """uuid -> (memory bytes, SM percent), the strictest over all the annotations
    (0: no limit). RequestError when any annotation fails to verify."""
    from nvctk.vgpu.limits import stricter

    out: dict[str, tuple[int, int]] = {}
    for name in sorted(annotations):
        raw = annotations[name]
        if not isinstance(raw, str) or len(raw) > MAX_VALUE:
            raise _bad(name, "not a string of nvctk's format")
        if key is None:
            raise _bad(name, f"this node has no authority key ({key_path}) to check it with")
        try:
            rec = jsonio.loads(raw)
        except (ValueError, RecursionError):
            raise _bad(name, "not JSON")
        if not isinstance(rec, dict) or set(rec) != {"v", "devices", "mac"} \
                or rec["v"] != VERSION or not isinstance(rec["mac"], str):
            raise _bad(name, "not nvctk's format (v, devices, mac)")
        body = {k: v for k, v in rec.items() if k != "mac"}
        if not keyfile.same_mac(_mac(name, body, key), rec["mac"], key):
            raise _bad(name, "its MAC does not verify with this node's authority key (forged, "
                       "edited, from another node, or made with an older key)")
        devs = rec["devices"]
        if not isinstance(devs, list):
            raise _bad(name, "devices is not a list")
        for d in devs:
            ok = (isinstance(d, list) and len(d) == 3 and isinstance(d[0], str)
                  and all(type(x) is int and x >= 0 for x in d[1:]) and d[2] <= 100)
            if not ok:
                raise _bad(name, f"bad device entry {shown(d)}")
            mem, sm = out.get(d[0], (0, 0))
            out[d[0]] = (stricter(mem, d[1]), stricter(sm, d[2]))
    return out


def load_key(path: str, create: bool = False) -> bytes | None:
    """The node's authority key: KEY_BYTES random bytes in a regular 0600 file owned
    by this uid (root on a node). create: make it when missing (O_EXCL via link(), so
    a racing create never reads half a key). None when missing and not create. A file
    anyone else could have written is refused (RequestError): it could forge shares."""
    from nvctk.base.keyfile import load_key

    return load_key(path, KEY_BYTES, create, 0o700, RequestError, "authority key",
                    "remove it: the device plugin makes a new one at its start")
