"""runc's command line, and finding the low-level runtime to exec.

This module is on the passthrough path (`nvctk-runtime state|kill|delete|start ...`
runs it for every container operation), so it imports nothing but os and sys:
no dataclasses, typing, json, re or tomllib (each costs milliseconds, see the
shim's speed goal in the issue). Keep it that way.

Parsing follows runc (urfave/cli v1 on top of Go's flag package): global flags,
then the subcommand, then its flags and positional arguments in any order
(urfave reorders them). A flag is `-name`, `--name`, `-name=value` or
`--name=value`; a value flag takes the next token when no `=` is given. `--`
ends the flags. Only a bare token that is not a flag's value can be the
subcommand, so `--root create` and `--bundle create` are not creates.
"""

from __future__ import annotations

import os
import sys

# runc's global flags that take a value; the rest (--debug, --systemd-cgroup,
# --help, --version) are booleans.
GLOBAL_VALUE_FLAGS = frozenset({"log", "log-format", "root", "criu", "rootless"})
# create/run flags that take a value (runc 1.1: create; run adds booleans only).
CREATE_VALUE_FLAGS = frozenset(
    {"bundle", "b", "console-socket", "pid-file", "preserve-fds", "pidfd-socket"}
)
# Flags of the other subcommands that take a value; only used to find the
# container id in messages, never to decide anything.
OTHER_VALUE_FLAGS = frozenset(
    {"process", "p", "format", "f", "resources", "r", "interval", "cwd", "env", "e", "user",
     "u", "additional-gids", "g", "process-label", "apparmor", "cap", "c", "preserve-fds",
     "pid-file", "console-socket", "pidfd-socket", "image-path", "work-path", "parent-path",
     "page-server", "manage-cgroups-mode", "empty-ns", "status-fd", "lsm-profile",
     "lsm-mount-context", "blkio-weight", "cpu-period", "cpu-quota", "cpu-share",
     "cpu-rt-period", "cpu-rt-runtime", "cpuset-cpus", "cpuset-mems", "kernel-memory",
     "kernel-memory-tcp", "memory", "memory-reservation", "memory-swap", "pids-limit",
     "l3-cache-schema", "mem-bw-schema", "bundle", "b"}
)
CREATING = frozenset({"create", "run"})

DEFAULT_RUNTIMES = ("runc", "crun")
DEFAULT_CONFIG = "/etc/nvctk/config.toml"


class RuncArgs:
    """What nvctk needs from a runc command line. `argv` excludes argv[0]."""

    __slots__ = (
        "argv", "bundle", "container_id", "detach", "global_flags", "log", "log_format",
        "positionals", "root", "sub_flags", "sub_index", "subcommand",
    )

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.global_flags: dict[str, str | bool] = {}
        self.subcommand: str | None = None
        self.sub_index = -1  # index of the subcommand token in argv
        self.sub_flags: dict[str, str | bool] = {}
        self.positionals: list[str] = []
        self.log: str | None = None
        self.log_format: str | None = None
        self.root: str | None = None
        self.bundle = ""  # as given; "" = the current directory
        self.container_id: str | None = None
        self.detach = False

    @property
    def creates(self) -> bool:
        """True for `create` and `run`: the only subcommands that edit the bundle."""
        return self.subcommand in CREATING

    def bundle_dir(self, cwd: str | None = None) -> str:
        """The bundle as an absolute path (runc resolves it against its cwd, as do we)."""
        base = cwd if cwd is not None else os.getcwd()
        return os.path.normpath(os.path.join(base, self.bundle or "."))

    def __repr__(self) -> str:
        return (
            f"RuncArgs(subcommand={self.subcommand!r}, bundle={self.bundle!r}, "
            f"id={self.container_id!r}, global={self.global_flags!r}, sub={self.sub_flags!r})"
        )


def _split_flag(token: str) -> tuple[str, str | None]:
    """'--bundle=x' -> ('bundle', 'x'); '-b' -> ('b', None)."""
    name = token[2:] if token.startswith("--") else token[1:]
    if "=" in name:
        key, _, value = name.partition("=")
        return key, value
    return name, None


def _parse_flags(
    argv: list[str], start: int, value_flags: frozenset[str], stop_at_positional: bool
) -> tuple[dict[str, str | bool], list[str], int]:
    """Parse flags from argv[start:]; returns (flags, positionals, index where it stopped).

    With stop_at_positional (global flags) it stops at the first non-flag token,
    like Go's flag package; otherwise (subcommand flags, which urfave reorders)
    it collects positionals and keeps going until `--`, after which everything
    is positional.
    """
    flags: dict[str, str | bool] = {}
    positionals: list[str] = []
    i = start
    n = len(argv)
    while i < n:
        tok = argv[i]
        if tok == "--":
            positionals.extend(argv[i + 1 :])
            return flags, positionals, n
        if len(tok) < 2 or not tok.startswith("-"):
            # "-" alone is a positional for Go's flag package too
            if stop_at_positional:
                return flags, positionals, i
            positionals.append(tok)
            i += 1
            continue
        key, value = _split_flag(tok)
        if value is None and key in value_flags:
            if i + 1 < n:
                value = argv[i + 1]
                i += 1
            else:
                value = ""  # runc will complain "flag needs an argument"; we pass it on
        flags[key] = True if value is None else value
        i += 1
    return flags, positionals, i


def parse(argv: list[str]) -> RuncArgs:
    """Parse a runc command line without argv[0]. Never raises: runc judges bad input."""
    args = RuncArgs(list(argv))
    gflags, _, idx = _parse_flags(argv, 0, GLOBAL_VALUE_FLAGS, stop_at_positional=True)
    args.global_flags = gflags
    for key, attr in (("log", "log"), ("log-format", "log_format"), ("root", "root")):
        value = gflags.get(key)
        if isinstance(value, str):
            setattr(args, attr, value)
    if idx >= len(argv):
        return args
    args.subcommand = argv[idx]
    args.sub_index = idx
    value_flags = CREATE_VALUE_FLAGS if args.subcommand in CREATING else OTHER_VALUE_FLAGS
    sflags, positionals, _ = _parse_flags(argv, idx + 1, value_flags, stop_at_positional=False)
    args.sub_flags = sflags
    args.positionals = positionals
    if positionals:
        args.container_id = positionals[0]
    if args.subcommand in CREATING:
        # runc's flag is "bundle, b"; the last occurrence wins, as in Go's flag package
        bundle = _last_value(argv, idx + 1, ("bundle", "b"), CREATE_VALUE_FLAGS)
        if bundle is not None:
            args.bundle = bundle
        det = sflags.get("detach", sflags.get("d", False))
        args.detach = det is True or (isinstance(det, str) and det.lower() in ("true", "1"))
    return args


def _last_value(
    argv: list[str], start: int, names: tuple[str, ...], value_flags: frozenset[str]
) -> str | None:
    """The value of the last of several aliases of one flag (dicts lose their order)."""
    found: str | None = None
    i = start
    n = len(argv)
    while i < n:
        tok = argv[i]
        if tok == "--":
            break
        if len(tok) >= 2 and tok.startswith("-"):
            key, value = _split_flag(tok)
            if value is None and key in value_flags:
                value = argv[i + 1] if i + 1 < n else ""
                i += 1
            if key in names and value is not None:
                found = value
        i += 1
    return found


# --- the low-level runtime -------------------------------------------------------------


def _unquote_toml_string(s: str, i: int) -> tuple[str, int] | None:
    """Parse one TOML basic ("...") or literal ('...') string at s[i]; None if unusual."""
    quote = s[i]
    j = i + 1
    out: list[str] = []
    while j < len(s):
        c = s[j]
        if c == quote:
            return "".join(out), j + 1
        if c == "\\" and quote == '"':
            nxt = s[j + 1 : j + 2]
            if nxt in ('"', "\\"):
                out.append(nxt)
                j += 2
                continue
            return None  # \n, \u... in a runtime path: let the real parser handle it
        out.append(c)
        j += 1
    return None


def _scan_string_array(text: str) -> list[str] | None:
    """Parse `[ "a", 'b', ]` (comments and newlines allowed); None if it is anything else."""
    i = 0
    n = len(text)
    items: list[str] = []
    if not text.startswith("["):
        return None
    i = 1
    expect_item = True
    while i < n:
        c = text[i]
        if c in " \t\r\n":
            i += 1
        elif c == "#":
            nl = text.find("\n", i)
            if nl < 0:
                return None
            i = nl + 1
        elif c == "]":
            return items
        elif c == "," and not expect_item:
            expect_item = True
            i += 1
        elif c in "\"'" and expect_item:
            if text.startswith(c * 3, i):
                return None
            parsed = _unquote_toml_string(text, i)
            if parsed is None:
                return None
            items.append(parsed[0])
            i = parsed[1]
            expect_item = False
        else:
            return None
    return None


# Structure no real config has (it is a few KiB of short lines), refused before any
# parse: tomllib is quadratic in a key's dotted parts (a 100 KB key took 34 s).
MAX_LINE = 8192
MAX_DOTTED_PARTS = 16
# the scan's own cost is bounded by its lines and strings (C-speed counts check both)
MAX_LINES = 1024
MAX_QUOTES = 1024


def _string_end(line: str, i: int, quote: str) -> int:
    """Index just past the one-line string opened at line[i]; -1 if not closed."""
    j = i + 1
    while True:
        j = line.find(quote, j)
        if j < 0:
            return -1
        if quote == "'":
            return j + 1
        k = j
        while line[k - 1] == "\\":
            k -= 1
        if (j - k) % 2 == 0:  # an even run of backslashes: this quote closes
            return j + 1
        j += 1


def _ml_end(line: str, i: int, delim: str) -> int:
    """Index just past the closing `delim` (\"\"\" or ''') at or after line[i]; -1 if none."""
    j = i
    while True:
        j = line.find(delim, j)
        if j < 0:
            return -1
        if delim == "'''" or j == 0 or line[j - 1] != "\\":
            end = j + 3
            while end < len(line) and line[end] == delim[0]:  # \"\"\"\"\" closes at the last three
                end += 1
            return end
        j += 1


def scan_config(text: str) -> tuple[int, str | None]:
    """One linear pass over nvctk's TOML config: (offset of the value of the top-level
    `runtimes` key or -1, and why the file is refused or None).

    It follows strings (one-line, multi-line, escapes), comments and [ ] { } nesting,
    so a `runtimes` line inside a string or an array is not taken for the key. Refused:
    a line over MAX_LINE bytes, more than MAX_DOTTED_PARTS dotted parts on a line
    outside strings (a key, a table header; no config value is a float), more than
    MAX_LINES lines or MAX_QUOTES quote characters (a real config: ~100 and ~60), and a
    second top-level `runtimes` (which of the two applies would be a guess).
    """
    lines = text.count("\n") + 1
    if lines > MAX_LINES:
        return -1, f"{lines} lines, more than {MAX_LINES}: not an nvctk config"
    if text.count('"') + text.count("'") > MAX_QUOTES:
        return -1, f"more than {MAX_QUOTES} quote characters: not an nvctk config"
    depth = 0
    ml = ""  # the open multi-line string's delimiter
    in_table = False
    value_at = -1
    key_line = 0
    offset = 0
    for n, line in enumerate(text.split("\n"), 1):
        line_at = offset
        offset += len(line) + 1
        if len(line) > MAX_LINE:
            return -1, f"line {n} is longer than {MAX_LINE} bytes: not an nvctk config"
        i = 0
        if ml:
            i = _ml_end(line, 0, ml)
            if i < 0:
                continue
            ml = ""
        elif depth == 0:
            stripped = line.lstrip(" \t")
            if stripped.startswith("["):
                in_table = True
            elif not in_table:
                for key in ("runtimes", '"runtimes"', "'runtimes'"):
                    if stripped.startswith(key):
                        rest = stripped[len(key):].lstrip(" \t")
                        if rest.startswith("="):
                            if value_at >= 0:
                                return -1, (f"line {n}: runtimes is set a second time "
                                            f"(first on line {key_line})")
                            key_line = n
                            value_at = line_at + len(line) - len(rest) + 1
                        break
        # the parts outside strings and comments, found with str.find/count (C
        # speed: a character loop in Python costs ~10 ms on a 64 KiB file)
        dots = 0
        end = len(line)
        nxt = {c: line.find(c, i) for c in ('"', "'", "#")}
        while i < end:
            for c, at in nxt.items():
                if 0 <= at < i:
                    nxt[c] = line.find(c, i)
            found = [at for at in nxt.values() if at >= 0]
            stop = min(found) if found else end
            dots += line.count(".", i, stop)
            depth += (line.count("[", i, stop) + line.count("{", i, stop)
                      - line.count("]", i, stop) - line.count("}", i, stop))
            depth = max(depth, 0)
            if stop == end or line[stop] == "#":
                break
            c = line[stop]
            if line.startswith(c * 3, stop):
                i = _ml_end(line, stop + 3, c * 3)
                if i < 0:
                    ml = c * 3
                    break
            else:
                i = _string_end(line, stop, c)
                if i < 0:
                    break  # unterminated: the parser will say so
        if dots >= MAX_DOTTED_PARTS:
            return -1, (f"line {n}: a key or table header with more than "
                        f"{MAX_DOTTED_PARTS} dotted parts: not an nvctk config")
    return value_at, None


def check_config(text: str) -> str | None:
    """Why `text` is refused before any TOML parse (scan_config), or None."""
    return scan_config(text)[1]


def fast_runtimes(text: str) -> tuple[str, ...] | None:
    """The top-level `runtimes` key of nvctk's TOML config, read without tomllib.

    tomllib's import alone costs ~10 ms, more than the whole budget of the
    passthrough path. Returns the default when the key is absent, and None when
    the value is anything but a plain array of strings, or scan_config refuses
    the file (the caller then says why: read_runtimes).
    """
    value_at, error = scan_config(text)
    return None if error is not None else _runtimes_at(text, value_at)


def _runtimes_at(text: str, value_at: int) -> tuple[str, ...] | None:
    if value_at < 0:
        return DEFAULT_RUNTIMES
    items = _scan_string_array(text[value_at:].lstrip(" \t"))
    return tuple(items) if items is not None else None


def _is_executable_file(path: str) -> bool:
    try:
        st = os.stat(path)
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return False
    return (st.st_mode & 0o170000) == 0o100000 and os.access(path, os.X_OK)


def _is_self(path: str, self_paths: tuple[str, ...]) -> bool:
    real = os.path.realpath(path)
    for own in self_paths:
        if real == own:
            return True
        try:
            if os.path.samefile(path, own):
                return True
        except OSError:
            pass
    return False


def self_paths(argv0: str | None = None) -> tuple[str, ...]:
    """Paths that are nvctk-runtime itself: never exec them (that would loop forever)."""
    p = argv0 if argv0 is not None else sys.argv[0]
    if not p:
        return ()
    if os.sep not in p:  # started by name: the first match on PATH is what ran
        for d in os.environ.get("PATH", os.defpath).split(":"):
            cand = os.path.join(d or ".", p)
            if _is_executable_file(cand):
                p = cand
                break
        else:
            return ()
    # sys.executable is the interpreter, not us: only the script itself counts
    return (os.path.realpath(p),)


def find_runtime(
    candidates: tuple[str, ...] | list[str],
    path_env: str | None = None,
    exclude: tuple[str, ...] | None = None,
) -> str | None:
    """First of `candidates` (names on PATH or absolute paths) that exists and is not us."""
    own = self_paths() if exclude is None else exclude
    dirs = (os.environ.get("PATH", os.defpath) if path_env is None else path_env).split(":")
    for cand in candidates:
        if not cand:
            continue
        if os.sep in cand:
            paths = [cand]
        else:
            paths = [os.path.join(d or ".", cand) for d in dirs]
        for p in paths:
            if _is_executable_file(p) and not _is_self(p, own):
                return p
    return None


class NotRegularFile(OSError):
    """A path nvctk reads at container start is a FIFO, device, socket or directory."""


# a real config is under 4 KiB: anything far larger is not one (and would cost time)
MAX_CONFIG_BYTES = 64 << 10


def _why(limit: int) -> str:
    return " (a real nvctk config is under 4 KiB)" if limit == MAX_CONFIG_BYTES else ""


def read_regular_file(path: str, limit: int = MAX_CONFIG_BYTES, *,
                      nofollow: bool = False) -> bytes:
    """The bytes of a regular file, read without ever blocking.

    O_NONBLOCK|O_NOCTTY then fstat: a FIFO (which would wait for a writer), a
    device or a socket is refused with NotRegularFile before anything is read.
    More than `limit` bytes is an OSError too. FileNotFoundError as open() has it.
    nofollow: a symlink as the last component is an OSError (ELOOP) too.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
                 | (os.O_NOFOLLOW if nofollow else 0))
    try:
        st = os.fstat(fd)
        if (st.st_mode & 0o170000) != 0o100000:
            raise NotRegularFile(f"not a regular file: {path}")
        if st.st_size > limit:
            raise OSError(f"larger than {limit} bytes{_why(limit)}: {path}")
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks)
            total += len(chunk)
            if total > limit:
                raise OSError(f"larger than {limit} bytes{_why(limit)}: {path}")
            chunks.append(chunk)
    finally:
        os.close(fd)


def read_runtimes(environ: dict[str, str] | os._Environ[str] | None = None) -> tuple[
    tuple[str, ...], str | None
]:
    """(runtimes, warning) from nvctk's config for the passthrough path.

    Never fails and never blocks: a broken config (unreadable, not UTF-8, a FIFO,
    malformed) yields the defaults plus a warning, because a broken nvctk config
    must not stop `runc state/kill/delete` for every container on the node.
    """
    env = os.environ if environ is None else environ
    path = env.get("NVCTK_CONFIG") or DEFAULT_CONFIG
    try:
        data = read_regular_file(path)
    except FileNotFoundError:
        return DEFAULT_RUNTIMES, None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        return DEFAULT_RUNTIMES, f"{path}: cannot read ({e}); using runtimes {DEFAULT_RUNTIMES}"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        # a stray byte elsewhere must not cost the runtimes line: the scanner reads
        # it (surrogateescape gives os calls the file's own bytes back); the full
        # parser is not asked about a file that is not text
        loose = data.decode("utf-8", "surrogateescape")
        value_at, error = scan_config(loose)
        if error is not None:
            return DEFAULT_RUNTIMES, f"{path}: {error}; using runtimes {DEFAULT_RUNTIMES}"
        fast = _runtimes_at(loose, value_at)
        warning = f"{path}: not UTF-8 (invalid byte at offset {e.start})"
        if fast and all(r and "\0" not in r for r in fast):
            return fast, f"{warning}; using its runtimes {fast}"
        return DEFAULT_RUNTIMES, f"{warning}; using runtimes {DEFAULT_RUNTIMES}"
    value_at, error = scan_config(text)
    if error is not None:  # what config.parse refuses too, before any slow parse
        return DEFAULT_RUNTIMES, f"{path}: {error}; using runtimes {DEFAULT_RUNTIMES}"
    fast = _runtimes_at(text, value_at)
    if fast and all(r and "\0" not in r for r in fast):
        return fast, None
    # an empty list or a NUL is invalid: config.parse says so, and the defaults apply
    # slow path: a config the scanner could not read; the real parser decides
    from nvctk.config import parse as parse_config
    from nvctk.errors import NvctkError

    try:
        return parse_config(text, path).runtimes, None
    except NvctkError as e:
        return DEFAULT_RUNTIMES, f"{e}; using runtimes {DEFAULT_RUNTIMES}"
