"""Env -> request (REFERENCE §5): device forms, capabilities, policies."""

from __future__ import annotations

import re
from typing import Any

import pytest

from nvctk.base.config import ALL_CAPABILITIES, Config
from nvctk.base.errors import RequestError
from nvctk.request.parse import Request, request_from_spec

PRIV = {"bounding": ["CAP_CHOWN", "CAP_SYS_ADMIN"]}
UNPRIV = {"bounding": ["CAP_CHOWN", "CAP_KILL"]}


def spec(env: dict[str, str] | None = None, caps: dict[str, Any] | None = None,
         mounts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    proc: dict[str, Any] = {"env": [f"{k}={v}" for k, v in (env or {}).items()]}
    if caps is not None:
        proc["capabilities"] = caps
    return {"process": proc, "mounts": mounts or []}


def req(env: dict[str, str], **kw: Any) -> Request | None:
    cfg = kw.pop("config", Config())
    return request_from_spec(spec(env, **kw), cfg)


NVD = "NVIDIA_VISIBLE_DEVICES"

# env -> (all_devices, devices) or None (not a GPU container)
DEVICE_CASES: list[tuple[dict[str, str], tuple[bool, tuple[str, ...]] | None]] = [
    ({}, None),
    ({NVD: "all"}, (True, ())),
    ({NVD: "0,all"}, (True, ())),
    ({NVD: "none"}, (False, ())),
    ({NVD: "0,none"}, (False, ())),
    ({NVD: "void"}, None),
    ({NVD: ""}, None),
    ({NVD: " , "}, None),
    ({NVD: "0"}, (False, ("0",))),
    ({NVD: " 1 , 0 ,1"}, (False, ("1", "0"))),  # trimmed, duplicates dropped
    ({NVD: "GPU-ABC,gpu-def"}, (False, ("GPU-ABC", "gpu-def"))),
    ({NVD: "00000000:1B:00.0"}, (False, ("00000000:1B:00.0",))),
    ({NVD: "MIG-xyz,0:1"}, (False, ("MIG-xyz", "0:1"))),
    # legacy CUDA image: unset means all
    ({"CUDA_VERSION": "11.0.3"}, (True, ())),
    ({"CUDA_VERSION": "11.0.3", "NVIDIA_REQUIRE_CUDA": ""}, (True, ())),
    ({"CUDA_VERSION": "11.0.3", "NVIDIA_REQUIRE_CUDA": "cuda>=11.0"}, None),
    ({"CUDA_VERSION": "11.0.3", NVD: "void"}, None),
]


@pytest.mark.parametrize(("env", "want"), DEVICE_CASES)
def test_devices(env: dict[str, str], want: tuple[bool, tuple[str, ...]] | None) -> None:
    r = req(env)
    if want is None:
        assert r is None
    else:
        assert r is not None and (r.all_devices, r.devices) == want


def test_later_env_duplicate_wins() -> None:
    s = {"process": {"env": [f"{NVD}=void", f"{NVD}=0"]}}
    r = request_from_spec(s, Config())
    assert r is not None and r.devices == ("0",)


@pytest.mark.parametrize(
    ("privileged", "accept", "gpu"),
    [(True, True, True), (True, False, True), (False, True, True), (False, False, False)],
)
def test_unprivileged_policy(privileged: bool, accept: bool, gpu: bool) -> None:
    cfg = Config(accept_envvar_when_unprivileged=accept)
    r = req({NVD: "0"}, caps=PRIV if privileged else UNPRIV, config=cfg)
    assert (r is not None) == gpu
    if r is not None:
        assert r.privileged == privileged


def test_no_capabilities_section_is_unprivileged() -> None:
    cfg = Config(accept_envvar_when_unprivileged=False)
    assert req({NVD: "0"}, config=cfg) is None


DEV_MOUNTS = [
    {"source": "/dev/null", "destination": "/var/run/nvidia-container-devices/1", "type": "bind"},
    {"source": "/dev/null", "destination": "/var/run/nvidia-container-devices/GPU-a",
     "type": "bind"},
    {"source": "/x", "destination": "/var/run/nvidia-container-devices/7", "type": "bind"},
]


def test_volume_mount_devices_allowed() -> None:
    cfg = Config(accept_volume_mount_devices=True, accept_envvar_when_unprivileged=False)
    r = req({NVD: "0"}, caps=UNPRIV, mounts=DEV_MOUNTS, config=cfg)
    assert r is not None and r.devices == ("1", "GPU-a")  # the env is ignored
    assert "nvidia-container-devices" in r.source
    r = req({}, mounts=[{"source": "/dev/null",
                         "destination": "/var/run/nvidia-container-devices/all"}], config=cfg)
    assert r is not None and r.all_devices


def test_volume_mount_devices_not_allowed() -> None:
    r = req({NVD: "0"}, mounts=DEV_MOUNTS, config=Config(accept_volume_mount_devices=False))
    assert r is not None and r.devices == ("0",)
    assert req({}, mounts=DEV_MOUNTS, config=Config()) is None


CAPS = "NVIDIA_DRIVER_CAPABILITIES"
CAP_CASES: list[tuple[dict[str, str], tuple[str, ...]]] = [
    ({}, ("compute", "utility")),
    ({CAPS: ""}, ("compute", "utility")),
    ({CAPS: "utility"}, ("utility",)),
    ({CAPS: "video, compute"}, ("compute", "video")),
    ({CAPS: "all"}, ALL_CAPABILITIES),
    ({CAPS: "graphics,all"}, ALL_CAPABILITIES),
    ({"CUDA_VERSION": "10.2"}, ALL_CAPABILITIES),  # legacy image, unset: all
    ({"CUDA_VERSION": "10.2", CAPS: "utility"}, ("utility",)),
]


@pytest.mark.parametrize(("env", "want"), CAP_CASES)
def test_capabilities(env: dict[str, str], want: tuple[str, ...]) -> None:
    r = req({NVD: "all", **env})
    assert r is not None and r.capabilities == want


def test_capabilities_limited_by_host() -> None:
    cfg = Config(supported_capabilities=("utility", "compute"))
    r = req({NVD: "all", CAPS: "all"}, config=cfg)
    assert r is not None and r.capabilities == ("compute", "utility")
    r = req({NVD: "all", CAPS: "graphics,utility"}, config=cfg)
    assert r is not None and r.capabilities == ("utility",)


def test_unknown_capability_is_named() -> None:
    with pytest.raises(RequestError, match="'compte'"):
        req({NVD: "0", CAPS: "utility,compte"})


def test_unknown_capability_ignored_without_gpu() -> None:
    assert req({NVD: "void", CAPS: "bogus"}) is None


def test_requirements_collected() -> None:
    r = req({NVD: "0", "NVIDIA_REQUIRE_CUDA": "cuda>=12.0", "NVIDIA_REQUIRE_ARCH": "arch>=8.0",
             "NVIDIA_REQUIRE_EMPTY": " "})
    assert r is not None and r.requirements == ("arch>=8.0", "cuda>=12.0")
    r = req({"CUDA_VERSION": "11.4.2"})
    assert r is not None and r.requirements == ("cuda>=11.4",)
    r = req({NVD: "0", "NVIDIA_DISABLE_REQUIRE": "true"})
    assert r is not None and r.disable_require
    r = req({NVD: "0", "NVIDIA_DISABLE_REQUIRE": "yes-please"})
    assert r is not None and not r.disable_require


def test_mig_config_needs_privilege() -> None:
    r = req({NVD: "0", "NVIDIA_MIG_CONFIG_DEVICES": "all"}, caps=PRIV)
    assert r is not None and r.mig_config and not r.mig_monitor
    with pytest.raises(RequestError, match="NVIDIA_MIG_MONITOR_DEVICES"):
        req({NVD: "0", "NVIDIA_MIG_MONITOR_DEVICES": "all"}, caps=UNPRIV)


def test_request_env_is_no_part_of_its_value() -> None:
    """env is the whole environment: not compared, never in a repr (secrets)."""
    a = Request(devices=("0",), env={"TOKEN": "secret"})
    b = Request(devices=("0",))
    assert a == b
    assert "secret" not in repr(a) and "devices=('0',)" in repr(a)
    assert a != b.replace(devices=("1",))
    assert b.env == {} and Request().env is not b.env


MPS = [
    ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}, None),
    ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": " 100 "}, None),
    ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "0"}, "whole percentage from 1 to 100"),
    ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "101"}, "whole percentage"),
    ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50.5"}, "whole percentage"),
    ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "\u0665\u0660"}, "whole percentage"),  # Arabic-Indic 50
    ({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8G"}, None),
    ({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8G,1=512M"}, None),
    ({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "GPU-1234=1GiB"}, None),
    ({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "8G"}, "bad item '8G'"),
    ({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=lots"}, "<device>=<size>"),
    ({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=0"}, "bad item '0=0'"),
    ({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "x=1G"}, "bad item 'x=1G'"),
]


@pytest.mark.parametrize(("env", "error"), MPS)
def test_mps_share_checked_at_create(env: dict[str, str], error: str | None) -> None:
    spec = {"process": {"env": ["NVIDIA_VISIBLE_DEVICES=0", *(f"{k}={v}" for k, v in env.items())]}}
    if error is None:
        assert request_from_spec(spec, Config(accept_envvar_when_unprivileged=True)) is not None
    else:
        with pytest.raises(RequestError, match=re.escape(error)):
            request_from_spec(spec, Config(accept_envvar_when_unprivileged=True))
    # no GPU asked for: not nvctk's to judge
    spec["process"]["env"] = spec["process"]["env"][1:]
    assert request_from_spec(spec, Config(accept_envvar_when_unprivileged=True)) is None


@pytest.mark.parametrize(("own", "want"), [
    (None, ("nvidia.com/gpu=1",)),  # containerd: the spec's annotations are the container's
    ('{"cdi.k8s.io/dp": "nvidia.com/gpu=1"}', ("nvidia.com/gpu=1",)),  # CRI-O: its own
    ("{}", None),  # CRI-O: a Pod's own annotation, copied in: names nothing
    ('{"cdi.k8s.io/dp": "nvidia.com/gpu=0"}', None),  # another value than the container's
    ("not json", None),  # unreadable: none trusted
])
def test_only_the_containers_own_cdi_annotation_names_devices(own: str | None,
                                                              want: tuple[str, ...] | None) -> None:
    """Issue 39: CRI-O copies a Pod's annotations into its containers' specs; a Pod's
    `cdi.k8s.io/` annotation must not name a GPU where the env cannot."""
    ann = {"cdi.k8s.io/dp": "nvidia.com/gpu=1"}
    if own is not None:
        ann["io.kubernetes.cri-o.Annotations"] = own
    spec = {"annotations": ann, "process": {"env": []}}
    r = request_from_spec(spec, Config(accept_envvar_when_unprivileged=False))
    assert (r.cdi_devices if r is not None else None) == want
