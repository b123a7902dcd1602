"""nvctk-runtime: a drop-in for runc (the Python side of runtime_shim/nvctk-runtime.c).

The launcher passes every subcommand but create/run to the low-level runtime by
itself; this runs for create/run, and for a passthrough the launcher could not
serve (the config changed since Python last read it, or it is broken: see
nvctk.runtime.passthrough). Only `create` and `run` import the library (nvctk.runtime.create).
"""

from __future__ import annotations

import sys

from nvctk.oci import runc_argv


def _passthrough_error(args: runc_argv.RuncArgs, msg: str) -> int:
    from nvctk.base.log import report_error  # start time: error paths only

    report_error(msg, runc_log=args.log, runc_log_format=args.log_format)
    return 1


def _internal_error(args: runc_argv.RuncArgs, e: Exception) -> int:
    try:
        from nvctk.runtime.create import internal_error  # start time: error paths only

        msg = internal_error(e, None)
    except Exception:
        msg = f"internal error: {type(e).__name__}"
    return _passthrough_error(args, msg)


def _warn(msg: str) -> None:
    """A warning on the passthrough path: nvctk's log only, never stderr.

    containerd's go-runc reads `state` output with stderr combined into stdout,
    so a stray warning on stderr would break its JSON parsing.
    """
    try:
        # start time: a warning's path only
        from nvctk.base.config import Config
        from nvctk.base.log import Logger

        # the config is what is broken, so its log-file key cannot be trusted
        Logger(Config().log_file, "warning", "nvctk-runtime").warning(msg)
    except Exception:
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = runc_argv.parse(argv)
    if args.creates:
        try:
            # start time: the create path only (the passthrough imports none of it)
            from nvctk.runtime.create import create_main

            return create_main(args)
        except Exception as e:  # a bug: one line in runc's log, never a traceback
            return _internal_error(args, e)
    from nvctk.runtime import passthrough  # start time: the passthrough only

    runtimes, warning = passthrough.runtimes()
    if warning:
        _warn(warning)
    runtime = runc_argv.find_runtime(runtimes)
    if runtime is None:
        return _passthrough_error(
            args, f"no low-level runtime found (tried {', '.join(runtimes)}; nvctk-runtime "
            "itself is skipped)"
        )
    try:
        runc_argv.exec_runtime(runtime, argv)
    except OSError as e:
        return _passthrough_error(args, f"cannot exec {runtime}: {e.strerror}")
    return 1  # not reached: execv replaced us


if __name__ == "__main__":
    sys.exit(main())
