"""nvctk-hook: the OCI hooks nvctk inserts into GPU containers' specs.

    nvctk-hook prestart   state JSON on stdin (runc/crun prestart hook)
    nvctk-hook poststop [--runtime-root DIR]
                          state JSON on stdin; removes the vGPU accounting state

Thin: the logic lives in nvctk.prestart. Exit 0 on success; 1 with
"nvctk-hook: <message>" on stderr otherwise (runc shows both); 2 on bad usage.
"""

from __future__ import annotations

import os
import sys

USAGE = "usage: nvctk-hook prestart|poststop  (OCI state JSON on stdin)\n"


def _exit_now(code: int) -> None:
    """Leave without the interpreter's teardown (module and object cleanup: about
    a millisecond of every GPU container's start). The hook has nothing left to
    clean up: its files are closed and its worker reaped; only stdio is flushed."""
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """argv None: run as the program (sys.argv), and exit from here after prestart."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        sys.stderr.write(USAGE)
        return 0 if args else 2
    cmd = args[0]
    if cmd == "prestart":
        from nvctk import prestart

        code = prestart.main()
        if argv is None:
            _exit_now(code)
        return code
    if cmd == "poststop":
        # removes the container's vGPU state dir; nothing to undo for mounts (they go
        # with the container's mount namespace)
        from nvctk import prestart, vgpu_state

        prestart.sanitize_environ()
        return vgpu_state.poststop_main(sys.stdin.buffer, sys.stderr, args[1:])
    sys.stderr.write(f"nvctk-hook: unknown command {cmd!r}\n{USAGE}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
