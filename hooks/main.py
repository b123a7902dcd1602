"""nvctk-hook: the OCI hooks nvctk inserts into GPU containers' specs.

    nvctk-hook prestart   state JSON on stdin (runc/crun prestart hook)
    nvctk-hook poststop   state JSON on stdin; removes the vGPU accounting state

Thin: the logic lives in nvctk.prestart. Exit 0 on success; 1 with
"nvctk-hook: <message>" on stderr otherwise (runc shows both); 2 on bad usage.
"""

from __future__ import annotations

import sys

USAGE = "usage: nvctk-hook prestart|poststop  (OCI state JSON on stdin)\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        sys.stderr.write(USAGE)
        return 0 if args else 2
    cmd = args[0]
    if cmd == "prestart":
        from nvctk import prestart

        return prestart.main()
    if cmd == "poststop":
        # removes the container's vGPU state dir; nothing to undo for mounts (they go
        # with the container's mount namespace)
        from nvctk import prestart, vgpu_state

        prestart.sanitize_environ()
        return vgpu_state.poststop_main(sys.stdin.buffer, sys.stderr)
    sys.stderr.write(f"nvctk-hook: unknown command {cmd!r}\n{USAGE}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
