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


class SpecShapeError(SpecError):
    """config.json is valid JSON, but a field nvctk reads has the wrong type."""


class CdiError(NvctkError):
    """A CDI spec or device nvctk cannot read or apply."""


class MountError(NvctkError):
    """A step of the prestart hook failed; the message names the step and path."""


def shown(value: object, limit: int = 80) -> str:
    """repr() of a value for a message, cut to about `limit` characters: container
    input may be megabytes long (or a 5000-digit number), a message one line."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return "a number of over 30 digits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}...' ({len(str(value))} characters)"


# C0, DEL, C1 and the bidirectional overrides: a name shown on a terminal, a page or in a
# log is text, and these would act (move the cursor, set the title, reorder what follows)
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_CONTROLS.update({c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A),
                                               0x2028, 0x2029, 0x200E, 0x200F, 0x061C)})


def literal(text: str) -> str:
    """text with its control characters escaped (\\x1b, \\u202e): shown as it is, never
    acted on; a backslash stays one (the escapes are for reading, not for parsing back)."""
    return text.translate(_CONTROLS)


def clipped(text: str, limit: int = 300) -> str:
    """A message from another library (a parser's, a schema validator's), cut to about
    `limit` characters: they quote the offending input, which may be megabytes. The
    middle goes, so that a closing "at line L col C" stays."""
    if len(text) <= limit:
        return text
    half = (limit - 30) // 2
    return f"{text[:half]}...({len(text) - 2 * half} characters)...{text[-half:]}"


def ascii_uint(text: str, max_digits: int = 9) -> int | None:
    """A small non-negative decimal integer of ASCII digits, else None.

    str.isdigit() and int() also take other scripts' digits (U+0660, "²") and int()
    refuses more than 4300 digits with a ValueError: ids, indexes and limits are
    ASCII only, and longer than max_digits is no index of anything.
    """
    if not text or len(text) > max_digits or not text.isascii() or not text.isdigit():
        return None
    return int(text)
