"""The one way into every nvctk-hook command: inputs read, errors mapped, the same way.

    run(cmd, body, argv, parse=..., inputs=...)

    1. sanitize the environment (nothing steers Python or the loader from here on)
    2. parse the arguments: UsageError -> exit 2, "nvctk-hook: <cmd>: <why>" + usage
    3. read and parse the OCI state on stdin
    4. as the command asks (`inputs`): the spec and the rootfs (STATE < ROOTFS < EDITS),
       the form (nvctk.edits_file.load_edits, the one form loader) read only once the
       rootfs is known not to hold the bundle
    5. open the log from the form's log settings (the hook loads no config for it;
       without a form, the config's)
    6. the command's body; then exit 0

Errors: an NvctkError is exit 1 with "nvctk-hook: <cmd>: <message>" on stderr (and in
the log); an OSError the same, naming its file; anything else is a bug: exit 1 with
"nvctk-hook: <cmd>: internal error: <repr>". runc shows the hook's stderr when it fails.
"""

from __future__ import annotations

import sys
import time

from nvctk.base.errors import NvctkError, SpecError
from nvctk.base.fileio import MAX_HOOK_STATE
from nvctk.base.log import HookLog
from nvctk.base.record import Record
from nvctk.edits import HOOK_NAME
from nvctk.edits_file import EDITS_FILE, edits_path, load_edits, parse_edits, read_edits
from nvctk.hook.inputs import (
    HookState,
    parse_state,
    rootfs_path,
    sanitize_environ,
)
from nvctk.oci.spec import (
    check_bundle_outside_rootfs,
    load_spec_as_runc,
    parse_spec_as_runc,
    read_spec,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import IO, Any

    from nvctk.base.config import Config
    from nvctk.edits import Edits

# what a command needs read before its body runs (each includes the ones before it)
STATE = 0  # the OCI state on stdin
ROOTFS = 1  # + the spec (as runc reads it) and the rootfs; the container has a pid
EDITS = 2  # + the form nvctk-runtime saved in the bundle; none: nothing to do


class UsageError(ValueError):
    """Bad arguments to a hook command: exit 2 with the usage."""


class HookRun(Record):
    """What a command's body is given: its inputs, read by `run`, and the open log."""

    __slots__ = ("cmd", "opts", "state", "spec", "rootfs", "edits", "log",  # noqa: RUF023
                 "early", "started", "_config")

    def __init__(self, cmd: str, opts: Any, state: HookState, log: HookLog,
                 spec: dict[str, Any] | None = None, rootfs: str | None = None,
                 edits: Edits | None = None, config: Config | None = None) -> None:
        self.cmd = cmd
        self.opts = opts  # what `parse` made of the arguments
        self.state = state
        self.spec = spec
        self.rootfs = rootfs
        self.edits = edits
        self.log = log  # nowhere until the form names the log (or the body opens one)
        self.early: Early | None = None  # the inputs came from it (run's `early`)
        self.started = time.monotonic()  # runc's hook timeout counts from about here
        self._config = config

    def deadline(self) -> float | None:
        """When runc gives up on this hook (its entry's `timeout` in the spec, counted
        from the hook's start), on time.monotonic's clock; None: no timeout."""
        hooks = (self.spec or {}).get("hooks")
        entries = hooks.get(self.cmd) if isinstance(hooks, dict) else None
        for h in entries if isinstance(entries, list) else ():
            args = h.get("args") if isinstance(h, dict) else None
            if isinstance(args, list) and args[:2] == [HOOK_NAME, self.cmd]:
                timeout = h.get("timeout")
                if isinstance(timeout, int) and not isinstance(timeout, bool) and timeout > 0:
                    return self.started + timeout
        return None

    def config(self) -> Config:
        """nvctk's config, read at the first call: only for what the form does not carry
        (poststop's state dir; the log when there is no form)."""
        if self._config is None:
            from nvctk.base import config as nvconfig  # off the GPU start's path

            self._config = nvconfig.load()
        return self._config


def log_for(hook: HookRun) -> HookLog:
    """The hook's log, as the form says (file, level). Without a form (a command that
    reads none, or a container nvctk-runtime made none for) or with one written before
    the form carried log settings: the config's, read only then."""
    settings = None if hook.edits is None else hook.edits.log
    if settings is None:
        config = hook.config()
        return HookLog(config.log_file, config.log_level)
    return HookLog(settings.file, settings.level)


def _read_inputs(run_: HookRun, inputs: int) -> str | None:
    """Fill run_'s spec, rootfs and form as `inputs` asks; a str: nothing to do, why."""
    state = run_.state
    if inputs < ROOTFS:
        return None
    if state.pid <= 0:
        raise SpecError(f"hook state on stdin: container {state.id} has no pid")
    try:
        run_.spec = load_spec_as_runc(state.bundle)
    except SpecError as e:
        if inputs >= EDITS and edits_path(state.bundle) is None:
            # the runtime wrapper handed an unreadable spec on: it saw no GPU
            return f"{e}; no {EDITS_FILE}: no GPU asked for, nothing to do"
        raise
    run_.rootfs = rootfs_path(state, run_.spec)
    if inputs < EDITS:
        return None
    check_bundle_outside_rootfs(state.bundle, run_.rootfs)
    run_.edits = load_edits(state.bundle)
    if run_.edits is None:
        _check_not_edited(run_, state.bundle)
        return (f"no {EDITS_FILE} in {state.bundle}: nvctk-runtime made no plan for this "
                "container (no GPU asked for, or not created through it); nothing to do")
    return None


def _check_not_edited(run_: HookRun, bundle: str) -> None:
    """No form, yet the spec holds the record of a GPU create and still asks for a GPU:
    the form vanished after that create, and a start without it would run the GPU's
    device nodes without their mounts or their cap. SpecError. (A no-GPU create takes
    the form out, and the record too where it can rewrite the spec; where it cannot, the
    spec no longer asks for a GPU, and that container starts.)"""
    # start time: only without a form
    from nvctk.base.errors import ConfigError, RequestError
    from nvctk.request.parse import request_from_spec
    from nvctk.spec.record import EDITS_ANNOTATION, read_record

    spec = run_.spec or {}
    record = read_record(spec)
    if record is None or record.malformed:
        return
    try:
        try:
            config = run_.config()
        except ConfigError:  # as the runtime does for a no-GPU container: the defaults
            from nvctk.base.config import Config

            config = Config()
        asks = request_from_spec(spec, config) is not None
    except RequestError:
        asks = True  # what it asks is not even readable: no start without the form
    if asks:
        raise SpecError(f"{bundle}: the spec says nvctk-runtime gave this container a GPU "
                        f"(its {EDITS_ANNOTATION} record) and asks for one, but {EDITS_FILE} "
                        "is gone: not started without what that create decided (create it "
                        "again)")


class Early(Record):
    """The EDITS inputs of a bundle, read before its hook runs (read_early: a served
    prestart reads them while runc starts); they stand for the hook's own reads only
    while they are what those would read (holds)."""

    __slots__ = ("bundle", "spec", "rootfs", "edits", "log", "_spec_data",  # noqa: RUF023
                 "_edits_read")

    def __init__(self, bundle: str, spec_data: bytes, spec: dict[str, Any], rootfs: str,
                 edits_read: tuple[str, bytes], edits: Edits, log: HookLog) -> None:
        self.bundle = bundle
        self.spec = spec
        self.rootfs = rootfs
        self.edits = edits
        self.log = log  # the form's, opened
        self._spec_data = spec_data
        self._edits_read = edits_read

    def holds(self, state: HookState) -> bool:
        """The hook's state is of this bundle and rootfs (crun names its own), and the
        bundle's spec and form are byte for byte what was read: the inputs are the ones
        _read_inputs would read now. Two reads, no parse."""
        try:
            return (state.pid > 0 and state.bundle == self.bundle
                    and rootfs_path(state, self.spec) == self.rootfs
                    and read_spec(self.bundle) == self._spec_data
                    and read_edits(self.bundle) == self._edits_read)
        except (NvctkError, OSError):
            return False


def read_early(bundle: str) -> Early | None:
    """The EDITS inputs of `bundle` as _read_inputs reads them for a state without a
    root of its own (runc's), and the form's log opened; None when anything is not as
    a GPU create leaves it (the hook then reads them itself, and says what is wrong)."""
    try:
        spec_data = read_spec(bundle)
        spec = parse_spec_as_runc(spec_data, bundle)
        rootfs = rootfs_path(HookState("", 0, bundle), spec)
        check_bundle_outside_rootfs(bundle, rootfs)
        edits_read = read_edits(bundle)
        if edits_read is None:
            return None
        edits = parse_edits(*edits_read)
        if edits.log is None:
            return None
        log = HookLog(edits.log.file, edits.log.level)
    except (NvctkError, OSError):
        return None
    return Early(bundle, spec_data, spec, rootfs, edits_read, edits, log)


def _read_state(stream: IO[bytes]) -> bytes:
    """The OCI state on stdin, at most MAX_HOOK_STATE bytes (runc's is a few hundred)."""
    data = stream.read(MAX_HOOK_STATE + 1)
    if len(data) > MAX_HOOK_STATE:
        raise SpecError(f"hook state on stdin: larger than {MAX_HOOK_STATE} bytes")
    return data


def _fail(err: IO[str], text: str) -> None:
    try:
        err.write(text)
        err.flush()
    except (OSError, ValueError):  # a closed or strict stderr: the exit code still says it
        pass


def run(cmd: str, body: Callable[[HookRun], None], argv: list[str], *,
        parse: Callable[[list[str]], Any] | None = None, inputs: int = STATE,
        usage: str = "", stdin: IO[bytes] | None = None, stderr: IO[str] | None = None,
        log: HookLog | None = None, config: Config | None = None,
        early: Early | None = None) -> int:
    """Run one hook command (module docstring); returns its exit code.

    parse: the arguments -> the body's opts (UsageError when wrong); None: no arguments.
    log: a log to use instead of the form's (tests); it is not closed here.
    config: the config to use instead of reading nvctk's (tests).
    early: inputs read before (EDITS only), used when they hold for the state (then
    hook.early is it, and its log is the hook's, closed here)."""
    sanitize_environ()
    err = sys.stderr if stderr is None else stderr
    try:
        if parse is not None:
            opts = parse(argv)
        elif argv:
            raise UsageError(f"unexpected arguments {argv!r}")
        else:
            opts = None
    except UsageError as e:
        _fail(err, f"nvctk-hook: {cmd}: {e}\n{usage}" + ("\n" if usage[-1:] != "\n" else ""))
        return 2
    hook: HookRun | None = None
    msg = None
    try:
        state = parse_state(_read_state(sys.stdin.buffer if stdin is None else stdin))
        hook = HookRun(cmd, opts, state, log or HookLog(""), config=config)
        if early is not None and inputs == EDITS and early.holds(state):
            hook.early = early
            hook.spec, hook.rootfs, hook.edits = early.spec, early.rootfs, early.edits
            idle = None
            if log is None:
                hook.log = early.log
        else:
            idle = _read_inputs(hook, inputs)
            if log is None:
                hook.log = log_for(hook)
        hook.log.debug(f"{cmd} id={state.id} pid={state.pid} bundle={state.bundle}")
        if idle is not None:
            hook.log.warning(f"{state.id}: {idle}")
        else:
            body(hook)
    except NvctkError as e:
        msg = str(e)
    except OSError as e:
        msg = f"{e.filename or '-'}: {e.strerror or e}"
    except Exception as e:  # a bug: still a clear, non-zero failure
        msg = f"internal error: {e!r}"
    if hook is not None:
        if msg is not None:
            hook.log.error(f"{hook.state.id}: {cmd}: {msg}")
        if hook.log is not log:
            hook.log.close()
    if msg is None:
        return 0
    _fail(err, f"nvctk-hook: {cmd}: {msg}\n")
    return 1
