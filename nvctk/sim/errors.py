"""The simulated host's error (nvctk sim init, and what it builds on)."""

from __future__ import annotations

from nvctk.base.errors import NvctkError


class SimError(NvctkError):
    pass
