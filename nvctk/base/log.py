"""nvctk's own log, and error lines in runc's --log format.

containerd and Docker show the user the last `"level":"error"` line of the file
given to the runtime with --log, so an nvctk failure must land there in runc's
format (logrus JSON, or logfmt with --log-format text), besides stderr.

Nothing here may raise: logging must never turn a working create into a
failing one, nor hide the original error.

The shim and the prestart hook log at debug level on some hosts, a few dozen
lines per GPU container start: a Logger opens its file once (O_APPEND: every
line is one write(2), whole even with concurrent writers) and formats the time
stamp once per second.
"""

from __future__ import annotations

import os
import sys
import time

from nvctk.base import jsonio

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}

_stamp: tuple[int, str] = (-1, "")


def _now_rfc3339() -> str:
    # logrus writes time.RFC3339; UTC gives the "Z" suffix
    global _stamp
    now = int(time.time())
    if now != _stamp[0]:
        _stamp = (now, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)))
    return _stamp[1]


_S_IFMT, _S_IFREG, _S_IFIFO = 0o170000, 0o100000, 0o010000


def _open_append(path: str, fifo_ok: bool = False) -> int:
    """An O_APPEND fd of path (created 0644), or -1.

    Never blocks: O_NONBLOCK makes a FIFO without a reader fail (ENXIO) instead
    of waiting for one, O_NOCTTY keeps a terminal from becoming ours. Only a
    regular file is kept (fifo_ok: a FIFO too, for runc's --log, which an engine
    may read through one; its writes then stay non-blocking).
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                     | os.O_NONBLOCK | os.O_NOCTTY, 0o644)
    except (OSError, ValueError):
        return -1
    try:
        kind = os.fstat(fd).st_mode & _S_IFMT
    except OSError:
        kind = -1
    if kind == _S_IFREG or (fifo_ok and kind == _S_IFIFO):
        return fd
    os.close(fd)
    return -1


def open_log(path: str, make_dirs: bool = False) -> int:
    """An O_APPEND fd of nvctk's own log file (a regular file only, opened without
    ever blocking: see _open_append), or -1; make_dirs creates a missing parent."""
    fd = _open_append(path)
    if fd < 0 and make_dirs and path:
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        except (OSError, ValueError):
            return -1
        fd = _open_append(path)
    return fd


def _write_line(fd: int, line: str) -> bool:
    """One line with a single write (O_APPEND keeps concurrent writers whole)."""
    try:
        os.write(fd, (line.rstrip("\n") + "\n").encode("utf-8", "replace"))
        return True
    except OSError:
        return False


def _append(path: str, line: str, fifo_ok: bool = False) -> bool:
    fd = _open_append(path, fifo_ok)
    if fd < 0:
        return False
    try:
        return _write_line(fd, line)
    finally:
        os.close(fd)


def _logfmt_quote(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def runc_log_line(msg: str, level: str = "error", log_format: str | None = "json") -> str:
    """One line as runc writes it: {"level":"error","msg":"...","time":"...Z"}."""
    when = _now_rfc3339()
    if log_format == "text":
        return f"time={_logfmt_quote(when)} level={level} msg={_logfmt_quote(msg)}"
    return jsonio.dumps({"level": level, "msg": msg, "time": when})


def write_runc_log(
    path: str | None, msg: str, level: str = "error", log_format: str | None = "json"
) -> bool:
    """Append `msg` to runc's --log file (created when absent). False when not written."""
    if not path:
        return False
    return _append(path, runc_log_line(msg, level, log_format), fifo_ok=True)


class Logger:
    """nvctk's own log file: '<time> <prog>[<pid>] <LEVEL>: <msg>' lines, level-filtered.

    The file is opened at the first line written and kept open (close() ends
    that); a file that cannot be opened is retried at the next line.
    """

    def __init__(self, path: str, level: str = "info", prog: str = "nvctk") -> None:
        self.path = path
        self.threshold = LEVELS.get(level, LEVELS["info"])
        self.prog = prog
        self.fd = -1

    def enabled(self, level: str) -> bool:
        """Whether a line of this level would be written (skip building costly messages)."""
        return LEVELS.get(level, 0) >= self.threshold

    def log(self, level: str, msg: str) -> None:
        if LEVELS.get(level, 0) < self.threshold:
            return
        # the pid is read per line: a forked worker logs under its own
        line = f"{_now_rfc3339()} {self.prog}[{os.getpid()}] {level.upper()}: {msg}"
        self._write(line.replace("\n", " | "))

    def _write(self, line: str) -> None:
        if self.fd < 0:
            if not self.path:
                return
            self.fd = _open_append(self.path)
            if self.fd < 0:
                return
        _write_line(self.fd, line)

    def close(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1

    def debug(self, msg: str) -> None:
        self.log("debug", msg)

    def info(self, msg: str) -> None:
        self.log("info", msg)

    def warning(self, msg: str) -> None:
        self.log("warning", msg)

    def error(self, msg: str) -> None:
        self.log("error", msg)


def report_error(
    msg: str,
    *,
    prog: str = "nvctk-runtime",
    runc_log: str | None = None,
    runc_log_format: str | None = None,
    logger: Logger | None = None,
) -> None:
    """The three places an error goes: stderr, runc's --log file, nvctk's own log."""
    try:
        sys.stderr.write(f"{prog}: {msg}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # UnicodeEncodeError too: a lone surrogate, a strict stderr
        pass
    write_runc_log(runc_log, f"nvctk: {msg}", "error", runc_log_format or "json")
    if logger is not None:
        logger.error(msg)


def exit_now(code: int) -> NoReturn:
    """End the process without the interpreter's teardown (module and object
    cleanup, a part of a container start), as the exec it often stands for would.
    For callers with nothing left to clean up: only stdio is flushed."""
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class HookLog(Logger):
    """nvctk's log, written through an fd opened in the host namespace.

    The worker changes mount namespace and ldconfig chroots into the image: a
    log that re-opened its path would then write into the container. So the
    file is opened here, once, and never by path again.
    """

    def __init__(self, path: str, level: str = "info", prog: str = "nvctk-hook") -> None:
        super().__init__("", level, prog)
        if not path:
            return
        # never blocks (a FIFO log-file would hang the hook until runc's timeout)
        self.fd = open_log(path, make_dirs=True)
