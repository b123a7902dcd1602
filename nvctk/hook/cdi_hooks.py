"""`nvctk-hook cdi-edits|create-symlinks|update-ldcache`: a CDI spec's hook, where
an engine (podman, containerd with CDI) applies nvctk's spec itself.

The arguments decode into the edits form (nvctk.edits.cdi_hook_args, as
nvctk-runtime's CDI mode decodes them), and the prestart hook's worker does it
(nvctk.hook.children.apply_edits: capabilities limited, paths resolved inside the
rootfs, the host's static ldconfig chrooted). nvctk-runtime's own CDI mode never
runs these: it folds them into its one prestart hook.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

USAGE = ("usage: nvctk-hook cdi-edits [--link TARGET::PATH]... [--folder DIR] [--pin etc|run]... | "
         "create-symlinks --link TARGET::PATH... | update-ldcache --folder DIR  "
         "(OCI state JSON on stdin)\n")


def main(cmd: str, args: list[str]) -> int:
    from nvctk.edits import Edits, cdi_hook_args
    from nvctk.hook.children import apply_edits
    from nvctk.hook.entry import ROOTFS, HookRun, UsageError, run

    def parse(argv: list[str]) -> Any:  # nvctk.edits.CdiHookArgs
        try:
            return cdi_hook_args(cmd, argv)
        except ValueError as e:
            raise UsageError(str(e)) from None

    def body(hook: HookRun) -> None:
        got = hook.opts
        assert hook.rootfs is not None  # ROOTFS: read by run
        if got.pins:  # a DRA share's spec: its cap lives in the pinned dirs
            check_no_user_namespaces(hook.spec or {})
            from nvctk.host.image import libc_kind
            from nvctk.plan.vgpu import check_preloadable

            # a loader that ignores /etc/ld.so.preload would run it uncapped
            check_preloadable(libc_kind(hook.rootfs), "the DRA claim's share")
        folder = got.folder
        # pins first (the worker's order): what runc bound below them stays there
        edits = Edits("", (), (), symlinks=got.links, lib_dir=folder or "/",
                      ldconfig=hook.config().ldconfig if folder else "", pins=got.pins)
        apply_edits(edits, hook.rootfs, hook.state.pid, hook.log, drop_parent_caps=True)
        hook.log.info(f"{hook.state.id}: {cmd} done")

    return run(cmd, body, args, parse=parse, inputs=ROOTFS, usage=USAGE)


# where the kernel says whether a process without privilege may make a user namespace
USERNS_SYSCTLS = (("/proc/sys/user/max_user_namespaces", "0"),
                  ("/proc/sys/kernel/unprivileged_userns_clone", "0"))


def check_no_user_namespaces(spec: dict[str, Any]) -> None:
    """A DRA share's container must not make a user namespace: in one, a process may mount
    over the preload in a mount namespace of its own and run uncapped. nvctk-runtime adds
    seccomp rules against it (as for its own vGPU containers); a CDI spec cannot, so under
    another runtime the container's own profile must refuse it (RuntimeDefault does), or
    the kernel (a sysctl). Otherwise the start fails, saying what to set (SpecError): a
    share never runs where its cap could be left. A privileged container (CAP_SYS_ADMIN)
    can mount over anything anyway and is not capped against its own root (README)."""
    from nvctk.base.errors import SpecError
    from nvctk.oci.spec import is_privileged
    from nvctk.spec.seccomp import userns_way

    if is_privileged(spec):
        return
    for path, off in USERNS_SYSCTLS:
        try:
            with open(path) as f:
                if f.read().strip() == off:
                    return
        except OSError:
            continue
    linux = spec.get("linux")
    way = userns_way(linux.get("seccomp") if isinstance(linux, dict) else None)
    if way is not None:
        raise SpecError(
            f"a DRA share's container may make a user namespace ({way} is allowed by its seccomp "
            "profile), in which it could mount over the files that cap it: run the Pod with "
            "securityContext.seccompProfile type RuntimeDefault (or the kubelet's "
            "seccompDefault), or with runtimeClassName nvidia (nvctk-runtime adds the rule)")

