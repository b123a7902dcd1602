"""Where the kubelet keeps its device-plugin sockets (a module of its own: `nvctk --help`
must not import grpc for a default)."""

DEFAULT_KUBELET_DIR = "/var/lib/kubelet/device-plugins"
