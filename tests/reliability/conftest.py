"""Fixtures of the reliability suite (its helpers are in relkit)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def base(rootfs: Any) -> str:
    """A Debian-like rootfs that bundles copy (relkit.Lab.bundle(None, ..., base=))."""
    return str(rootfs())
