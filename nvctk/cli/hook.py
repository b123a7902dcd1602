"""nvctk-hook: the OCI hooks nvctk inserts into GPU containers' specs.

    nvctk-hook prestart [--served TOKEN]
                          state JSON on stdin (runc/crun prestart hook); with
                          --served, the launcher first hands the state to
                          nvctk-runtime's server (nvctk.hook.served)
    nvctk-hook poststop [--runtime-root DIR]
                          state JSON on stdin; removes the vGPU accounting state

    nvctk-hook cdi-edits|create-symlinks|update-ldcache ...
                          a CDI spec's hooks (nvctk.hook.cdi_hooks)

Thin: each command runs through nvctk.hook.entry (env, state, plan, log, exit codes);
the logic lives in nvctk.hook.prestart, nvctk.hook.poststop, nvctk.hook.cdi_hooks and
nvctk.hook.worker.
Exit 0 on success; 1 with "nvctk-hook: <command>: <message>" on stderr otherwise
(runc shows both); 2 on bad usage.
"""

from __future__ import annotations

import sys

USAGE = ("usage: nvctk-hook prestart|poststop [--runtime-root DIR]|cdi-edits ...|"
         "create-symlinks --link TARGET::PATH...|update-ldcache --folder DIR  "
         "(OCI state JSON on stdin)\n")


def main(argv: list[str] | None = None) -> int:
    """argv None: run as the program (sys.argv), and exit from here after prestart."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        sys.stderr.write(USAGE)
        return 0 if args else 2
    cmd = args[0]
    if cmd == "prestart":
        from nvctk.hook import prestart

        code = prestart.main(args[1:])
        if argv is None:
            # nothing left to clean up: files closed, the worker reaped
            from nvctk.base.log import exit_now

            exit_now(code)
        return code
    if cmd == "poststop":
        from nvctk.hook import poststop

        return poststop.main(args[1:])
    if cmd in ("cdi-edits", "create-symlinks", "update-ldcache"):
        from nvctk.hook import cdi_hooks

        return cdi_hooks.main(cmd, args[1:])
    sys.stderr.write(f"nvctk-hook: unknown command {cmd!r}\n{USAGE}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
