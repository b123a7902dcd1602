"""nvctk's Kubernetes device plugin (kubelet API v1beta1) and GFD-style node labels."""
