"""Paths inside a root directory (a driver root, a container's rootfs) resolved as if
it were /: absolute symlinks and `..` stay inside it.

A module of its own, apart from nvctk.host.driver: CDI mode's create resolves the
container's host binds and the CDI targets with it (nvctk.cdi.check.check_host_binds),
and needs none of the driver's file lists or the ld.so.cache parser.
"""

from __future__ import annotations

import os
import stat

from nvctk.base.errors import DriverError


def resolve_in_root(root: str, path: str, max_links: int = 40,
                    links_seen: dict[str, str | None] | None = None) -> str:
    """Host path of `path` (inside the root) with every symlink resolved as if the root
    were /: absolute link targets stay inside the root, `..` stops at the root.

    links_seen: host path -> link target (None: no link), filled and used across the
    calls of one look at an unchanging root (a driver's libraries share directories).
    """
    root = os.path.abspath(root)
    top = root.rstrip("/")  # "" for /: candidates are top + "/" + name
    parts = [p for p in path.split("/") if p and p != "."]
    resolved: list[str] = []  # the host path of each component resolved so far
    links = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = f"{resolved[-1] if resolved else top}/{part}"
        if links_seen is not None and candidate in links_seen:
            target = links_seen[candidate]
        else:
            target = _link_target(candidate)
            if links_seen is not None:
                links_seen[candidate] = target
        if target is not None:
            links += 1
            if links > max_links:
                raise DriverError(f"too many levels of symlinks resolving {path} in {root}")
            if target.startswith("/"):
                resolved = []
            parts = [p for p in target.split("/") if p and p != "."] + parts
            continue
        resolved.append(candidate)
    return resolved[-1] if resolved else root


def _link_target(path: str) -> str | None:
    """What the link at path points to; None when path is no link or does not exist."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
