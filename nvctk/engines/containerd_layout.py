"""containerd's config files: which version a file is (and so which CRI plugin table
holds the runtimes), and which files --drop-in involves. Shared by configure
(nvctk.engines.containerd) and remove (nvctk.engines.containerd_remove)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Any

import tomlkit

from nvctk.engines.common import ConfigError, EngineRequest

DEFAULT_CONFIG = "/etc/containerd/config.toml"
PLUGIN = {
    1: ["plugins", "cri"],
    2: ["plugins", "io.containerd.grpc.v1.cri"],
    3: ["plugins", "io.containerd.cri.v1.runtime"],
    4: ["plugins", "io.containerd.cri.v1.runtime"],
}
KNOWN = ", ".join(map(str, list(PLUGIN)[:-1])) + f" and {list(PLUGIN)[-1]}"

Files = dict[str, "bytes | None"]


def containerd_version() -> tuple[int, int] | None:
    """(major, minor) of the installed containerd, None when it is not there."""
    exe = shutil.which("containerd")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    # "containerd github.com/containerd/containerd 1.6.20~ds1 ..." or ".../v2 v2.0.0 ..."
    fields = out.split()
    m = re.match(r"v?(\d+)\.(\d+)", fields[2]) if len(fields) >= 3 else None
    return (int(m.group(1)), int(m.group(2))) if m else None


def paths(req: EngineRequest) -> list[str]:
    main = req.config or DEFAULT_CONFIG
    return [main, req.drop_in] if req.drop_in else [main]


def is_empty(doc: tomlkit.TOMLDocument) -> bool:
    return len(doc) == 0


def config_version(doc: tomlkit.TOMLDocument, path: str) -> int:
    if is_empty(doc):
        v = containerd_version()
        if v is None or v < (2, 0):
            return 2
        return 3 if v < (2, 3) else 4
    ver = doc.get("version")
    if ver is None:
        return 1
    if isinstance(ver, bool) or not isinstance(ver, int) or ver not in PLUGIN:
        raise ConfigError(
            f"{path}: unknown containerd config version {ver!r} (nvctk knows {KNOWN}); "
            "left untouched"
        )
    return int(ver)


def plain(value: Any) -> Any:
    return value.unwrap() if hasattr(value, "unwrap") else value


def imports_glob(drop_in: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(drop_in)), "*.toml")
