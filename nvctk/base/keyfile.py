"""A node's secret MAC key in a file: made once with O_EXCL via link(), read only when
it is a regular 0600 file of ours of the right size (anyone else who could write it
could forge what it signs). The node's two keys: of edit records (edits_key, here) and of
vGPU authority annotations (nvctk.vgpu.authority). mac() is what both seal with."""

from __future__ import annotations

import os

from nvctk import _sys
from nvctk.base.errors import NvctkError, SpecError

MAC_BYTES = 32


def mac(text: str, key: bytes) -> str:
    """The MAC of `text` under `key`, in hex: keyed BLAKE2b-256. nvctk._sys's (libb2's), not
    hashlib's: hashlib loads OpenSSL (~2 ms), which a CDI-mode create would pay to
    seal its record."""
    return _sys.blake2b(text.encode(), key, MAC_BYTES).hex()


def same_mac(good: str, given: str, key: bytes) -> bool:
    """Whether MAC `given` is `good` (made with `key`), in time that tells nothing of
    where they differ: each is MACed again under the key and those compared (the
    double-MAC check: ==, which stops at the first difference, then only leaks about
    values no one without the key can choose or predict). hmac.compare_digest would
    do, but hmac loads OpenSSL too."""
    if not given.isascii():  # not hex: no MAC of ours (and no str to encode as is)
        return False
    return mac("check\n" + good, key) == mac("check\n" + given, key)


def load_key(path: str, size: int, create: bool, dir_mode: int, error: type[NvctkError],
             what: str, remedy: str) -> bytes | None:
    """The `size` bytes of key file `path`; None when missing and not create. create:
    make it (and its folder with dir_mode) when missing, so that a racing create never
    reads half a key. error(...) names the file, `what` it is ("authority key") and the `remedy`."""
    if create and not os.path.lexists(path):
        os.makedirs(os.path.dirname(path) or ".", dir_mode, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.write(fd, os.urandom(size))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: its key is the key
        finally:
            os.unlink(tmp)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as e:
        raise error(f"{path}: {e.strerror} (nvctk's {what})")
    try:
        st = os.fstat(fd)
        if (st.st_mode & 0o170000) != 0o100000 or st.st_mode & 0o7777 != 0o600 \
                or st.st_uid != os.geteuid() or st.st_size != size:
            raise error(f"{path}: not a regular 0600 file of {size} bytes owned by "
                        f"uid {os.geteuid()}; nvctk refuses it as its {what} ({remedy})")
        key = os.read(fd, size + 1)
    finally:
        os.close(fd)
    if len(key) != size:
        raise error(f"{path}: a short key file; remove it")
    return key


# The node's key of nvctk.io/edits records (nvctk.spec.record.record_mac), in the
# config's state dir: made by the first create that seals a record
EDITS_KEY_FILE = "edits.key"
EDITS_KEY_BYTES = 32


def edits_key(state_dir: str, create: bool = False) -> bytes | None:
    """The key of edit records' MACs, <state_dir>/edits.key (load_key: made on first
    use with create; None when there is none and create is False; SpecError for a key
    file anyone else could have written)."""
    return load_key(os.path.join(state_dir, EDITS_KEY_FILE), EDITS_KEY_BYTES, create, 0o755,
                    SpecError, "key of edit records",
                    "remove it: the next create that records its edits makes a new one")
