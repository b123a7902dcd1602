"""The generated gRPC code of the kubelet's DRA plugin APIs (nvctk/dra/third_party), or a
clear error saying how to make it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from nvctk.k8s.proto import ProtoMissing


def load() -> Any:
    """The modules as attributes: v1, v1_grpc, v1beta1, v1beta1_grpc, health,
    health_grpc, reg, reg_grpc."""
    try:  # generated at build time: its absence is a clear error, not an ImportError
        from nvctk.dra.third_party import (
            dra_health_v1alpha1_pb2,
            dra_health_v1alpha1_pb2_grpc,
            dra_v1_pb2,
            dra_v1_pb2_grpc,
            dra_v1beta1_pb2,
            dra_v1beta1_pb2_grpc,
            pluginregistration_v1_pb2,
            pluginregistration_v1_pb2_grpc,
        )
    except ImportError as e:
        raise ProtoMissing(
            f"the DRA plugin's generated gRPC code is missing ({e}): build it with "
            "`python -m nvctk.k8s.gen` (needs grpcio-tools; `make setup` runs it)"
        ) from None
    return SimpleNamespace(
        v1=dra_v1_pb2, v1_grpc=dra_v1_pb2_grpc, v1beta1=dra_v1beta1_pb2,
        v1beta1_grpc=dra_v1beta1_pb2_grpc, health=dra_health_v1alpha1_pb2,
        health_grpc=dra_health_v1alpha1_pb2_grpc, reg=pluginregistration_v1_pb2,
        reg_grpc=pluginregistration_v1_pb2_grpc)
