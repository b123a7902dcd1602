"""The monitor's basic auth (nvctk.monitor.webconfig): a pair is checked by bcrypt once and
remembered, a wrong one never is, and the memory is bounded."""

from __future__ import annotations

import base64

import bcrypt
import pytest

from nvctk.monitor import webconfig
from nvctk.monitor.webconfig import WebConfig


def header(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def config() -> WebConfig:
    return WebConfig(users={"p": bcrypt.hashpw(b"s", bcrypt.gensalt(4))})


def test_a_pair_is_checked_once_then_remembered() -> None:
    c = config()
    assert c.known(header("p", "s")) is None  # bcrypt decides
    assert c.authorized(header("p", "s"))
    assert c.known(header("p", "s")) is True  # no bcrypt again


def test_a_wrong_pair_is_refused_and_never_remembered() -> None:
    c = config()
    assert not c.authorized(header("p", "wrong"))
    assert c.known(header("p", "wrong")) is None
    assert c.known(header("q", "s")) is False  # not a listed user: no bcrypt at all
    assert c.known("Bearer x") is False


def test_no_user_listed_lets_everyone_in() -> None:
    assert WebConfig().authorized("")


def test_the_remembered_pairs_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bcrypt, "checkpw", lambda password, hashed: True)
    c = config()
    for i in range(webconfig.MAX_CACHED + 1):
        assert c.authorized(header("p", f"s{i}"))
    assert c.known(header("p", "s0")) is None  # forgotten when the memory was full
    assert c.known(header("p", f"s{webconfig.MAX_CACHED}")) is True  # the newest kept
