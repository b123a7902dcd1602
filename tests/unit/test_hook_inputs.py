"""The hooks' one plan loader (nvctk.edits_file.load_edits) and their one entry
(nvctk.hook.entry.run): what is at the plan's path is read without blocking or
following, and every command's errors come out the same way."""

from __future__ import annotations

import io
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest

from nvctk.base import config as nvconfig
from nvctk.base.errors import MountError, SpecError
from nvctk.base.log import HookLog
from nvctk.edits import Edits, LogSettings, Mount, Vgpu
from nvctk.edits_file import EDITS_FILE, MAX_EDITS_BYTES, load_edits
from nvctk.hook import entry, poststop, prestart, worker
from nvctk.hook.entry import UsageError


@contextmanager
def no_block(seconds: int = 5) -> Iterator[None]:
    """Fail instead of hanging when the code under test blocks (a FIFO's open)."""
    def expired(signum: int, frame: object) -> None:
        raise AssertionError(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _plan(tmp: Path) -> Edits:
    return Edits("550.54.15", ("utility",), ("GPU-1",),
                 mounts=(Mount("/h/libnvidia-ml.so.1", "/usr/lib/libnvidia-ml.so.1"),),
                 vgpu=Vgpu("/l", "/run/nvctk/libvgpu.so", str(tmp / "state" / ("0" * 16 + "-c")),
                           "/run/nvctk/vgpu"))


def test_a_saved_form_reads_back(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    (tmp_path / EDITS_FILE).write_text(plan.to_json())
    assert load_edits(str(tmp_path)) == plan
    assert load_edits(str(tmp_path / "elsewhere")) is None  # no form: nothing to do


@pytest.mark.parametrize(("what", "why"), [
    ("fifo", "not a regular file"),
    ("symlink", "a symbolic link (never followed"),
    ("huge", f"larger than {MAX_EDITS_BYTES} bytes"),
    ("directory", "not a regular file"),
    ("garbage", "unusable form"),
    ("list", "unusable form"),
])
def test_what_is_not_a_form_is_refused_by_name_without_blocking(
        tmp_path: Path, what: str, why: str) -> None:
    path = tmp_path / EDITS_FILE
    real = tmp_path / "real.json"
    real.write_text(_plan(tmp_path).to_json())
    if what == "fifo":
        os.mkfifo(path)  # no writer: a plain open() would wait for one forever
    elif what == "symlink":
        path.symlink_to(real)  # a good plan behind it: still never followed
    elif what == "huge":
        with open(path, "wb") as f:
            f.truncate(MAX_EDITS_BYTES + 1)
    elif what == "directory":
        path.mkdir()
    elif what == "garbage":
        path.write_text("{not json")
    else:
        path.write_text("[1, 2]")
    with no_block(), pytest.raises(MountError) as e:
        load_edits(str(tmp_path))
    assert str(e.value).startswith(f"step edits: {path}: {why}"), str(e.value)


def _state(bundle: Path, cid: str = "c1", pid: int = 0) -> io.BytesIO:
    return io.BytesIO(f'{{"ociVersion": "1.0.2", "id": "{cid}", "pid": {pid}, '
                      f'"status": "stopped", "bundle": "{bundle}"}}'.encode())


def _poststop(bundle: Path, cfg: nvconfig.Config, *args: str) -> tuple[int, str]:
    err = io.StringIO()
    with mock.patch.dict(os.environ), no_block():  # the hook sanitizes the environment
        code = poststop.main(list(args), _state(bundle), err, config=cfg, log=HookLog(""))
    return code, err.getvalue()


def test_poststop_reads_the_plan_with_the_one_loader(tmp_path: Path) -> None:
    """Without --runtime-root, poststop names the dir from the plan: a FIFO there is
    the same clear error as for prestart, and no hang."""
    cfg = nvconfig.Config(state_dir=str(tmp_path / "state"))
    os.mkfifo(tmp_path / EDITS_FILE)
    code, err = _poststop(tmp_path, cfg)
    assert code == 1
    assert err == f"nvctk-hook: poststop: step edits: {tmp_path / EDITS_FILE}: not a regular " \
                  "file (nvctk-runtime writes one)\n"


def test_poststop_without_a_plan_has_nothing_to_do(tmp_path: Path) -> None:
    cfg = nvconfig.Config(state_dir=str(tmp_path / "state"))
    assert _poststop(tmp_path, cfg) == (0, "")


def test_poststop_bad_usage_is_exit_2(tmp_path: Path) -> None:
    cfg = nvconfig.Config(state_dir=str(tmp_path / "state"))
    code, err = _poststop(tmp_path, cfg, "--runtime-root")
    assert code == 2
    assert err.startswith("nvctk-hook: poststop: unexpected arguments ['--runtime-root']\n"
                          "usage: nvctk-hook poststop"), err


@pytest.mark.parametrize(("raised", "code", "message"), [
    (None, 0, ""),
    (SpecError("the spec is wrong"), 1, "nvctk-hook: x: the spec is wrong\n"),
    (FileNotFoundError(2, "No such file or directory", "/a/b"), 1,
     "nvctk-hook: x: /a/b: No such file or directory\n"),
    (KeyError("k"), 1, "nvctk-hook: x: internal error: KeyError('k')\n"),
    (entry.UsageError("--flag needs a value"), 2, "nvctk-hook: x: --flag needs a value\nUSE\n"),
])
def test_every_command_maps_errors_the_same_way(tmp_path: Path, raised: Exception | None,
                                                code: int, message: str) -> None:
    seen: list[entry.HookRun] = []

    def parse(args: list[str]) -> list[str]:
        if isinstance(raised, entry.UsageError):
            raise raised
        return args

    def body(hook: entry.HookRun) -> None:
        seen.append(hook)
        if raised is not None:
            raise raised

    err = io.StringIO()
    with mock.patch.dict(os.environ, {"LD_PRELOAD": "/x.so", "PYTHONPATH": "/y"}):
        got = entry.run("x", body, ["a"], parse=parse, usage="USE", stdin=_state(tmp_path),
                        stderr=err, log=HookLog(""))
        assert "LD_PRELOAD" not in os.environ and "PYTHONPATH" not in os.environ
    assert (got, err.getvalue()) == (code, message)
    if not isinstance(raised, entry.UsageError):
        assert seen[0].opts == ["a"] and seen[0].state.id == "c1"


def test_a_bad_state_is_exit_1_before_any_body(tmp_path: Path) -> None:
    err = io.StringIO()
    with mock.patch.dict(os.environ):
        got = entry.run("x", lambda hook: None, [], stdin=io.BytesIO(b"{}"), stderr=err,
                        log=HookLog(""))
    assert got == 1 and err.getvalue().startswith("nvctk-hook: x: hook state"), err.getvalue()


@pytest.mark.parametrize("pin", ["", "a/b", "..", "."])
def test_the_worker_pins_only_top_level_dirs_the_plan_lists(tmp_path: Path, pin: str) -> None:
    plan = Edits("", (), (), pins=(pin,))
    with pytest.raises(MountError, match="step edits: pin"):
        worker._pin(plan, None, None, HookLog(""))  # type: ignore[arg-type]


def test_without_a_plan_the_log_is_the_configs(tmp_path: Path) -> None:
    cfg = nvconfig.Config(log_file=str(tmp_path / "hook.log"), log_level="debug")

    def body(hook: entry.HookRun) -> None:
        hook.log.info("did it")

    with mock.patch.dict(os.environ):
        assert entry.run("x", body, [], stdin=_state(tmp_path), config=cfg) == 0
    text = (tmp_path / "hook.log").read_text()
    assert "x id=c1" in text and "INFO: did it" in text, text


def test_with_a_plan_the_log_is_the_plans_and_no_config_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_config(*args: object) -> None:
        raise AssertionError("the config was read")

    monkeypatch.setattr(nvconfig, "load", no_config)
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text('{"ociVersion": "1.0.2", "root": {"path": "rootfs"}}')
    plan = Edits("1", (), (), log=LogSettings(str(tmp_path / "plan.log"), "debug"))
    (bundle / EDITS_FILE).write_text(plan.to_json())
    seen: list[entry.HookRun] = []

    def body(hook: entry.HookRun) -> None:
        seen.append(hook)
        raise SpecError("it went wrong")

    err = io.StringIO()
    with mock.patch.dict(os.environ):
        code = entry.run("x", body, [], inputs=entry.EDITS, stdin=_state(bundle, pid=1),
                         stderr=err)
    assert (code, err.getvalue()) == (1, "nvctk-hook: x: it went wrong\n")
    assert seen[0].edits == plan and seen[0].rootfs == str(bundle / "rootfs")
    assert "ERROR: c1: x: it went wrong" in (tmp_path / "plan.log").read_text()


@pytest.mark.parametrize(("argv", "want"), [
    ([], None),
    (["--served", "0a1b"], "0a1b"),
    (["--served"], UsageError),
    (["--served", ""], UsageError),
    (["--served", "0a1b", "x"], UsageError),
    (["x"], UsageError),
])
def test_prestart_args(argv: list[str], want: str | type[Exception] | None) -> None:
    """`nvctk-hook prestart` takes nothing, or the runtime server's token."""
    if isinstance(want, type):
        with pytest.raises(want):
            prestart.parse_args(argv)
    else:
        assert prestart.parse_args(argv) == want
