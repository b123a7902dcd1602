"""A GPU container the kubelet did not give its GPU (issue 39): a Pod's container that
holds a GPU while the kubelet's pod-resources answer names no device-plugin resource and
no DRA claim for it. On a node configured as shipped for Kubernetes this cannot happen
(a container's env selects no GPU); on one left open (nvctk's defaults, or nvctk as the
default runtime) any Pod whose image says NVIDIA_VISIBLE_DEVICES=all gets every GPU,
uncapped, and the monitor is where an operator sees it.

Judged only where the kubelet was asked and answered this collection (a monitor without
--pod-resources-socket, or a failed call, knows nothing of allocations), and only for a
Pod's container (its namespace and Pod known from its engine's keys): a container outside
Kubernetes asks nobody.
"""

from __future__ import annotations

from nvctk.monitor.model import ContainerSample

METRIC = "nvctk_container_outside_allocations"
HELP = ("1: a Pod's container holds this GPU but the kubelet allocated it no device-plugin "
        "resource and no DRA claim (a node whose nvctk honours a container's env)")
FLAG = "NOT ALLOCATED BY THE KUBELET"


def outside_allocations(c: ContainerSample, kubelet_answered: bool) -> bool:
    """Whether c got its GPU outside the kubelet's allocations (as far as it can be told)."""
    return kubelet_answered and bool(c.pod) and bool(c.devices) and not c.resource \
        and not c.claim
