"""`nvctk dra-plugin`: the DRA kubelet plugin (node driver) for this node's GPUs (logic in
nvctk.dra)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

import click

from nvctk.base.errors import NvctkError
from nvctk.cli.common import load_node_config
from nvctk.dra.devices import DEFAULT_DRIVER

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nvctk.dra.driver import Driver
    from nvctk.dra.kube import Kube
    from nvctk.dra.slices import TaintPolicy
    from nvctk.k8s.health import Health

DEFAULT_PLUGINS_DIR = "/var/lib/kubelet/plugins"
DEFAULT_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
DEFAULT_CDI_DIR = "/var/run/cdi"


@click.command("dra-plugin")
@click.option("--kubeconfig", default=None, metavar="FILE",
              help="the API server's kubeconfig (default: the in-cluster config)")
@click.option("--node-name", default=lambda: os.environ.get("NODE_NAME", ""),
              show_default="$NODE_NAME", metavar="NAME",
              help="this node's name (the pool of its devices)")
@click.option("--plugins-dir", default=DEFAULT_PLUGINS_DIR, show_default=True, metavar="DIR",
              help="the kubelet's plugins dir: the service socket is <DIR>/<driver>/dra.sock")
@click.option("--registry-dir", default=DEFAULT_REGISTRY_DIR, show_default=True, metavar="DIR",
              help="the kubelet's plugin watcher dir (<DIR>/<driver>-reg.sock)")
@click.option("--cdi-dir", default=DEFAULT_CDI_DIR, show_default=True, metavar="DIR",
              help="where the claims' CDI specs are written (one per claim)")
@click.option("--driver-name", default=DEFAULT_DRIVER, show_default=True, metavar="NAME",
              help="the DRA driver's name (DeviceClasses select it)")
@click.option("--xid-taint", "xid_taints", multiple=True, metavar="XID=EFFECT",
              help="the taint of a device an XID hit: NoSchedule, NoExecute or None (default: "
                   "NoSchedule for a fatal XID, None for a contained or corrected one: 63, 92, "
                   "94); repeatable")
@click.option("--pod-resources-socket", default="/var/lib/kubelet/pod-resources/kubelet.sock",
              show_default=True, metavar="PATH",
              help="the kubelet's pod-resources socket: a claim a Pod still holds is never "
                   "swept as stale (without it, none is)")
@click.option("--stale-claim-grace", default=300.0, show_default=True, type=click.FloatRange(0),
              metavar="SECONDS",
              help="a prepared claim gone from the API server and held by no Pod for this "
                   "long is unprepared (its unprepare never came)")
@click.pass_context
def dra_plugin(ctx: click.Context, kubeconfig: str | None, node_name: str, plugins_dir: str,
               registry_dir: str, cdi_dir: str, driver_name: str,
               xid_taints: tuple[str, ...], pod_resources_socket: str,
               stale_claim_grace: float) -> None:
    """Kubernetes DRA kubelet plugin: publish this node's GPUs, GPU shares and MIG devices
    as ResourceSlices, and prepare them for claims."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s nvctk-dra-plugin %(levelname)s %(message)s")
    if not node_name:
        raise click.UsageError("no node name: set --node-name or $NODE_NAME (the downward "
                               "API's spec.nodeName)")
    try:
        cfg = load_node_config(ctx)
        _warn_unread(cdi_dir, cfg.cdi_spec_dirs)
        # start time: grpc, NVML and the API client, for this command only
        from nvctk.dra.node import claim_source, make_driver
        from nvctk.dra.slices import TaintPolicy
        from nvctk.k8s.health import Health

        try:
            policy = TaintPolicy.parse(xid_taints)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--xid-taint") from None

        source = claim_source(kubeconfig)
        health = Health()
        driver, _, driver_root = make_driver(driver_name, node_name, source, plugins_dir,
                                                cdi_dir, health, cfg=cfg,
                                                config_path=(ctx.find_root().obj or {}).get(
                                                    "config_path"), policy=policy)
        if not driver.devices:
            raise NvctkError("no GPU on this node")
        _serve(driver, driver_root, source, health, policy, node_name, driver_name,
               plugins_dir, registry_dir, pod_resources_socket, stale_claim_grace)
    except NvctkError as e:
        raise click.ClickException(str(e))
    click.echo("DRA plugin stopped", err=True)


def _warn_unread(cdi_dir: str, spec_dirs: tuple[str, ...] | list[str]) -> None:
    """The claims' specs would be written where nothing reads them: said, not refused
    (a runtime of the node may be configured to read it)."""
    if os.path.realpath(cdi_dir) not in {os.path.realpath(d) for d in spec_dirs}:
        logging.warning("--cdi-dir %s is not among the CDI spec dirs of nvctk's config "
                        "(cdi-spec-dirs: %s; containerd and CRI-O read /etc/cdi and "
                        "/var/run/cdi by default): unless the node's runtime reads it, "
                        "prepared claims get no devices", cdi_dir,
                        ", ".join(spec_dirs))


def _serve(driver: Driver, driver_root: str, source: Kube, health: Health,
           policy: TaintPolicy, node_name: str, driver_name: str, plugins_dir: str, registry_dir: str,
           pod_resources_socket: str, stale_claim_grace: float) -> None:
    """The kubelet plugin's service, the slices' publisher and the stale-claim sweeper,
    until SIGTERM or SIGINT."""
    # start time: grpc and the API client, for this command only (dra_plugin's)
    from nvctk.dra.node import pcie_roots
    from nvctk.dra.publish import Publisher
    from nvctk.dra.server import Plugin
    from nvctk.dra.stale import Sweeper, kubelet_claims
    from nvctk.k8s.health import XidWatcher

    inventory = driver.inventory
    assert inventory is not None  # make_driver's driver has one
    # XIDs mapped to the devices as they are now (a MIG layout changed since)
    plugin = Plugin(driver, health, plugins_dir, registry_dir,
                    XidWatcher(driver_root, lambda: inventory.host, health))
    # this node's ResourceSlices: published at once, again on each health change and
    # every RESYNC_S (the GPUs queried again: one gone, a new MIG layout), through
    # the driver, which then prepares what is published
    publisher = Publisher(source, node_name, driver_name, policy=policy,
                          pcie_roots=lambda h: pcie_roots(driver_root, h))
    publishing = threading.Thread(
        target=publisher.run, args=(driver.rediscover, health),
        name="nvctk-dra-publish", daemon=True)
    sweeper = Sweeper(driver, source, kubelet_claims(pod_resources_socket),
                      grace=stale_claim_grace)
    sweeping = threading.Thread(target=sweeper.run, name="nvctk-dra-stale", daemon=True)
    stop = threading.Event()

    def on_signal(*_: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    plugin.start()
    publishing.start()
    sweeping.start()
    click.echo(f"{driver_name}: {len(driver.devices)} device(s) on node {node_name}, "
               f"serving {plugin.endpoint}", err=True)
    try:
        stop.wait()
    finally:
        sweeper.stop()
        publisher.stop(health)
        publishing.join(5)  # a sync may be waiting out a down API server
        plugin.stop()
