"""Waiting for an event, the one way tests do it: `until` polls a predicate with a
deadline (short steps, backing off), `line` reads a child's pipe until a line says the
child got where the test waits for, `newest` waits on a condition for what a stream
appended. Never a fixed sleep: a slow machine only waits
longer, a fast one not at all."""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
from typing import IO, TypeVar

T = TypeVar("T")


def until(pred: Callable[[], T], timeout: float, what: str, poll: float = 0.05) -> T:
    """pred()'s first truthy value; AssertionError naming `what` after `timeout` s.
    `poll`: the longest step between checks (smaller for a state that lasts briefly)."""
    deadline = time.monotonic() + timeout
    step = 0.001
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)
        step = min(step * 2, poll)


def line(stream: IO[str], want: str, timeout: float, what: str = "") -> list[str]:
    """Lines read from `stream` (a text pipe nothing else has read from yet) up to and
    including the first that starts with `want`; AssertionError at EOF or after
    `timeout` s. Reads byte by byte, so what follows stays in the pipe for the next
    call (or communicate())."""
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    fd = stream.fileno()
    buf = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out waiting for {what or want!r}; read {seen}")
        if not select.select([fd], [], [], left)[0]:
            continue
        byte = os.read(fd, 1)
        if not byte:
            raise AssertionError(f"EOF before {what or want!r}; read {seen}")
        if byte != b"\n":
            buf += byte
            continue
        text = buf.decode(errors="replace")
        buf.clear()
        seen.append(text)
        if text.startswith(want):
            return seen


def newest(cond: threading.Condition, items: list[T], pred: Callable[[T], object],
           timeout: float, what: str) -> T:
    """The newest of `items` that pred() accepts, waiting on `cond` (notified by whoever
    appends to `items`, under it); TimeoutError naming `what` and the last item."""
    end = time.monotonic() + timeout
    with cond:
        while True:
            for item in reversed(items):
                if pred(item):
                    return item
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no matching {what}; last: {items[-1:]}")
            cond.wait(left)
