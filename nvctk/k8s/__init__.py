"""nvctk's Kubernetes device plugin (kubelet API v1beta1) and GFD-style node labels."""

# here, not in .server: `nvctk --help` must not import grpc for a default
DEFAULT_KUBELET_DIR = "/var/lib/kubelet/device-plugins"
