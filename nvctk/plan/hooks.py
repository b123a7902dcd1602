"""The hooks a GPU container gets and the hook-side decisions (no I/O): nvctk-hook
prestart (and poststop for a vGPU), which NVIDIA hooks to drop, where the hook logs."""

from __future__ import annotations

from nvctk.base.errors import RequestError
from nvctk.edits import HOOK_NAME, NVIDIA_HOOK_NAMES, Hook, LogSettings, hook_env, prestart_hook

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nvctk.base.config import Config


def plan_hooks(hook_path: str, timeout: int, nvctk_config: str | None, vgpu: bool,
               runtime_root: str) -> tuple[Hook, ...]:
    """nvctk-hook prestart (nvctk-runtime names its server in it after planning:
    edits.with_server); with a vGPU also `nvctk-hook poststop --runtime-root ROOT`,
    which removes the vGPU state dir. The root (absolute, discovery's: runc resolves a
    relative --root against its cwd, the hook runs in the bundle), with the id runc
    passes in the state, names the dir: runc keeps each container's own copy of its
    hooks, while the bundle's form is the last create's (two containers from one bundle)."""
    hooks = [prestart_hook(hook_path, nvctk_config, timeout)]
    if vgpu:
        try:
            runtime_root.encode()
        except UnicodeEncodeError:  # argv's non-UTF-8 bytes, as surrogate escapes
            shown_root = runtime_root.encode("utf-8", "surrogateescape").decode(
                "ascii", "backslashreplace")
            raise RequestError(f"runc's --root '{shown_root[:200]}' is not UTF-8: a container "
                               "with a vGPU limit passes it to its poststop hook in "
                               "config.json, which holds text only") from None
        hooks.append(Hook("poststop", hook_path,
                          (HOOK_NAME, "poststop", "--runtime-root", runtime_root),
                          hook_env(nvctk_config), timeout))
    return tuple(hooks)


def removed_hooks() -> tuple[str, ...]:
    """The NVIDIA hooks a GPU container's spec loses (Docker's --gpus, NVIDIA's own
    runtime put them in): nvctk's hook does their work."""
    return tuple(NVIDIA_HOOK_NAMES)


def hook_log(config: Config) -> LogSettings:
    """Where the hook logs: the runtime's config values, so the hook loads no config."""
    return LogSettings(config.log_file, config.log_level)
