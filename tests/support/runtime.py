"""nvctk-runtime driven as a subprocess on the session's simulated host: a config whose
low-level runtime is a recording fake runc (Env), bundles from runc's default spec, the
create argv, the OCI schema check, and what a clean failure looks like (exit 1, one
message on stderr and in runc's --log, runc never started)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nvctk.edits_file import EDITS_FILE
from nvctk.runtime import create
from nvctk.sim.host import SimHost

BIN = os.path.dirname(sys.executable)
RUNTIME = os.path.join(BIN, "nvctk-runtime")
SCHEMA = Path(__file__).resolve().parents[2].parent / "shared/schemas/oci-runtime/config-schema.json"
NVD = "NVIDIA_VISIBLE_DEVICES"


class Env:
    def __init__(self, tmp: Path, sim: SimHost) -> None:
        self.tmp = tmp
        self.sim = sim
        self.record = tmp / "argv.txt"
        self.fake = tmp / "fake-runc"
        self.fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {self.record}\n')
        self.fake.chmod(0o755)
        text = Path(sim.config_path).read_text()
        self.config = tmp / "config.toml"
        self.config.write_text(
            re.sub(r"(?m)^runtimes = .*$", f'runtimes = ["{self.fake}"]', text)
        )
        self.log = tmp / "log.json"

    def run(self, *argv: str, config: str | None = None, cwd: str | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "NVCTK_CONFIG": config or str(self.config)}
        return subprocess.run([RUNTIME, *argv], env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)

    def recorded(self) -> list[str] | None:
        if not self.record.exists():
            return None
        return self.record.read_text().splitlines()


@pytest.fixture
def env(tmp_path: Path, sim_host: SimHost) -> Env:
    return Env(tmp_path, sim_host)


def bundle_maker(tmp_path: Path, rootfs: Callable[..., str],
                 args: list[str]) -> Callable[..., Path]:
    """make(envvars, name="bundle", edit=None) -> bundle dir with a runc-spec config.json
    running `args`; the spec is written with json.dumps' ensure_ascii (a lone surrogate
    in a value becomes a "\\udXXX" escape)."""

    def make(envvars: dict[str, str] | None = None, name: str = "bundle",
             edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
        b = tmp_path / name
        b.mkdir()
        shutil.move(rootfs(), b / "rootfs")
        subprocess.run(["runc", "spec", "--bundle", str(b)], check=True)
        spec = json.loads((b / "config.json").read_text())
        spec["process"]["env"] += [f"{k}={v}" for k, v in (envvars or {}).items()]
        spec["process"]["args"] = args
        spec["process"]["terminal"] = False
        if edit:
            edit(spec)
        (b / "config.json").write_text(json.dumps(spec, indent="\t"))
        return b

    return make


@pytest.fixture
def bundle(tmp_path: Path, rootfs: Callable[..., str]) -> Callable[..., Path]:
    return bundle_maker(tmp_path, rootfs, ["true"])


def create_argv(env: Env, b: Path, cid: str = "c1") -> list[str]:
    return ["--root", str(env.tmp / "runc-root"), "--log", str(env.log), "--log-format", "json",
            "create", "--bundle", str(b), "--pid-file", str(b / "init.pid"), cid]


def snapshot(p: Path) -> tuple[bytes, int, int]:
    st = p.stat()
    return p.read_bytes(), st.st_ino, st.st_mtime_ns


def validate_schema(spec: dict[str, Any]) -> None:
    if not SCHEMA.exists():
        pytest.skip(f"OCI schema not found at {SCHEMA} (../shared absent)")
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT4

    # the schema's files $ref each other by bare file name ("defs.json#/...")
    resources = []
    for f in SCHEMA.parent.glob("*.json"):
        res = Resource.from_contents(json.loads(f.read_text()), default_specification=DRAFT4)
        resources += [(f.name, res), (f.as_uri(), res)]
    registry: Registry[Any] = Registry().with_resources(resources)
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft4Validator(schema, registry=registry).validate(spec)


def path_with_fake_runc(env: Env) -> dict[str, str]:
    """PATH with a recording `runc` first: what the default runtimes find."""
    runc_dir = env.tmp / "pathbin"
    runc_dir.mkdir(exist_ok=True)
    if not (runc_dir / "runc").exists():
        (runc_dir / "runc").symlink_to(env.fake)
    return {**os.environ, "NVCTK_CONFIG": str(env.config),
            "PATH": f"{runc_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


def runc_log_errors(env: Env) -> list[str]:
    lines = [json.loads(x) for x in env.log.read_text().splitlines() if x.strip()]
    return [str(x["msg"]) for x in lines if x.get("level") == "error"]


def assert_clean_failure(env: Env, r: subprocess.CompletedProcess[str], needle: str) -> None:
    """Exit 1, one message with the needle on stderr and in runc's --log, no traceback,
    no internal error, runc never started."""
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert create.INTERNAL_ERROR not in r.stderr, r.stderr
    assert needle in r.stderr, r.stderr
    errors = runc_log_errors(env)
    assert errors and needle in errors[-1] and errors[-1].startswith("nvctk: "), errors
    assert env.recorded() is None


def assert_passed_through(env: Env, b: Path) -> None:
    """A create of bundle b goes to runc as it came: exit 0, runc got the argv, config.json
    untouched (bytes, inode, mtime), no plan file."""
    before = snapshot(b / "config.json")
    argv = create_argv(env, b)
    r = env.run(*argv)
    assert r.returncode == 0, r.stderr
    assert env.recorded() == argv
    assert snapshot(b / "config.json") == before
    assert not (b / EDITS_FILE).exists()
