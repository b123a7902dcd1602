"""Every message between the processes of a prestart, encoded and decoded here.

The processes (docs/decisions.md "The prestart's processes and their messages"): the
hook's process (nvctk-hook, or nvctk-runtime's server: nvctk.hook.served), the worker
it forks (nvctk.hook.worker) and the ldconfig child beside it (nvctk.hook.ldconfig),
both forked by nvctk.hook.children. Each pipe carries at most one message, written
whole by its one writer, which then closes it; its reader reads to EOF. EOF with no
message is itself a message (a peer that ended, or was cancelled):

    pipe        writer -> reader        message                 EOF alone
    pid         hook -> worker          PID: the container's     cancelled: mount
                                        pid                      nothing, exit 0
    libraries   worker -> ldconfig      LIBRARIES_IN: rootfs     the worker failed
                                        dev, ino; the pid        before: no ldconfig
    set-up      ldconfig -> worker      SET_UP: none; the end    ldconfig exec'd, or
                                        is close-on-exec         ended: mount the rest
    answer      worker -> hook          ANSWER: ok, or error     no answer: the
                                        and the message          worker died
    output      ldconfig -> hook        its stdout and stderr    ldconfig ended
                                        (a stream, not framed)

A framed message is "<length>:<payload>", so that one cut short (a writer killed in
the middle of it) or garbled is told from a whole one, and a wrong one is an error
naming the pipe, never taken for another value.

On the server's socket (nvctk.hook.served, hooks/nvctk-hook.c the other end, which
fixes this format): the launcher sends the OCI state (at most MAX_HOOK_STATE bytes)
and shuts its side down; the server answers SERVED_ANSWER, one byte of exit code
then the text for the hook's stderr.

The worker reads and writes these in the container's mount namespace: nothing here
imports anything there (every import is at the top, before the worker forks).
"""

from __future__ import annotations

import os
import select
import time

from nvctk.base.errors import NvctkError
from nvctk.base.fileio import TooLarge, read_all, write_all
from nvctk.base.record import Record

# the bounds a reader puts on each message (a pid; three numbers; an error message)
PID_LIMIT = 64
LIBRARIES_LIMIT = 128
ANSWER_LIMIT = 1 << 20
SET_UP = b""  # the set-up pipe carries nothing: its EOF is the signal

_OK = b"ok"
_FAILED = b"error\n"


class MessageError(NvctkError):
    """A message garbled or cut short; its text names the pipe."""


class NoAnswer(NvctkError):
    """The writer sent nothing by the reader's deadline (and has not ended)."""


def _frame(payload: bytes) -> bytes:
    return b"%d:%s" % (len(payload), payload)


def _unframe(data: bytes, what: str) -> bytes | None:
    """The payload of a framed message; None: EOF alone (nothing was sent)."""
    if not data:
        return None
    head, sep, payload = data.partition(b":")
    if not sep or not head.isdigit() or len(head) > 9:
        raise MessageError(f"{what}: garbled message {data[:40]!r}")
    n = int(head)
    if len(payload) < n:
        raise MessageError(f"{what}: message cut short ({len(payload)} of {n} bytes)")
    if len(payload) > n:
        raise MessageError(f"{what}: garbled message ({len(payload) - n} bytes past its end)")
    return payload


def _ints(payload: bytes, count: int, what: str) -> list[int]:
    parts = payload.split(b" ")
    if len(parts) != count or not all(p.isdigit() for p in parts):
        raise MessageError(f"{what}: garbled message {payload[:40]!r}")
    return [int(p) for p in parts]


def encode_pid(pid: int) -> bytes:
    """PID: the container's pid, which the worker waits for before its first mount."""
    return _frame(b"%d" % pid)


def decode_pid(data: bytes) -> int | None:
    """The pid sent; None: cancelled (EOF alone). MessageError: garbled, cut, or 0."""
    payload = _unframe(data, "pid pipe")
    if payload is None:
        return None
    (pid,) = _ints(payload, 1, "pid pipe")
    if pid <= 0:
        raise MessageError(f"pid pipe: no container pid ({pid})")
    return pid


def encode_libraries_in(dev: int, ino: int, pid: int) -> bytes:
    """LIBRARIES_IN: the worker's libraries and links are in; the rootfs it mounted into
    (st_dev, st_ino of its own fd: ldconfig chroots into exactly that), the pid."""
    return _frame(b"%d %d %d" % (dev, ino, pid))


def decode_libraries_in(data: bytes) -> tuple[int, int, int] | None:
    """(dev, ino, pid) sent; None: the worker failed before its libraries were in."""
    payload = _unframe(data, "libraries pipe")
    if payload is None:
        return None
    dev, ino, pid = _ints(payload, 3, "libraries pipe")
    return dev, ino, pid


def decode_set_up(data: bytes) -> None:
    """SET_UP came (EOF: the ldconfig child exec'd ldconfig, or ended); MessageError
    for bytes, which that child never writes."""
    if data != SET_UP:
        raise MessageError(f"set-up pipe: garbled message {data[:40]!r} (want EOF alone)")


def encode_answer(err: str | None) -> bytes:
    """ANSWER: the worker's work done (err None), or failed with message err."""
    return _frame(_OK if err is None else _FAILED + err.encode("utf-8", "replace"))


def decode_answer(data: bytes) -> str | None:
    """The worker's error message; None: done. MessageError: no answer (EOF alone: the
    worker died or was cancelled), or one garbled or cut short."""
    payload = _unframe(data, "the worker's answer")
    if payload is None:
        raise MessageError("worker gave no answer")
    if payload == _OK:
        return None
    if payload.startswith(_FAILED):
        return payload[len(_FAILED):].decode("utf-8", "replace")
    raise MessageError(f"worker gave a garbled answer {payload[:40]!r}")


def decode_output(chunks: list[bytes]) -> str:
    """ldconfig's output as the log shows it."""
    return b"".join(chunks).decode("utf-8", "replace").strip()


def encode_served_answer(code: int, text: str) -> bytes:
    """SERVED_ANSWER: the prestart's exit code (a byte) and its stderr text."""
    return bytes((code & 0xFF,)) + text.encode("utf-8", "replace")


def decode_served_answer(data: bytes) -> tuple[int, str] | None:
    """What hooks/nvctk-hook.c reads of SERVED_ANSWER; None: the server ended without
    one (the launcher then fails the hook, saying so)."""
    if not data:
        return None
    return data[0], data[1:].decode("utf-8", "replace")


class Channel(Record):
    """One end of a pipe that carries one message (above): `send` writes it whole and
    closes, `recv` reads to EOF and closes. fd -1: closed, or never opened."""

    __slots__ = ("fd",)

    def __init__(self, fd: int = -1) -> None:
        self.fd = fd

    def send(self, data: bytes) -> None:
        """The message, then EOF (closed even when writing fails: OSError)."""
        try:
            write_all(self.fd, data)
        finally:
            self.close()

    def recv(self, limit: int, deadline: float | None = None) -> bytes:
        """Everything up to EOF, then closed: TooLarge past `limit` bytes; NoAnswer
        when EOF has not come by `deadline` (time.monotonic; None: wait for it)."""
        try:
            if deadline is not None:
                return self._recv_by(limit, deadline)
            return read_all(self.fd, limit)
        finally:
            self.close()

    def _recv_by(self, limit: int, deadline: float) -> bytes:
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        chunks: list[bytes] = []
        total = 0
        while True:
            # past the deadline, what is there already still counts (a poll of 0 ms)
            left = max(deadline - time.monotonic(), 0.0)
            if not poller.poll(left * 1000):
                raise NoAnswer(f"no EOF by the deadline ({total} bytes)")
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return b"".join(chunks)
            total += len(chunk)
            if total > limit:
                raise TooLarge(f"more than {limit} bytes")
            chunks.append(chunk)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            try:
                os.close(fd)
            except OSError:
                pass


def pipe() -> tuple[Channel, Channel]:
    """A pipe's (reader, writer), both close-on-exec."""
    r, w = os.pipe()
    return Channel(r), Channel(w)
