"""nvctk-hook: the OCI hooks nvctk inserts into GPU containers' specs.

    nvctk-hook prestart   state JSON on stdin (runc/crun prestart hook)
    nvctk-hook poststop [--runtime-root DIR]
                          state JSON on stdin; removes the vGPU accounting state

Thin: the logic lives in nvctk.hook.prestart, nvctk.hook.worker and nvctk.vgpu.state.
Exit 0 on success; 1 with
"nvctk-hook: <message>" on stderr otherwise (runc shows both); 2 on bad usage.
"""

from __future__ import annotations

import sys

USAGE = ("usage: nvctk-hook prestart|poststop|create-symlinks --link TARGET::PATH...|"
         "update-ldcache --folder DIR  (OCI state JSON on stdin)\n")


def main(argv: list[str] | None = None) -> int:
    """argv None: run as the program (sys.argv), and exit from here after prestart."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        sys.stderr.write(USAGE)
        return 0 if args else 2
    cmd = args[0]
    if cmd == "prestart":
        from nvctk.hook import prestart

        code = prestart.main()
        if argv is None:
            # nothing left to clean up: files closed, the worker reaped
            from nvctk.base.log import exit_now

            exit_now(code)
        return code
    if cmd == "poststop":
        # removes the container's vGPU state dir; nothing to undo for mounts (they go
        # with the container's mount namespace)
        from nvctk.hook.inputs import sanitize_environ
        from nvctk.vgpu import state as vgpu_state

        sanitize_environ()
        return vgpu_state.poststop_main(sys.stdin.buffer, sys.stderr, args[1:])
    if cmd in ("cdi-edits", "create-symlinks", "update-ldcache"):
        from nvctk.hook import cdi_hooks

        return cdi_hooks.main(cmd, args[1:])
    sys.stderr.write(f"nvctk-hook: unknown command {cmd!r}\n{USAGE}")
    return 2


def _cdi_args(cmd: str, args: list[str]) -> tuple[list[tuple[str, str]], str]:
    """(links as (path, target), folder) from the CDI hook's arguments; ValueError says
    what is wrong with them."""
    flag = "--link" if cmd == "create-symlinks" else "--folder"
    links: list[tuple[str, str]] = []
    folder = ""
    it = iter(args)
    for a in it:
        if a != flag:
            raise ValueError(f"unexpected argument {a!r} (want {flag})")
        value = next(it, None)
        if not value or "\0" in value:
            raise ValueError(f"{flag} needs a value")
        if cmd == "create-symlinks":
            target, sep, path = value.partition("::")
            if not sep or not target or not path.startswith("/"):
                raise ValueError(f"--link {value!r}: want TARGET::/ABSOLUTE/PATH")
            links.append((path, target))
        else:
            if folder or not value.startswith("/"):
                raise ValueError(f"--folder {value!r}: want one absolute container path")
            folder = value
    if not links and not folder:
        raise ValueError(f"{flag} is required")
    return links, folder


def _cdi_hook(cmd: str, args: list[str]) -> int:
    """A CDI spec's hook: the prestart hook's worker with a plan of only these links, or
    only the ldconfig run (nvctk.hook.worker.apply_plan: capabilities limited, paths resolved
    inside the rootfs, the host's static ldconfig chrooted)."""
    from nvctk.base import config as nvconfig
    from nvctk.base.errors import NvctkError, SpecError
    from nvctk.base.log import HookLog
    from nvctk.edits import Plan, Symlink
    from nvctk.hook.inputs import parse_state, rootfs_path, sanitize_environ
    from nvctk.hook.worker import apply_plan
    from nvctk.oci.spec import load_spec

    sanitize_environ()
    try:
        links, folder = _cdi_args(cmd, args)
    except ValueError as e:
        sys.stderr.write(f"nvctk-hook: {cmd}: {e}\n{USAGE}")
        return 2
    try:
        state = parse_state(sys.stdin.buffer.read())
        if state.pid <= 0:
            raise SpecError(f"hook state on stdin: container {state.id} has no pid")
        config = nvconfig.load()
        rootfs = rootfs_path(state, load_spec(state.bundle))
        plan = Plan("", (), (), symlinks=tuple(Symlink(p, t) for p, t in links),
                    lib_dir=folder or "/", ldconfig=config.ldconfig if folder else "")
        log = HookLog(config.log_file, config.log_level)
        try:
            apply_plan(plan, rootfs, state.pid, log, drop_parent_caps=True)
            log.info(f"{state.id}: {cmd} done")
        except NvctkError as e:
            log.error(f"{state.id}: {cmd}: {e}")
            raise
        finally:
            log.close()
        return 0
    except NvctkError as e:
        sys.stderr.write(f"nvctk-hook: {cmd}: {e}\n")
        return 1
    except Exception as e:  # a bug: still a clear, non-zero failure
        sys.stderr.write(f"nvctk-hook: {cmd}: internal error: {e!r}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
