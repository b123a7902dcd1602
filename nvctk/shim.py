"""nvctk-runtime's create/run: edit the bundle for the GPU request, then exec runc.

The executable (runtime_shim/main.py) parses argv and calls `create_main`;
everything else lives here so tests can call `prepare_bundle` in-process.

Failure policy: a container that asks for no GPU is never stopped by nvctk (a
broken config or a missing driver is only logged); a GPU container whose plan
cannot be made fails before runc starts, with one message naming the culprit,
and its config.json is left byte for byte as it was.
"""

from __future__ import annotations

import os
import sys

from nvctk import oci
from nvctk import runc_argv as ra
from nvctk.config import Config
from nvctk.config import load as load_config
from nvctk.errors import ConfigError, NvctkError, SpecError
from nvctk.log import Logger, report_error
from nvctk.record import Record
from nvctk.request import request_from_spec

# typing is for the type checker only: importing it costs every container start
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from nvctk.plan import Plan

HOOK_NAME = "nvctk-hook"


class Prepared(Record):
    """What prepare_bundle did: plan None = no GPU asked, the bundle was not touched."""

    __slots__ = ("plan", "docker_hooks_removed")  # noqa: RUF023

    def __init__(self, plan: Plan | None, docker_hooks_removed: int = 0) -> None:
        self.plan = plan
        self.docker_hooks_removed = docker_hooks_removed


def find_hook(config: Config, argv0: str | None = None) -> str:
    """config hook-path, else nvctk-hook beside this executable, else on PATH."""
    if config.hook_path:
        if not os.path.isabs(config.hook_path):
            raise ConfigError(f"{config.path or 'config'}: hook-path must be absolute")
        return config.hook_path
    exe = argv0 if argv0 is not None else sys.argv[0]
    if exe:
        beside = os.path.join(os.path.dirname(os.path.realpath(exe)), HOOK_NAME)
        if os.access(beside, os.X_OK):
            return beside
    import shutil  # rarely needed: it costs 3-9 ms to import (bz2, lzma, fnmatch)

    found = shutil.which(HOOK_NAME)
    if found:
        return os.path.abspath(found)
    raise ConfigError(f"cannot find {HOOK_NAME} (set hook-path in the nvctk config)")


def _nvctk_config_env() -> str | None:
    value = os.environ.get("NVCTK_CONFIG")
    # the hook runs with the bundle as its cwd: pass an absolute path on
    return os.path.abspath(value) if value else None


def prepare_bundle(
    bundle: str,
    config: Config | None,
    config_error: NvctkError | None = None,
    *,
    argv0: str | None = None,
    logger: Logger | None = None,
    container_id: str | None = None,
    runtime_root: str | None = None,
) -> Prepared:
    """Edit <bundle>/config.json for the container's GPU request (if any).

    config None means nvctk's config could not be loaded (config_error says why):
    a no-GPU container still goes ahead, a GPU container fails with that error.
    container_id, runtime_root (runc's --root): key the container's vGPU state dir,
    which is (re)created here when the container sets a limit.
    """
    spec = oci.load_spec(bundle)
    request = request_from_spec(spec, config or Config())
    if request is None:
        if config_error is not None and logger is not None:
            logger.warning(f"ignoring a broken nvctk config for a non-GPU container: {config_error}")
        return Prepared(None)
    if config is None:
        raise config_error or ConfigError("nvctk config unavailable")
    # only now: most containers on a node ask for no GPU and need none of the planning
    from nvctk.plan import PLAN_FILE
    from nvctk.planner import make_plan

    rootfs = oci.root_path(spec, bundle)
    if oci.bundle_in_rootfs(bundle, rootfs):
        # the hooks trust <bundle>/nvctk-plan.json (host paths to bind, a dir to delete)
        raise SpecError(f"{oci.spec_path(bundle)}: root.path {rootfs} contains the bundle; a "
                        "GPU container's rootfs must not hold its own bundle (it could rewrite "
                        f"{PLAN_FILE})")
    plan = make_plan(spec, config, bundle=bundle, request=request, container_id=container_id,
                     runtime_root=runtime_root)
    if plan is None:  # pragma: no cover - request was not None
        return Prepared(None)
    hook_path = find_hook(config, argv0)

    removed = oci.remove_nvidia_hooks(spec)
    oci.add_devices(spec, plan.devices)
    oci.set_hook(spec, oci.hook_entry(hook_path, config.hook_timeout, _nvctk_config_env()))
    oci.set_env(spec, plan.env)
    _set_poststop_hook(spec, hook_path, config, plan.vgpu is not None)

    # The plan and the vGPU state go first: a spec that names our hook must never
    # be visible without what the hook reads.
    vgpu_dir = None
    if plan.vgpu is not None and _install_vgpu(plan, spec, bundle, config, container_id,
                                               runtime_root, logger):
        vgpu_dir = plan.vgpu.state_dir
    plan_path = os.path.join(bundle, PLAN_FILE)
    try:
        # beside the spec: the directory fsync that follows the spec's rename makes
        # both renames durable, the plan's first (a directory fsync costs a journal commit)
        oci.atomic_write(plan_path, plan.to_json().encode(), 0o644, sync_dir=False)
        try:
            oci.save_spec(bundle, spec)
        except BaseException:
            try:
                os.unlink(plan_path)
            except OSError:
                pass
            raise
    except BaseException:
        if vgpu_dir is not None:
            _remove_vgpu_dir(vgpu_dir, config)
        raise
    return Prepared(plan, removed)


def _remove_vgpu_dir(path: str, config: Config) -> None:
    """Best effort, on a failure path: the failure itself is what gets reported."""
    from nvctk import vgpu_state

    try:
        vgpu_state.remove_state_dir(path, config)
    except (OSError, NvctkError):
        pass


def _set_poststop_hook(spec: dict[str, Any], hook_path: str, config: Config, want: bool) -> None:
    """`nvctk-hook poststop` (removes the vGPU state dir) in hooks.poststop, or none of ours."""
    if want:
        entry = oci.hook_entry(hook_path, config.hook_timeout, _nvctk_config_env())
        entry["args"] = [oci.OUR_HOOK_NAME, "poststop"]
        oci.set_hook(spec, entry, "poststop")
        return
    hooks = spec.get("hooks")
    if isinstance(hooks, dict) and isinstance(hooks.get("poststop"), list):
        hooks["poststop"] = [h for h in hooks["poststop"] if not oci.is_our_hook(h, "poststop")]


def _install_vgpu(plan: Plan, spec: dict[str, Any], bundle: str, config: Config,
                  container_id: str | None, runtime_root: str | None,
                  logger: Logger | None) -> bool:
    """(Re)create the container's vGPU state dir; False if left alone because the
    runtime already has a container of this id (runc then refuses the create)."""
    from nvctk import vgpu_state  # only for vGPU: it brings nvctk.mount (ctypes), re, ...

    assert plan.vgpu is not None
    if container_id and os.path.isdir(
        os.path.join(runtime_root or vgpu_state.DEFAULT_RUNTIME_ROOT, container_id)
    ):
        if logger is not None:
            logger.warning(f"{container_id}: the runtime already has this container; "
                           f"its vGPU state {plan.vgpu.state_dir} is left as it is")
        return False
    vgpu_state.install(plan.vgpu, oci.root_path(spec, bundle), config)
    return True


def _load_config_safely() -> tuple[Config | None, NvctkError | None]:
    try:
        return load_config(), None
    except NvctkError as e:
        return None, e


def create_main(args: ra.RuncArgs, argv0: str | None = None) -> int:
    """`nvctk-runtime [global] create|run ...`: prepare the bundle, then exec the runtime."""
    config, config_error = _load_config_safely()
    logger = Logger(config.log_file, config.log_level, "nvctk-runtime") if config else \
        Logger(Config().log_file, "warning", "nvctk-runtime")

    def fail(msg: str) -> int:
        report_error(msg, runc_log=args.log, runc_log_format=args.log_format, logger=logger)
        return 1

    # a broken config still names its runtimes for a no-GPU create, as on the
    # passthrough path (the fast reader, or the defaults)
    runtimes = config.runtimes if config else ra.read_runtimes()[0]
    runtime = ra.find_runtime(runtimes, exclude=ra.self_paths(argv0))
    if runtime is None:
        return fail(
            f"no low-level runtime found (tried {', '.join(runtimes)}; nvctk-runtime itself "
            "is skipped)"
        )
    bundle = args.bundle_dir()
    try:
        prepared = prepare_bundle(bundle, config, config_error, argv0=argv0, logger=logger,
                                  container_id=args.container_id, runtime_root=args.root)
    except NvctkError as e:
        return fail(str(e))
    except OSError as e:
        return fail(f"bundle {bundle}: {e.strerror or e}"
                    + (f": {e.filename}" if e.filename else ""))
    if prepared.plan is not None:
        p = prepared.plan
        logger.info(
            f"{args.subcommand} {args.container_id}: GPUs {','.join(p.gpu_uuids) or 'none'}, "
            f"capabilities {','.join(p.capabilities)}, {len(p.devices)} devices, "
            f"{len(p.mounts)} mounts"
            + (f", vGPU state {p.vgpu.state_dir}" if p.vgpu else "")
            + (f", replaced {prepared.docker_hooks_removed} NVIDIA hook(s)"
               if prepared.docker_hooks_removed else "")
        )
    try:
        os.execv(runtime, [runtime, *args.argv])
    except OSError as e:
        vg = prepared.plan.vgpu if prepared.plan is not None else None
        if vg is not None and config is not None:  # no runtime will run the poststop hook
            _remove_vgpu_dir(vg.state_dir, config)
        return fail(f"cannot exec {runtime}: {e.strerror}")
    return 1  # not reached
