"""Exceptions that carry a message meant for the user (containerd/Docker show it)."""

from __future__ import annotations


class NvctkError(Exception):
    """A failure whose message names the culprit; executables print it as is."""


class ConfigError(NvctkError):
    pass


class RequestError(NvctkError):
    """The container asked for something invalid (unknown device, bad limit, ...)."""


class UnknownDeviceError(RequestError):
    """A device id matches no GPU or MIG device of the host (as far as nvctk knows it)."""


class RequirementError(NvctkError):
    """A NVIDIA_REQUIRE_* term is not met by the host."""


class DriverError(NvctkError):
    """The driver (or the simulated one) is missing or unusable."""


class SpecError(NvctkError):
    """The OCI bundle's config.json or the hook's state is unusable."""


class MountError(NvctkError):
    """A step of the prestart hook failed; the message names the step and path."""
