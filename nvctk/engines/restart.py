"""After configure: make the engine take its new config, then wait until it answers with
the runtime's handler (or without it, after --remove), as an installer DaemonSet must:
a Pod's runtimeClassName works from then on, or the Pod's log says why not.

How the engine takes it (`--restart-mode`):
- signal: SIGHUP to the process serving the engine's socket (found by SO_PEERCRED on a
  connection to it: no pid file, no process-name scan). dockerd and CRI-O reload their
  config on SIGHUP; containerd has no reload and exits on it, so its service manager
  (systemd's Restart=always, k3s's supervisor) starts it again with the new config.
- systemd: `systemctl restart UNIT`, chrooted into the host's root when nvctk runs in a
  container with the host's / mounted (systemctl then talks to the host's systemd through
  its /run/systemd socket).
- none: nothing; the message says how.

Whether it answers: a CRI runtime's Status (containerd 2.x and CRI-O list their
`runtime_handlers`; containerd 1.x's verbose info holds its config's runtimes), Docker's
`GET /info` (its `Runtimes`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nvctk.base.errors import NvctkError

MODES = ("signal", "systemd", "none")
SOCKETS = {"containerd": "/run/containerd/containerd.sock", "crio": "/var/run/crio/crio.sock",
           "docker": "/var/run/docker.sock"}
POLL_S = 0.2
CALL_TIMEOUT_S = 5.0


class EngineError(NvctkError):
    """The engine could not be restarted or did not come back as wanted."""


@dataclass(frozen=True)
class Restart:
    engine: str
    mode: str = "none"
    socket: str = ""  # "" = SOCKETS[engine]
    host_root: str = "/"  # where the host's / is (an installer's container: /host)
    timeout: float = 60.0

    @property
    def sock(self) -> str:
        return self.socket or SOCKETS[self.engine]

    @property
    def service(self) -> str:
        """The engine's systemd unit: named as the engine, as their packages install it."""
        return self.engine


def engine_pid(sock: str) -> int:
    """The pid of the process serving the unix socket sock, in this pid namespace."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(CALL_TIMEOUT_S)
        s.connect(sock)
        pid, _uid, _gid = struct.unpack("3i", s.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError as e:
        raise EngineError(f"{sock}: cannot reach the engine: {e.strerror or e} (is it running? "
                          "is its socket mounted here?)")
    finally:
        s.close()
    if pid <= 0:
        raise EngineError(f"{sock}: the engine's process is not visible from here: restart "
                          "mode signal needs the host's pids (a Pod's hostPID: true)")
    return pid


def poke(r: Restart) -> str:
    """Make the engine take its config as r.mode says; what was done, for the log."""
    if r.mode == "signal":
        pid = engine_pid(r.sock)
        try:
            os.kill(pid, signal.SIGHUP)
        except OSError as e:
            raise EngineError(f"cannot signal {r.engine} (pid {pid}): {e.strerror or e}")
        return f"sent SIGHUP to {r.engine} (pid {pid})"
    if r.mode == "systemd":
        argv = ["systemctl", "restart", r.service]
        if os.path.realpath(r.host_root) != "/":
            argv = ["chroot", r.host_root, *argv]
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=r.timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise EngineError(f"{' '.join(argv)}: {e}")
        if p.returncode != 0:
            raise EngineError(f"{' '.join(argv)} failed (exit {p.returncode}): "
                              f"{(p.stderr or p.stdout).strip()[:500]}")
        return f"restarted {r.service} ({' '.join(argv)})"
    return ""


def handlers(engine: str, sock: str) -> set[str]:
    """The runtime handlers the engine serves now; EngineError when it does not answer."""
    if engine == "docker":
        return set(_docker_info(sock).get("Runtimes") or {})
    return _cri_handlers(sock)


def _cri_handlers(sock: str) -> set[str]:
    import grpc  # start time: configure's restart only

    from nvctk.engines.third_party import cri_api_pb2 as pb
    from nvctk.engines.third_party import cri_api_pb2_grpc as pb_grpc

    try:
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            resp = pb_grpc.RuntimeServiceStub(ch).Status(pb.StatusRequest(verbose=True),
                                                          timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as e:
        raise EngineError(f"{sock}: {e.code().name}: {e.details()}")  # type: ignore[attr-defined]
    names = {h.name for h in resp.runtime_handlers if h.name}
    if names:
        return names
    try:  # containerd 1.x: no runtime_handlers; its config is in the verbose info
        cfg: Any = json.loads(resp.info.get("config", "{}"))
        return set((cfg.get("containerd") or {}).get("runtimes") or {})
    except (ValueError, AttributeError):
        return set()


def _docker_info(sock: str) -> dict[str, Any]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(CALL_TIMEOUT_S)
    try:
        s.connect(sock)
        s.sendall(b"GET /info HTTP/1.0\r\nHost: docker\r\n\r\n")
        data = b""
        while len(data) < 1 << 22:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError as e:
        raise EngineError(f"{sock}: {e.strerror or e}")
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].decode(errors="replace")
    if not status.startswith("HTTP/1.") or " 200 " not in status + " ":
        raise EngineError(f"{sock}: GET /info: {status or 'no answer'}")
    try:
        info = json.loads(body)
    except ValueError as e:
        raise EngineError(f"{sock}: GET /info: not JSON: {e}")
    return info if isinstance(info, dict) else {}


def wait_for(r: Restart, name: str, present: bool,
             clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep) -> None:
    """Until the engine answers with (present) or without handler name; EngineError
    naming the engine, what it last said and what to do after r.timeout seconds."""
    start = clock()
    last = "no answer yet"
    while True:
        try:
            got = handlers(r.engine, r.sock)
            if (name in got) == present:
                return
            last = f"it serves handlers {sorted(got)}"
        except EngineError as e:
            last = str(e)
        if clock() - start > r.timeout:
            want = "with" if present else "without"
            raise EngineError(f"{r.engine} did not answer {want} runtime handler {name!r} "
                              f"within {r.timeout:g} s ({last}): see its log on the node "
                              f"(journalctl -u {r.service})")
        sleep(POLL_S)
