"""nvctk-hook: the OCI hooks nvctk inserts into GPU containers' specs.

    nvctk-hook prestart   state JSON on stdin (runc/crun prestart hook)
    nvctk-hook poststop   state JSON on stdin; vGPU accounting cleanup (stub for now)

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
        # vGPU accounting cleanup lands here; nothing to undo for mounts (they go
        # with the container's mount namespace)
        try:
            sys.stdin.buffer.read()
        except (OSError, ValueError):
            pass
        return 0
    sys.stderr.write(f"nvctk-hook: unknown command {cmd!r}\n{USAGE}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
