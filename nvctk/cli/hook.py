"""nvctk-hook: the OCI hooks nvctk inserts into GPU containers' specs.

    nvctk-hook prestart   state JSON on stdin (runc/crun prestart hook)
    nvctk-hook poststop [--runtime-root DIR]
                          state JSON on stdin; removes the vGPU accounting state

Thin: every command runs through nvctk.hook.entry (env, state, plan, log, exit codes);
the logic lives in nvctk.hook.prestart, nvctk.hook.poststop and nvctk.hook.worker.
Exit 0 on success; 1 with "nvctk-hook: <command>: <message>" on stderr otherwise
(runc shows both); 2 on bad usage.
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
        from nvctk.hook import poststop

        return poststop.main(args[1:])
    if cmd in ("create-symlinks", "update-ldcache"):
        return _cdi_hook(cmd, args[1:])
    sys.stderr.write(f"nvctk-hook: unknown command {cmd!r}\n{USAGE}")
    return 2


def _cdi_args(cmd: str, args: list[str]) -> tuple[list[tuple[str, str]], str]:
    """(links as (path, target), folder) from the CDI hook's arguments; UsageError says
    what is wrong with them."""
    from nvctk.hook.entry import UsageError

    flag = "--link" if cmd == "create-symlinks" else "--folder"
    links: list[tuple[str, str]] = []
    folder = ""
    it = iter(args)
    for a in it:
        if a != flag:
            raise UsageError(f"unexpected argument {a!r} (want {flag})")
        value = next(it, None)
        if not value or "\0" in value:
            raise UsageError(f"{flag} needs a value")
        if cmd == "create-symlinks":
            target, sep, path = value.partition("::")
            if not sep or not target or not path.startswith("/"):
                raise UsageError(f"--link {value!r}: want TARGET::/ABSOLUTE/PATH")
            links.append((path, target))
        else:
            if folder or not value.startswith("/"):
                raise UsageError(f"--folder {value!r}: want one absolute container path")
            folder = value
    if not links and not folder:
        raise UsageError(f"{flag} is required")
    return links, folder


def _cdi_hook(cmd: str, args: list[str]) -> int:
    """A CDI spec's hook: the prestart hook's worker with a plan of only these links, or
    only the ldconfig run (nvctk.hook.worker.apply_plan: capabilities limited, paths resolved
    inside the rootfs, the host's static ldconfig chrooted)."""
    from nvctk.hook.entry import ROOTFS, HookRun, run

    def body(hook: HookRun) -> None:
        # TODO(issue 19, form): moves to nvctk/hook/cdi_hooks.py, the edits decoded from
        # the hook's args; the config is read here only for ldconfig and the log
        from nvctk.base import config as nvconfig
        from nvctk.base.log import HookLog
        from nvctk.edits import Plan, Symlink
        from nvctk.hook.worker import apply_plan

        links, folder = hook.opts
        config = nvconfig.load()
        hook.log = HookLog(config.log_file, config.log_level)
        assert hook.rootfs is not None  # inputs=ROOTFS
        plan = Plan("", (), (), symlinks=tuple(Symlink(p, t) for p, t in links),
                    lib_dir=folder or "/", ldconfig=config.ldconfig if folder else "")
        apply_plan(plan, hook.rootfs, hook.state.pid, hook.log, drop_parent_caps=True)
        hook.log.info(f"{hook.state.id}: {cmd} done")

    return run(cmd, body, args, parse=lambda a: _cdi_args(cmd, a), inputs=ROOTFS, usage=USAGE)


if __name__ == "__main__":
    sys.exit(main())
