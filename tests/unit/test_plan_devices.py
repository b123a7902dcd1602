"""plan.devices on discovery's DeviceFacts: nodes, MIG capability nodes, DRM links."""

from __future__ import annotations

import pytest

from nvctk.base.errors import DriverError
from nvctk.host.discover import DeviceFacts
from nvctk.host.inventory import GpuInfo, MigInfo
from nvctk.host.select import Selected
from nvctk.plan.devices import drm_nodes, plan_devices, plan_drm_links
from nvctk.request.parse import Request

MIG = MigInfo(0, "MIG-aaaa", 1, 2, "3g.40gb", 40000)
GPU = GpuInfo(0, "GPU-0000", "NVIDIA A100", 4, "00000000:1B:00.0", 40960, "8.0", "nvidia", True,
              (MIG,))
DEV = "/drv/dev"
NODES: dict[str, tuple[int, int] | str | None] = {
    "nvidiactl": (195, 255), "nvidia4": (195, 4), "nvidia-uvm": (510, 0),
    "nvidia-uvm-tools": (510, 1), "nvidia-modeset": (195, 254),
    "dri/card1": (226, 1), "dri/renderD128": (226, 128),
    "nvidia-caps/nvidia-cap12": (237, 12), "nvidia-caps/nvidia-cap13": (237, 13),
}
GI = "gpu4/mig/gi1/access"  # the parent's minor (4), not its NVML index (0)
CI = "gpu4/mig/gi1/ci2/access"
FACTS = DeviceFacts(DEV, NODES, {}, {GI: 12, CI: 13, "mig/config": 1, "mig/monitor": 2},
                    {"0000:1b:00.0": ("card1", "renderD128")})


def paths(nodes: list) -> list[str]:  # type: ignore[type-arg]
    return [n.path for n in nodes]


@pytest.mark.parametrize(("caps", "selected", "want"), [
    (("utility",), [Selected(GPU)], ["/dev/nvidiactl", "/dev/nvidia4"]),
    (("compute",), [Selected(GPU)],
     ["/dev/nvidiactl", "/dev/nvidia4", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]),
    (("video",), [], ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]),
    (("display",), [Selected(GPU)], ["/dev/nvidiactl", "/dev/nvidia4", "/dev/nvidia-modeset",
                                     "/dev/dri/card1", "/dev/dri/renderD128"]),
    (("graphics",), [Selected(GPU)],
     ["/dev/nvidiactl", "/dev/nvidia4", "/dev/dri/card1", "/dev/dri/renderD128"]),
    # a MIG device: its parent's node and its two capability nodes; no DRM node of its own
    (("graphics",), [Selected(GPU, MIG)], ["/dev/nvidiactl", "/dev/nvidia4",
                                           "/dev/nvidia-caps/nvidia-cap12",
                                           "/dev/nvidia-caps/nvidia-cap13"]),
    # the same GPU twice (itself and its MIG device): its node once
    (("utility",), [Selected(GPU), Selected(GPU, MIG)],
     ["/dev/nvidiactl", "/dev/nvidia4", "/dev/nvidia-caps/nvidia-cap12",
      "/dev/nvidia-caps/nvidia-cap13"]),
])
def test_plan_devices(caps: tuple[str, ...], selected: list[Selected], want: list[str]) -> None:
    got = plan_devices(Request(capabilities=caps), selected, FACTS)
    assert paths(got) == want
    for n in got:  # numbers as the kernel has them, host paths under the driver root's dev dir
        rel = n.path[len("/dev/"):]
        assert (n.major, n.minor) == NODES[rel] and n.host_path == f"{DEV}/{rel}"


def test_mig_config_and_monitor_nodes() -> None:
    got = plan_devices(Request(capabilities=("utility",), mig_config=True, mig_monitor=True), [],
                       DeviceFacts(DEV, {**NODES, "nvidia-caps/nvidia-cap1": (237, 1),
                                         "nvidia-caps/nvidia-cap2": (237, 2)}, {},
                                   {"mig/config": 1, "mig/monitor": 2}))
    assert paths(got)[1:] == ["/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia-caps/nvidia-cap2"]


def test_a_missing_caps_node_takes_its_major_from_proc_devices() -> None:
    """nvidia-modprobe makes a caps node on demand on real hosts: the major is the
    driver's (/proc/devices), the minor the capability's."""
    nodes = {k: v for k, v in NODES.items() if not k.startswith("nvidia-caps/")}
    facts = DeviceFacts(DEV, {**nodes, "nvidia-caps/nvidia-cap12": None,
                              "nvidia-caps/nvidia-cap13": None},
                        {"nvidia-caps": 241}, {GI: 12, CI: 13})
    got = plan_devices(Request(capabilities=("utility",)), [Selected(GPU, MIG)], facts)
    assert [(n.path, n.major, n.minor) for n in got[2:]] == [
        ("/dev/nvidia-caps/nvidia-cap12", 241, 12), ("/dev/nvidia-caps/nvidia-cap13", 241, 13)]


@pytest.mark.parametrize(("nodes", "cap_minors", "caps", "message"), [
    ({"nvidia4": None}, {}, ("utility",),
     "device node /drv/dev/nvidia4 is missing (is the NVIDIA driver loaded?)"),
    ({"nvidiactl": "not a character device"}, {}, ("utility",),
     "/drv/dev/nvidiactl is not a character device"),
    ({"nvidia-uvm": "Permission denied"}, {}, ("compute",),
     "device node /drv/dev/nvidia-uvm: Permission denied"),
    # no /proc/devices entry for a missing caps node: missing
    ({"nvidia-caps/nvidia-cap12": None}, {}, ("utility",),
     "device node /drv/dev/nvidia-caps/nvidia-cap12 is missing"),
    ({}, {GI: "/p/capabilities/gpu4/mig/gi1/access has no DeviceFileMinor line"}, ("utility",),
     "has no DeviceFileMinor line"),
])
def test_unusable_nodes_are_driver_errors(nodes: dict, cap_minors: dict,  # type: ignore[type-arg]
                                          caps: tuple[str, ...], message: str) -> None:
    facts = DeviceFacts(DEV, {**NODES, **nodes}, {}, {GI: 12, CI: 13, **cap_minors})
    with pytest.raises(DriverError) as e:
        plan_devices(Request(capabilities=caps), [Selected(GPU, MIG)], facts)
    assert message in str(e.value)


def test_a_node_the_request_does_not_need_may_be_missing() -> None:
    facts = DeviceFacts(DEV, {**NODES, "nvidia-modeset": None, "nvidia-uvm": "Permission denied"})
    assert paths(plan_devices(Request(capabilities=("utility",)), [Selected(GPU)], facts)) == [
        "/dev/nvidiactl", "/dev/nvidia4"]


@pytest.mark.parametrize(("modeset", "expected"), [
    (None, ["/dev/nvidiactl", "/dev/nvidia4"]),  # a headless host: left out, as NCT does
    ((195, 254), ["/dev/nvidiactl", "/dev/nvidia4", "/dev/nvidia-modeset"]),
    ("Permission denied", DriverError),  # there but unusable: refused
])
def test_display_takes_modeset_where_the_host_has_it(modeset: object, expected: object) -> None:
    facts = DeviceFacts(DEV, {**NODES, "nvidia-modeset": modeset}, {}, {})
    request = Request(capabilities=("display",))
    if expected is DriverError:
        with pytest.raises(DriverError, match="nvidia-modeset: Permission denied"):
            plan_devices(request, [Selected(GPU)], facts)
    else:
        assert paths(plan_devices(request, [Selected(GPU)], facts, [])) == expected


def test_drm_nodes_and_links() -> None:
    drm = drm_nodes(Request(capabilities=("display",)), [Selected(GPU)], FACTS)
    assert drm == [("0000:1b:00.0", "card1"), ("0000:1b:00.0", "renderD128")]
    assert drm_nodes(Request(capabilities=("compute",)), [Selected(GPU)], FACTS) == []
    links = plan_drm_links(drm)
    assert [(s.container_path, s.target) for s in links] == [
        ("/dev/dri/by-path/pci-0000:1b:00.0-card", "../card1"),
        ("/dev/dri/by-path/pci-0000:1b:00.0-render", "../renderD128")]
