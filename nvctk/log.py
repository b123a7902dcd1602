"""nvctk's own log, and error lines in runc's --log format.

containerd and Docker show the user the last `"level":"error"` line of the file
given to the runtime with --log, so an nvctk failure must land there in runc's
format (logrus JSON, or logfmt with --log-format text), besides stderr.

Nothing here may raise: logging must never turn a working create into a
failing one, nor hide the original error.
"""

from __future__ import annotations

import os
import sys
import time

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


def _now_rfc3339() -> str:
    # logrus writes time.RFC3339; UTC gives the "Z" suffix
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _append(path: str, line: str) -> bool:
    """Append one line with a single write (O_APPEND keeps concurrent writers whole)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        return False
    try:
        os.write(fd, (line.rstrip("\n") + "\n").encode("utf-8", "replace"))
        return True
    except OSError:
        return False
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
    import json  # only on the error path: json's import is not free

    return json.dumps({"level": level, "msg": msg, "time": when}, separators=(",", ":"))


def write_runc_log(
    path: str | None, msg: str, level: str = "error", log_format: str | None = "json"
) -> bool:
    """Append `msg` to runc's --log file (created when absent). False when not written."""
    if not path:
        return False
    return _append(path, runc_log_line(msg, level, log_format))


class Logger:
    """nvctk's own log file: '<time> <prog>[<pid>] <LEVEL>: <msg>' lines, level-filtered."""

    def __init__(self, path: str, level: str = "info", prog: str = "nvctk") -> None:
        self.path = path
        self.threshold = LEVELS.get(level, LEVELS["info"])
        self.prog = prog

    def log(self, level: str, msg: str) -> None:
        if LEVELS.get(level, 0) < self.threshold:
            return
        line = f"{_now_rfc3339()} {self.prog}[{os.getpid()}] {level.upper()}: {msg}"
        self._write(line.replace("\n", " | "))

    def _write(self, line: str) -> None:
        if self.path:
            _append(self.path, line)

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
    except (OSError, ValueError):
        pass
    write_runc_log(runc_log, f"nvctk: {msg}", "error", runc_log_format or "json")
    if logger is not None:
        logger.error(msg)
