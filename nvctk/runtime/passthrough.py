"""Which low-level runtime the config names, for the runtime's passthrough.

runtime_shim/nvctk-runtime.c execs runc for every subcommand but create/run
without starting Python. It learns the config's `runtimes` from a cache that this
module writes whenever the runtime has loaded the config (a create, or a
passthrough the launcher could not serve): one file per config path, named by the
path's FNV-1a 64 hash as the launcher computes it, holding

    nvctk-passthrough 1
    <config path>
    <st_dev> <st_ino> <st_size> <mtime s> <mtime ns> <ctime s> <ctime ns>   or: absent
    <runtime>...

The stat is the one of the bytes the loader parsed: any write to the config
changes its ctime, a replaced file its inode, and the launcher then falls back to
Python, which reads the config afresh. "absent" is the loader's defaults for a path
with no file (the launcher serves it while the path stays absent). So the launcher
reads no TOML and knows no default of its own, and a file the loader rejects is
never served from the cache. Only root writes or trusts it.
"""

from __future__ import annotations

import os

# the cache dir is the config loader's too (its parsed-config cache)
from nvctk.base import stamped
from nvctk.base.config import (
    CACHE_VAR,
    Config,
    cache_dir,
    cache_name,
    config_path,
    load_stat,
)
from nvctk.base.errors import NvctkError

MAGIC = "nvctk-passthrough 1\n"
MAX_ENTRY = 65535  # nvctk-runtime.c reads less than CACHE_MAX (64 KiB)
DEFAULT_RUNTIMES = Config().runtimes


def use_cache_dir(directory: str) -> str:
    """Make `directory` this process's cache, and its children's (the environment): for
    a throw-away config (demo, bench, tests), whose entries must not stay in /run/nvctk.
    Made 0755: the launcher trusts no directory that others can write."""
    os.makedirs(directory, 0o755, exist_ok=True)
    os.chmod(directory, 0o755)  # whatever the umask made of it
    os.environ[CACHE_VAR] = directory
    return directory


def entry(path: str, st: os.stat_result | None, runtimes: tuple[str, ...]) -> bytes | None:
    """The cache file's bytes (st None: no file at path), or None where the launcher
    could not use them."""
    if not path.startswith("/") or any(not r or "\n" in r or "\0" in r for r in runtimes) \
            or "\n" in path:
        return None
    stamp = "absent" if st is None else (
        f"{st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns // 10**9} "
        f"{st.st_mtime_ns % 10**9} {st.st_ctime_ns // 10**9} {st.st_ctime_ns % 10**9}")
    return os.fsencode(f"{MAGIC}{path}\n{stamp}\n" + "".join(f"{r}\n" for r in runtimes))


def remember(path: str, st: os.stat_result | None, runtimes: tuple[str, ...],
             environ: dict[str, str] | os._Environ[str] | None = None) -> None:
    """Leave the launcher what the loader read from `path`; any failure is ignored
    (not root, a read-only /run): the launcher then asks Python each time."""
    data = entry(path, st, runtimes)
    if data is None or len(data) > MAX_ENTRY or os.geteuid() != 0 \
            or (st is not None and stamped.racy(st.st_ctime_ns)):
        return
    file = os.path.join(cache_dir(environ), cache_name(path))
    if stamped.read_cache(file, 0o644) == data:
        return  # every create finds it written already
    stamped.write_cache(file, data, 0o644)


def runtimes(environ: dict[str, str] | os._Environ[str] | None = None) -> tuple[
    tuple[str, ...], str | None
]:
    """(runtimes, warning) for a passthrough the launcher left to Python.

    Never fails: a broken config (unreadable, a FIFO, not UTF-8, malformed) yields
    the defaults and a warning, because a broken nvctk config must not stop
    `runc state/kill/delete` for every container on the node.
    """
    path = config_path(dict(environ) if environ is not None else None)
    try:
        config, st = load_stat(path, environ)
    except NvctkError as e:
        return DEFAULT_RUNTIMES, f"{e}; using runtimes {', '.join(DEFAULT_RUNTIMES)}"
    remember(path, st, config.runtimes, environ)
    return config.runtimes, None
