"""The generated gRPC code for api.proto, or a clear error saying how to make it."""

from __future__ import annotations

from typing import Any

from nvctk.base.errors import NvctkError


class ProtoMissing(NvctkError):
    pass


def load() -> tuple[Any, Any]:
    """(api_pb2, api_pb2_grpc)."""
    try:  # generated at build time: its absence is a clear error, not an ImportError at import
        from nvctk.k8s import api_pb2, api_pb2_grpc
    except ImportError as e:
        raise ProtoMissing(
            f"the device plugin's generated gRPC code is missing ({e}): build it with "
            "`python -m nvctk.k8s.gen` (needs grpcio-tools; `make setup` runs it)"
        ) from None
    return api_pb2, api_pb2_grpc
