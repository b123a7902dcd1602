"""The MAC nvctk seals its records with (nvctk.base.keyfile.mac): keyed BLAKE2b from
nvctk._sys, which must be exactly hashlib's, so that a record sealed by an nvctk that
used hashlib still verifies, and so that libb2 as linked is checked against a reference."""

from __future__ import annotations

import hashlib
import random

import pytest

from nvctk import _sys
from nvctk.base import keyfile

_RNG = random.Random(26)
# lengths around the 128-byte block (the last block is compressed differently)
LENGTHS = [0, 1, 2, 63, 64, 127, 128, 129, 255, 256, 257, 1000, 4096, 65537]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("key_len", [0, 1, 32, 63, 64])
@pytest.mark.parametrize("size", [1, 20, 32, 64])
def test_blake2b_is_hashlibs(n: int, key_len: int, size: int) -> None:
    data, key = _RNG.randbytes(n), _RNG.randbytes(key_len)
    assert _sys.blake2b(data, key, size) == \
        hashlib.blake2b(data, key=key, digest_size=size).digest()


def test_blake2b_rfc7693_vector() -> None:
    # RFC 7693 appendix A: BLAKE2b-512("abc")
    assert _sys.blake2b(b"abc", b"", 64).hex() == (
        "ba80a53f981c4d0d6a2797b69f12f6e94c212f14685ac4b74b12bb6fdbffa2d1"
        "7d87c5392aab792dc252d5de4533cc9518d38aa8dbf1925ab92386edd4009923")


@pytest.mark.parametrize(("key", "size"), [(b"k" * 65, 32), (b"k", 0), (b"k", 65)])
def test_blake2b_refuses_what_blake2b_cannot_be(key: bytes, size: int) -> None:
    with pytest.raises(ValueError, match="blake2b"):
        _sys.blake2b(b"x", key, size)


def test_mac_and_same_mac() -> None:
    key = _RNG.randbytes(32)
    good = keyfile.mac("a record", key)
    assert good == hashlib.blake2b(b"a record", key=key, digest_size=32).hexdigest()
    assert keyfile.same_mac(good, good, key)
    other = keyfile.mac("a record", _RNG.randbytes(32))
    for bad in (other, good[:-1], good + "0", good.upper(), "", "\ud800" * 64, "é" * 64):
        assert not keyfile.same_mac(good, bad, key), bad
