"""`nvctk top` and `nvctk monitor`: who uses which GPU, how much, against which cap."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import click

from nvctk.base.errors import NvctkError
from nvctk.cli.common import load_config

ROOTS_HELP = ("runtime state dir to look for containers in (repeatable; globs allowed; default: "
              "/run/runc, /run/crun, /run/containerd/runc/*, /run/docker/runtime-runc/*)")


PODRES_HELP = ("the kubelet's pod-resources socket, to name the resource and the DRA claims each "
               "Pod's container got (e.g. /var/lib/kubelet/pod-resources/kubelet.sock; default: "
               "not read)")


def _collector(ctx: click.Context, roots: tuple[str, ...], podres: str | None = None):  # type: ignore[no-untyped-def]
    # start time: the monitor's modules (NVML, the pod-resources client), for these commands only
    from nvctk.monitor.collect import Collector
    from nvctk.monitor.containers import DEFAULT_RUNTIME_ROOTS

    cfg = load_config(ctx)
    return Collector(cfg.driver_root, roots or DEFAULT_RUNTIME_ROOTS, pod_resources=podres)


@click.command()
@click.option("--once", is_flag=True, help="print one snapshot and exit")
@click.option("--json", "as_json", is_flag=True, help="one snapshot as JSON (implies --once)")
@click.option("--interval", type=click.FloatRange(min=0.2, max=10), default=2.0, show_default=True,
              metavar="SECONDS", help="refresh period; SM shares are averaged over it")
@click.option("--runtime-root", "roots", multiple=True, metavar="DIR", help=ROOTS_HELP)
@click.option("--pod-resources-socket", "podres", metavar="PATH", default=None, help=PODRES_HELP)
@click.pass_context
def top(ctx: click.Context, once: bool, as_json: bool, interval: float, roots: tuple[str, ...],
        podres: str | None) -> None:
    """This node's GPUs and the containers on them: memory used vs cap, SM share vs limit."""
    # start time: rich, for this command only
    from rich.console import Console

    from nvctk.monitor.top import render

    col = _collector(ctx, roots, podres)
    # markup and emoji codes off: every name is printed as the text it is
    console = Console(markup=False, emoji=False, highlight=False)
    try:
        if once or as_json:
            snap = col.collect()
            if as_json:
                click.echo(json.dumps(snap.to_dict(), indent=2))
            else:
                console.print(render(snap, console.width))
            return
        _live(console, col, interval)
    except KeyboardInterrupt:
        pass
    finally:
        col.close()


def _live(console: Any, col: Any, interval: float) -> None:
    """The live view: a snapshot every interval, the view fitted to the terminal's height,
    keys (in a terminal) scrolling it or narrowing it to one GPU at once (nvctk.monitor.top.View)."""
    # start time: rich and the view, for `nvctk top` only
    from rich.live import Live

    from nvctk.monitor.top import View, fit, render, rows_of

    view = View()
    keys: queue.Queue[str] = queue.Queue()
    snap = col.collect()
    with _keys_from(sys.stdin, keys), Live(render(snap, console.width, console.height, view),
                                           console=console, auto_refresh=False, screen=False) as live:
        due = time.monotonic() + interval
        while True:
            try:
                # the refresh period itself, or a key sooner: not a synchronisation
                key: str | None = keys.get(timeout=max(0.0, due - time.monotonic()))
            except queue.Empty:
                key = None
            if key is not None and not view.key(key, fit(snap, console.height),
                                                len(rows_of(snap, view.gpu)), len(snap.gpus)):
                return
            if time.monotonic() >= due:
                snap, due = col.collect(), time.monotonic() + interval
            live.update(render(snap, console.width, console.height, view), refresh=True)


@contextlib.contextmanager
def _keys_from(stream: Any, keys: queue.Queue[str]) -> Iterator[None]:
    """In a terminal: its keys, one read at a time (an arrow's escape sequence whole), into
    keys, the terminal in cbreak mode meanwhile (restored after). Elsewhere: nothing."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        fd = -1
    if fd < 0 or not os.isatty(fd):
        yield
        return
    # start time: the terminal's modes, for the live view in a terminal only
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def read() -> None:
        while True:
            try:
                data = os.read(fd, 16)
            except OSError:
                return
            if not data:
                return
            keys.put(data.decode("utf-8", "replace"))

    threading.Thread(target=read, name="nvctk-top-keys", daemon=True).start()
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@click.command()
@click.option("--listen", default="0.0.0.0:9400", show_default=True, metavar="HOST:PORT",
              help="where to serve /metrics, /api/snapshot and the dashboard (/)")
@click.option("--interval", type=click.FloatRange(min=0.2, max=10), default=5.0, show_default=True,
              metavar="SECONDS", help="how often a snapshot is taken")
@click.option("--runtime-root", "roots", multiple=True, metavar="DIR", help=ROOTS_HELP)
@click.option("--pod-resources-socket", "podres", metavar="PATH", default=None, help=PODRES_HELP)
@click.option("--compat", "compat", metavar="hami,dcgm", default="", envvar="NVCTK_MONITOR_COMPAT",
              help="also export HAMi's series (its vGPU monitor's and scheduler's) and/or "
                   "dcgm-exporter's, under their names, units and labels (README: Monitoring); "
                   "env NVCTK_MONITOR_COMPAT")
@click.option("--web-config-file", "web_config", metavar="PATH", default=None,
              envvar="NVCTK_MONITOR_WEB_CONFIG",
              help="TLS and basic auth, in Prometheus exporters' web config file format "
                   "(tls_server_config, basic_auth_users; README: Monitoring)")
@click.pass_context
def monitor(ctx: click.Context, listen: str, interval: float, roots: tuple[str, ...],
            podres: str | None, compat: str, web_config: str | None) -> None:
    """Serve per-container GPU metrics (Prometheus) and a dashboard page."""
    # start time: the HTTP server and its metrics, for this command only
    from nvctk.monitor.compat import parse_formats
    from nvctk.monitor.server import Monitor, MonitorServer, bind, bound_heap
    from nvctk.monitor.webconfig import WebConfig, load

    try:
        formats = parse_formats(compat) if compat else ()
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--compat") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bound_heap()  # before any thread
    # the HTTP loop gets the GIL back within 1 ms (not 5) while a collection or a render
    # runs in Python: at 1024 containers a scrape waited up to ~140 ms on them
    sys.setswitchinterval(0.001)
    host, port = parse_listen(listen)
    web = load(web_config) if web_config else WebConfig()
    sock = bind(host, port)  # before NVML: a bad --listen fails at once
    try:
        mon = Monitor(_collector(ctx, roots, podres), interval, compat=formats)
    except BaseException:
        sock.close()
        raise
    srv = MonitorServer(mon, sock, web=web)
    signal.signal(signal.SIGTERM, lambda *_: srv.stop())
    signal.signal(signal.SIGINT, lambda *_: srv.stop())
    mon.start()
    shown_host = f"[{host}]" if ":" in host else host
    click.echo(f"nvctk monitor: serving {'https' if web.tls else 'http'}://{shown_host}:{srv.server_address[1]}/ "
               f"(snapshot every {interval:g} s)", err=True)
    try:
        srv.serve_forever()
    finally:
        mon.stop.set()
        if mon.thread is not None:
            mon.thread.join(max(30.0, 2 * interval))  # a collection under way ends first
        srv.server_close()
        mon.collector.close()
    click.echo("nvctk monitor: stopped", err=True)


def parse_listen(listen: str) -> tuple[str, int]:
    """--listen HOST:PORT, [IPv6]:PORT or :PORT (every IPv4 address) -> (host, port);
    NvctkError naming the flag."""
    host, sep, port = listen.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or len(port) > 5:
        raise NvctkError(f"--listen {listen}: not HOST:PORT")
    if int(port) > 65535:
        raise NvctkError(f"--listen {listen}: port {port} out of range (0-65535)")
    if host.startswith("["):
        if not host.endswith("]") or ":" not in host:
            raise NvctkError(f"--listen {listen}: want [IPv6]:PORT for an IPv6 address")
        host = host[1:-1]
    elif ":" in host:
        raise NvctkError(f"--listen {listen}: an IPv6 address goes in brackets, [ADDR]:PORT")
    return host or "0.0.0.0", int(port)
