"""nvctk-runtime's create/run: edit the bundle for the GPU request, then exec runc.

The executable (nvctk.cli.runtime) parses argv and calls `create_main`;
everything else lives here so tests can call `prepare_bundle` in-process (runc itself is
started by nvctk.runtime.runc). A legacy
GPU create reads as its data flow: read the spec -> the request in it -> discover
(nvctk.host.discover: every host and image fact, once) -> plan (nvctk.plan: no I/O)
-> apply (nvctk.spec.apply) -> save (vGPU state, the form, the spec).

Failure policy: a container that asks for no GPU is never stopped by nvctk (a
broken config or a missing driver is only logged); a GPU container whose plan
cannot be made fails before runc starts, with one message naming the culprit,
and its config.json is left byte for byte as it was.
"""

from __future__ import annotations

import os

from nvctk.base.config import Config, config_path, load_stat
from nvctk.base.errors import (
    ConfigError,
    NvctkError,
    RequestError,
    SpecError,
    SpecShapeError,
    shown,
)
from nvctk.base.log import Logger, report_error
from nvctk.base.record import Record
from nvctk.edits import SERVED_FLAG, with_server
from nvctk.edits_file import remove_edits
from nvctk.host.paths import context
from nvctk.oci import runc_argv as ra
from nvctk.oci import spec as oci
from nvctk.request.parse import asks_for_vgpu, request_from_spec
from nvctk.runtime import earlier, runc
from nvctk.runtime.commit import commit
from nvctk.spec import apply as spec_edits

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from nvctk.edits import Edits
    from nvctk.host.facts import CdiFacts, Context, Facts
    from nvctk.host.image import ImageFacts
    from nvctk.host.inventory import HostInfo
    from nvctk.request.parse import Request
    from nvctk.spec.record import EarlierRecord


class Created(Record):
    """What prepare_bundle did: edits None = no GPU asked, the bundle was not touched."""

    __slots__ = ("edits", "docker_hooks_removed", "vgpu_dir", "cdi_devices")  # noqa: RUF023

    def __init__(self, edits: Edits | None, docker_hooks_removed: int = 0,
                 vgpu_dir: str | None = None, cdi_devices: tuple[str, ...] | None = None) -> None:
        self.edits = edits
        self.docker_hooks_removed = docker_hooks_removed
        self.vgpu_dir = vgpu_dir  # the vGPU state dir this create made (None: none)
        self.cdi_devices = cdi_devices  # CDI mode: the devices whose edits were applied

    def served(self, token: str) -> bool:
        """The spec's prestart hook hands its state to the server named `token`."""
        return self.edits is not None and any(
            h.args[2:] == (SERVED_FLAG, token) for h in self.edits.hooks)


def prepare_bundle(
    bundle: str,
    config: Config | None,
    config_error: NvctkError | None = None,
    *,
    argv0: str | None = None,
    logger: Logger | None = None,
    container_id: str | None = None,
    runtime_root: str | None = None,
    served: str | None = None,
) -> Created:
    """Edit <bundle>/config.json for the container's GPU request (if any): read the
    spec, the request in it, then one pipeline for both modes: facts + context ->
    plan_container -> the server named in the form -> commit.

    config None means nvctk's config could not be loaded (config_error says why):
    a no-GPU container still goes ahead, a GPU container fails with that error.
    container_id, runtime_root (runc's --root): key the container's vGPU state dir,
    which is (re)created here when the container sets a limit.
    served: the token of the prestart server create_main starts (nvctk.hook.served),
    named in the prestart hook's arguments; None: the hook runs by itself.
    """
    read = _read_spec(bundle, config, logger)
    if read is None:  # a spec nvctk cannot read, and no sign of a GPU: runc decides
        return Created(None)
    spec, data = read
    request = request_from_spec(spec, config or Config())
    if request is None and config is not None and holds_dra_share(spec):
        return _dra_share(bundle, spec, data, config, logger, container_id, runtime_root)
    if request is None:
        _no_gpu(bundle, spec, config, config_error, logger)
        return Created(None)
    if config is None:
        raise config_error or ConfigError("nvctk config unavailable")
    if container_id is not None:
        # before any state is keyed or made by it (runc would refuse it only after)
        check_container_id(container_id)
    cdi = request.cdi_devices is not None
    _check_gpu_spec(bundle, spec, data, userns=not cdi)
    record = _checked_record(bundle, spec, config.state_dir, logger)
    # start time: planning (and, for legacy mode, discovery: 17 modules); most
    # containers on a node ask for no GPU and need none of them
    from nvctk.plan import make

    facts: Facts | CdiFacts
    if cdi:
        facts, context = _cdi_facts(bundle, spec, request, config, argv0)
    else:
        facts, context = _legacy_facts(bundle, spec, request, config, argv0, container_id,
                                       runtime_root)
    edits = make.plan_container(request, config, facts, context)
    if served is not None:
        edits = with_server(edits, served)
    removed, vgpu_dir = commit(bundle, spec, edits, record, config, logger,
                               container_id=container_id, runtime_root=runtime_root)
    if edits.origin == "cdi":
        return Created(edits if edits.has_hook_work() else None, removed,
                       cdi_devices=request.cdi_devices)
    return Created(edits, removed, vgpu_dir)


def legacy_facts(request: Request, config: Config, image: ImageFacts,
                 host: HostInfo | None = None) -> Facts:
    """Legacy mode's discovery: the host (`host`, else nvctk.host.cache's, else NVML's),
    the request's devices on it, their requirements checked (a container the host
    cannot run reads nothing more), then the facts of those devices."""
    from nvctk.host import discover
    from nvctk.host.select import select_devices
    from nvctk.plan.make import check_requirements

    if host is None:
        host, selected = discover.load_and_select(request, config)
    else:
        selected = select_devices(request, host)
    check_requirements(request, host, selected)
    return discover.discover(request, config, host, selected, image)


def _legacy_facts(bundle: str, spec: dict[str, Any], request: Request, config: Config,
                  argv0: str | None, container_id: str | None,
                  runtime_root: str | None) -> tuple[Facts, Context]:
    from nvctk.host.image import image_facts

    facts = legacy_facts(request, config, image_facts(spec, bundle, vgpu=asks_for_vgpu(request)))
    state_dir = vgpu_state_dir(request, config, runtime_root,
                               container_id or os.path.basename(bundle))
    return facts, context(config, argv0=argv0, runtime_root=runtime_root,
                          vgpu_state_dir=state_dir)


def _cdi_facts(bundle: str, spec: dict[str, Any], request: Request, config: Config,
               argv0: str | None) -> tuple[CdiFacts, Context]:
    from nvctk.base.config import cache_dir
    from nvctk.cdi.resolve import cdi_facts  # CDI mode only
    from nvctk.plan.make import check_cdi_request

    check_cdi_request(request)
    # the parsed specs are kept beside the passthrough cache (root's, /run/nvctk)
    return cdi_facts(request, config, bundle, spec, cache_dir()), context(config, argv0=argv0)


def _no_gpu(bundle: str, spec: dict[str, Any], config: Config | None,
            config_error: NvctkError | None, logger: Logger | None) -> None:
    """A create that asks for no GPU: refused only when the node gave it a vGPU share it
    holds by another route; what an earlier GPU create of this bundle added comes out."""
    _check_uncapped_share(spec)
    if config_error is not None and logger is not None:
        logger.warning(f"ignoring a broken nvctk config for a non-GPU container: {config_error}")
    _undo_earlier_create(bundle, spec, logger, config.state_dir if config else None)


def holds_dra_share(spec: dict[str, Any]) -> bool:
    """The engine applied a DRA share's CDI spec (nvctk.dra.driver): libvgpu's limits file
    is one of the spec's own mounts (nvctk's vGPU containers get theirs from the hook)."""
    dests = [d for m in oci.spec_mounts(spec)
             if isinstance(d := m.get("destination"), str) and d.startswith("/run/nvctk/")]
    if not dests:
        return False  # most containers: nothing more imported
    from nvctk.vgpu.limits import LIMITS_FILE

    return LIMITS_FILE in dests


def _dra_share(bundle: str, spec: dict[str, Any], data: bytes, config: Config,
               logger: Logger | None, container_id: str | None,
               runtime_root: str | None) -> Created:
    """A DRA share's container: its GPU, libvgpu and cap come by its CDI spec, which cannot
    carry seccomp rules; nvctk-runtime adds the ones it gives its own vGPU containers (no
    new user namespace, in which a process could mount over the preload), with the record
    a later create takes them out by."""
    from nvctk.edits import Edits

    _check_gpu_spec(bundle, spec, data, userns=False)
    record = _checked_record(bundle, spec, config.state_dir, logger)
    removed, _ = commit(bundle, spec, Edits("", (), (), seccomp_block_userns=True), record,
                        config, logger, container_id=container_id, runtime_root=runtime_root)
    return Created(None, removed)


def _check_gpu_spec(bundle: str, spec: dict[str, Any], data: bytes, userns: bool) -> None:
    """What makes a spec one nvctk can give a GPU (fields of the right types, bytes it
    can rewrite; userns: no user namespace), checked before any work."""
    if userns and (where := oci.user_namespace(spec)) is not None:
        # the hook's bind mounts and device nodes would reach the container owned by
        # the overflow uid, and runc's own mounts of them fail: no usable driver
        raise SpecError(f"{oci.spec_path(bundle)}: {where}: user namespaces are not supported "
                        "by nvctk's GPU containers (the driver files and device nodes it mounts "
                        "would not be usable in the container); run it without a user namespace")
    spec_edits.check_editable(spec)  # a field of the wrong type is the user's error
    oci.check_rewritable(spec, data)


def vgpu_state_dir(request: Request, config: Config, runtime_root: str | None,
                   container_id: str) -> str:
    """The container's vGPU state dir, keyed by runc's root and the id ("" when the
    request can set no limit)."""
    if not asks_for_vgpu(request):
        return ""
    from nvctk.vgpu.state import state_dir_for  # start time: vGPU only (hashlib, mount)

    return state_dir_for(config, runtime_root, container_id)


def _checked_record(bundle: str, spec: dict[str, Any], state_dir: str | None,
                    logger: Logger | None) -> EarlierRecord | None:
    """The spec's record as far as a GPU create may act on it (nvctk.runtime.earlier):
    SpecError for a malformed one, a record honoured only in part said in the log."""
    record = earlier.earlier_record(bundle, spec, state_dir)
    spec_edits.check_record(record)
    if record is not None and record.problem is not None and logger is not None:
        logger.warning(f"{oci.SPEC_FILE}: {record.problem}")
    return record


def _check_uncapped_share(spec: dict[str, Any]) -> None:
    """A container the node gave a vGPU share (nvctk.io/vgpu.* annotation) that asks
    nvctk for no GPU yet holds GPU device nodes got them by another route (CDI devices
    the engine applied: the plugin's cdi-cri strategy), where nvctk cannot cap them:
    refused rather than run uncapped."""
    annotations = spec.get("annotations")
    if not isinstance(annotations, dict) or not any(
            isinstance(k, str) and k.startswith("nvctk.io/vgpu.") for k in annotations):
        return
    linux = spec.get("linux")
    devices = linux.get("devices") if isinstance(linux, dict) else None
    nodes = [d.get("path") for d in (devices if isinstance(devices, list) else ())
             if isinstance(d, dict)
             and isinstance(d.get("path"), str) and d["path"].startswith("/dev/nvidia")
             and d["path"][len("/dev/nvidia"):].isdigit()]
    if nodes:
        raise RequestError(f"{nodes[0]}: the node gave this container a vGPU share, but its GPU "
                           "came by a route nvctk cannot cap (CDI devices the engine applied); "
                           "use the device plugin's envvar or volume-mounts strategy for vGPU")


_ID_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_+-.")


def check_container_id(container_id: str) -> None:
    """A GPU container's id must be one runc takes (runc's validateID: ASCII letters,
    digits and _+-., not "." or ".."): it names nvctk's state dir and keys it."""
    if container_id and set(container_id) <= _ID_OK and container_id not in (".", ".."):
        return
    try:  # argv's own bytes (surrogateescape), escaped: a\xff, not a\udcff
        name = os.fsencode(container_id).decode("ascii", "backslashreplace")
    except UnicodeError:
        name = shown(container_id)[1:-1]
    raise RequestError(f"invalid container id '{name[:80]}': runc takes only ASCII letters, "
                       "digits and _+-. (and not '.' or '..')")


def _read_spec(bundle: str, config: Config | None,
               logger: Logger | None) -> tuple[dict[str, Any], bytes] | None:
    """(spec, its bytes), or None for a spec nvctk cannot read that shows no sign of
    asking for a GPU: runc runs what it accepts (JSON nested deeper than Python
    parses, bytes that are not UTF-8) and words its own errors. A spec that cannot
    be read and may ask for a GPU is a SpecError."""
    try:
        data = oci.read_spec(bundle)
    except SpecError as e:
        # a missing file, a FIFO (reading it would take what runc is to read): runc decides
        _log_handed_on(logger, e)
        return None
    where = oci.spec_path(bundle)
    try:
        return oci.parse_spec(data, where), data
    except SpecError as e:
        error = e
    try:
        # runc (Go) reads each byte that is not UTF-8 as U+FFFD: read it so too, to
        # know exactly whether a GPU is asked for
        lenient = oci.parse_spec(data.decode("utf-8", "replace"), where)
    except SpecError:
        lenient = None
    if lenient is not None:
        try:
            asked = request_from_spec(lenient, config or Config())
        except NvctkError:  # e.g. CUDA_VERSION made of bytes that are not UTF-8
            raise SpecError(f"{error}: nvctk rewrites a GPU container's spec and will not "
                            "replace bytes it cannot read")
        if asked is None:
            _log_handed_on(logger, error)
            # the spec stays as it is (nvctk will not rewrite bytes it cannot read):
            # an earlier create's hooks in it find no plan and do nothing
            remove_edits(bundle, logger)
            return None
        raise SpecError(f"{error}: nvctk rewrites a GPU container's spec and will not replace "
                        "bytes it cannot read")
    marker = oci.gpu_marker(data)
    if marker is None:
        _log_handed_on(logger, error)
        remove_edits(bundle, logger)
        return None
    if isinstance(error, SpecShapeError):  # valid JSON: the field's type is the problem
        raise SpecError(f"{error} (the spec mentions {marker}, so it may ask for a GPU, and "
                        "nvctk cannot read a GPU request from a spec of the wrong shape)")
    raise SpecError(f"{error}; it mentions {marker}, so it may ask for a GPU, which nvctk "
                    "cannot tell without reading it")


def _log_handed_on(logger: Logger | None, error: SpecError) -> None:
    if logger is not None:
        logger.warning(f"{error}; no GPU asked for as far as nvctk can see: handed to the "
                       "runtime unchanged")


def _undo_earlier_create(bundle: str, spec: dict[str, Any], logger: Logger | None,
                         state_dir: str | None = None) -> None:
    """A no-GPU create of a bundle an earlier GPU create edited: take nvctk's hooks,
    devices and env out (as far as the record proves them: nvctk.runtime.earlier), and
    its plan. A spec without them is not rewritten (the common case costs a stat of the
    plan file). A malformed record, or one of which nothing may be acted on, leaves the
    spec as it is."""
    if spec_edits.has_our_edits(spec):
        record = earlier.earlier_record(bundle, spec, state_dir)
        if record is not None and (record.malformed or (record.problem and not record.fields)):
            # not what nvctk writes, or nothing of it nvctk may act on: nvctk leaves the
            # spec as it is (its hooks find no plan), and runc judges it
            if logger is not None:
                logger.warning(f"{bundle}: {record.problem}; the spec is handed on unchanged")
        else:
            if record is not None and record.problem is not None and logger is not None:
                logger.warning(f"{oci.SPEC_FILE}: {record.problem}")
            # an error here fails the create: the hooks left in would run for this container
            spec_edits.remove_our_edits(spec, record)
            oci.save_spec(bundle, spec)
            if logger is not None:
                logger.info(f"{bundle}: took out what an earlier GPU create added to the spec")
    remove_edits(bundle, logger)


INTERNAL_ERROR = "internal error"


def internal_error(e: BaseException, logger: Logger | None) -> str:
    """The one-line message for an unexpected exception; its traceback goes to
    nvctk's own log. Tests assert that no input ever produces it."""
    if logger is not None:
        try:
            import traceback

            logger.error("".join(traceback.format_exception(e)))
        except Exception:
            pass
    text = str(e)
    if len(text) > 200:
        text = text[:197] + "..."
    return (f"{INTERNAL_ERROR}: {type(e).__name__}: {text} (a bug in nvctk: the traceback is "
            "in nvctk's log)")


def os_error_message(e: OSError, bundle: str, config: Config | None) -> str:
    """Which part failed: the vGPU state dir, the bundle, or another path by name."""
    reason = e.strerror or str(e)
    path = os.fsdecode(e.filename) if isinstance(e.filename, (str, bytes)) else ""
    if not path:
        return f"bundle {bundle}: {reason}"
    state_dir = config.state_dir if config is not None else ""
    if state_dir and (path == state_dir or path.startswith(state_dir.rstrip("/") + "/")):
        return f"vGPU state dir {state_dir}: {reason}: {path}"
    if path == bundle or path.startswith(bundle.rstrip("/") + "/"):
        return f"bundle {bundle}: {reason}: {path}"
    return f"{path}: {reason}"


def _load_config_safely() -> tuple[Config | None, NvctkError | None]:
    path = config_path()
    try:
        config, st = load_stat(path)
    except NvctkError as e:
        return None, e
    from nvctk.runtime import passthrough  # the launcher's next start/state/delete skips Python

    passthrough.remember(path, st, config.runtimes)
    return config, None


def create_main(args: ra.RuncArgs, argv0: str | None = None) -> int:
    """`nvctk-runtime [global] create|run ...`: prepare the bundle, then exec the runtime."""
    config, config_error = _load_config_safely()
    logger = Logger(config.log_file, config.log_level, "nvctk-runtime") if config else \
        Logger(Config().log_file, "warning", "nvctk-runtime")

    def fail(msg: str) -> int:
        report_error(msg, runc_log=args.log, runc_log_format=args.log_format, logger=logger)
        return 1

    # a broken config: the default runtimes for a no-GPU create, as on the passthrough
    runtimes = config.runtimes if config else Config().runtimes
    runtime = ra.find_runtime(runtimes, exclude=ra.self_paths(argv0))
    if runtime is None:
        return fail(
            f"no low-level runtime found (tried {', '.join(runtimes)}; nvctk-runtime itself "
            "is skipped)"
        )
    bundle = args.bundle
    token = os.urandom(16).hex()  # the name of this create's prestart server, if it has one
    try:
        bundle = args.bundle_dir()
        prepared = prepare_bundle(bundle, config, config_error, argv0=argv0, logger=logger,
                                  container_id=args.container_id, runtime_root=args.root,
                                  served=token)
    except NvctkError as e:
        return fail(str(e))
    except OSError as e:
        return fail(os_error_message(e, bundle, config))
    except Exception as e:
        # a bug in nvctk: one line in runc's log (so the engine shows something
        # useful), the traceback in nvctk's own log
        return fail(internal_error(e, logger))
    if prepared.edits is not None:
        p = prepared.edits
        logger.info(
            f"{args.subcommand} {args.container_id}: GPUs {','.join(p.gpu_uuids) or 'none'}, "
            f"capabilities {','.join(p.capabilities)}, {len(p.devices)} devices, "
            f"{len(p.mounts)} mounts"
            + (f", vGPU state {p.vgpu.state_dir}" if p.vgpu else "")
            + (f", replaced {prepared.docker_hooks_removed} NVIDIA hook(s)"
               if prepared.docker_hooks_removed else "")
        )
    if prepared.cdi_devices is not None:
        logger.info(f"{args.subcommand} {args.container_id}: CDI devices "
                    f"{','.join(prepared.cdi_devices) or 'none'}")
    served = token if prepared.served(token) else None
    if prepared.vgpu_dir is not None and config is not None:
        # runc may still fail before the container exists (create and run alike): then
        # nothing runs the poststop hook, so this process outlives runc to remove the
        # state it made
        return runc.create_and_clean_up(runtime, args, bundle, prepared.vgpu_dir, config, fail,
                                        logger, served)
    return runc.become_runc(runtime, args, bundle, served, fail, logger)
