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
    like Go's flag package, or just past a `--` (which Go drops: the token after it is
    then the subcommand); otherwise (subcommand flags, which urfave reorders) it
    collects positionals and keeps going until `--`, after which everything is
    positional.
    """
    flags: dict[str, str | bool] = {}
    positionals: list[str] = []
    i = start
    n = len(argv)
    while i < n:
        tok = argv[i]
        if tok == "--":
            if stop_at_positional:
                return flags, positionals, i + 1
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


# set on the runtime nvctk-runtime execs (runtime_shim/nvctk-runtime.c HOP_VAR), which
# refuses to start under it: a copy of nvctk-runtime named like the configured runtime
# (two copies, each first on PATH for the other) must not exec back and forth forever
HOP_VAR = "NVCTK_RUNTIME_HOP"


def exec_runtime(runtime: str, argv: list[str]) -> None:
    """Replace this process with the low-level runtime (argv without argv[0]);
    OSError if it cannot be started."""
    os.environ[HOP_VAR] = "1"
    try:
        os.execv(runtime, [runtime, *argv])
    finally:
        os.environ.pop(HOP_VAR, None)
