"""A kubelet stand-in for nvctk's DaemonSets: a Pod template from deployments/, unedited,
run by podman the way a kubelet has its runtime run it, on a node whose / is a directory
of the test's (`Node.root`: the simulated driver at its /, its /etc, /run, /var/lib/kubelet).

What is carried over from the template, and how (the Kubernetes field -> podman):
- hostPath volumes -> binds of Node.root/<path>; `type: Directory` must exist (a Pod
  stays ContainerCreating otherwise: here, an error naming it), `DirectoryOrCreate` is
  made; configMap volumes -> the ConfigMap's files (from the same manifests), read-only;
- volumeMounts: readOnly -> ro, mountPropagation HostToContainer -> rslave, Bidirectional
  -> rshared (Node.root is a shared mount for it, as / is on a systemd node);
- env: values, the downward API's spec.nodeName and metadata.name/namespace; $(VAR) in
  command and args expanded as the kubelet does;
- securityContext: privileged, runAsUser, readOnlyRootFilesystem, capabilities,
  allowPrivilegeEscalation; hostPID;
- serviceAccountName -> the in-cluster config a kubelet gives (KUBERNETES_SERVICE_HOST/
  PORT, the token and ca.crt at /var/run/secrets/kubernetes.io/serviceaccount), for the
  API-server double (HTTPS);
- runtimeClassName nvidia -> podman --runtime: the node's nvctk-runtime (a wrapper that
  gives it the node's nvctk config, as /etc/nvctk/config.toml would on a node).
Not a kubelet: no restarts, no probes; the Pod's network is the node's (no CNI here), so
a port is reached on loopback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.podman import private_podman

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
PROPAGATION = {"HostToContainer": "rslave", "Bidirectional": "rshared", "None": "rprivate"}


@dataclass
class Node:
    root: Path  # the node's /
    name: str
    podman: list[str]  # argv prefix of a private podman
    env: dict[str, str]  # podman's env
    api_port: int = 0  # the API-server double's (HTTPS) port, for in-cluster configs
    ca_file: Path | None = None
    runtime: str = ""  # the node's `nvidia` handler: a runtime binary for podman --runtime
    configmaps: dict[str, dict[str, str]] = field(default_factory=dict)
    pods: list[str] = field(default_factory=list)  # containers started, by name

    def host(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def run(self, *args: str, timeout: float = 300, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([*self.podman, *args], capture_output=True, text=True,
                           timeout=timeout, env=self.env)
        if check:
            assert r.returncode == 0, f"podman {' '.join(args)}: {r.stderr}"
        return r

    def logs(self, name: str) -> str:
        r = self.run("logs", name, check=False)
        return r.stdout + r.stderr


def private_node(root: Path, work: Path, name: str) -> Node:
    _dirs, env, base = private_podman("podman", work)
    return Node(root, name, base, env)


def _expand(text: str, env: dict[str, str]) -> str:
    """$(VAR) as the kubelet expands it in command and args ($$ escapes; unknown stays)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                  text)


def _env(c: dict[str, Any], pod: dict[str, Any], node: Node, pod_name: str) -> dict[str, str]:
    out: dict[str, str] = {}
    fields = {"spec.nodeName": node.name, "metadata.name": pod_name,
              "metadata.namespace": pod.get("metadata", {}).get("namespace", "default")}
    for e in c.get("env", []):
        if "value" in e:
            out[e["name"]] = _expand(e["value"], out)
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in fields, f"downward API field {path} not played"
            out[e["name"]] = fields[path]
    return out


def _volume_source(v: dict[str, Any], node: Node, work: Path) -> Path:
    if "hostPath" in v:
        hp = v["hostPath"]
        src = node.host(hp["path"])
        kind = hp.get("type", "")
        if kind == "DirectoryOrCreate":
            src.mkdir(parents=True, exist_ok=True)
        elif kind == "Directory":
            assert src.is_dir(), f"hostPath {hp['path']} (type Directory) is not on the node"
        return src
    if "configMap" in v:
        name = v["configMap"]["name"]
        data = node.configmaps.get(name)
        assert data is not None or v["configMap"].get("optional"), f"no ConfigMap {name}"
        d = work / f"cm-{v['name']}"
        d.mkdir(parents=True, exist_ok=True)
        for k, text in (data or {}).items():
            (d / k).write_text(text)
        return d
    raise AssertionError(f"volume kind not played: {v}")


def run_daemonset(node: Node, ds: dict[str, Any], image: str, work: Path) -> list[str]:
    """Start each container of the DaemonSet's Pod template on node, detached; their
    podman names."""
    tmpl = ds["spec"]["template"]
    pod = tmpl["spec"]
    pod_name = f"{ds['metadata']['name']}-{uuid.uuid4().hex[:5]}"
    work.mkdir(parents=True, exist_ok=True)
    vols = {v["name"]: _volume_source(v, node, work) for v in pod.get("volumes", [])}
    names = []
    for c in pod["containers"]:
        assert c["image"] == image, (c["name"], c["image"])
        env = _env(c, {"metadata": ds["metadata"]}, node, pod_name)
        argv = ["run", "-d", "--name", f"{pod_name}-{c['name']}", "--network", "host"]
        if pod.get("hostPID"):
            argv += ["--pid", "host"]
        if pod.get("runtimeClassName"):
            assert pod["runtimeClassName"] == "nvidia" and node.runtime, "no nvidia handler"
            argv += ["--runtime", node.runtime]
        if pod.get("serviceAccountName"):
            sa = work / "serviceaccount"
            sa.mkdir(exist_ok=True)
            (sa / "token").write_text("token-of-" + pod["serviceAccountName"])
            (sa / "namespace").write_text(ds["metadata"].get("namespace", "default"))
            assert node.ca_file is not None, "the API server's CA"
            (sa / "ca.crt").write_bytes(node.ca_file.read_bytes())
            argv += ["--mount", f"type=bind,src={sa},dst={SA_DIR},ro"]
            env |= {"KUBERNETES_SERVICE_HOST": "127.0.0.1",
                    "KUBERNETES_SERVICE_PORT": str(node.api_port)}
        for m in c.get("volumeMounts", []):
            opts = [f"type=bind,src={vols[m['name']]},dst={m['mountPath']}"]
            if m.get("readOnly"):
                opts.append("ro")
            prop = m.get("mountPropagation")
            if prop:
                opts.append(f"bind-propagation={PROPAGATION[prop]}")
            argv += ["--mount", ",".join(opts)]
        argv += _security_argv(c.get("securityContext", {}), node)
        for k, v in env.items():
            argv += ["--env", f"{k}={v}"]
        command = [_expand(a, env) for a in c.get("command", [])]
        args = [_expand(a, env) for a in c.get("args", [])]
        if command:
            argv += ["--entrypoint", json.dumps(command)]
        node.run(*argv, image, *args)
        names.append(f"{pod_name}-{c['name']}")
    node.pods += names
    return names


def _security_argv(sc: dict[str, Any], node: Node) -> list[str]:
    """podman run's options for a container's securityContext."""
    argv: list[str] = []
    if sc.get("privileged"):
        # a privileged container gets the node's devices: the simulated GPUs' (and
        # the simulated hardware's shared state, as every GPU process sees it)
        argv.append("--privileged")
        argv += [a for d in _sim_devices(node) for a in ("--device", f"{d}:/{d.relative_to(node.root)}")]
        argv += ["--mount", f"type=bind,src={node.host('/run/nvidia-sim')},dst=/run/nvidia-sim"]
    if "runAsUser" in sc:
        argv += ["--user", str(sc["runAsUser"])]
    if sc.get("readOnlyRootFilesystem"):
        argv.append("--read-only")
    if sc.get("allowPrivilegeEscalation") is False:
        argv += ["--security-opt", "no-new-privileges"]
    for cap in sc.get("capabilities", {}).get("drop", []):
        argv += ["--cap-drop", cap.lower()]
    for cap in sc.get("capabilities", {}).get("add", []):
        argv += ["--cap-add", cap.lower()]
    return argv


def _sim_devices(node: Node) -> list[Path]:
    dev = node.host("/dev")
    return sorted(p for p in [*dev.glob("nvidia*"), *dev.glob("nvidia-caps/*"), *dev.glob("dri/*")]
                  if p.is_char_device())


def stop(node: Node, name: str, timeout: int = 120) -> int:
    """SIGTERM, as the kubelet stops a deleted Pod's container (its grace period, then
    SIGKILL); the container's exit code."""
    node.run("stop", "-t", str(timeout), name, timeout=timeout + 60)
    r = node.run("inspect", "-f", "{{.State.ExitCode}}", name)
    return int(r.stdout.strip())


def remove_all(node: Node) -> None:
    for name in node.pods:
        node.run("rm", "-f", "-t", "0", name, check=False)
    node.pods.clear()


def shared_root(root: Path) -> None:
    """Node.root made a shared mount point of its own (Bidirectional mounts need it, as
    a systemd node's / is shared)."""
    subprocess.run(["mount", "--bind", str(root), str(root)], check=True)
    subprocess.run(["mount", "--make-rshared", str(root)], check=True)


def wrapper_runtime(path: Path, runtime: str, env: dict[str, str]) -> str:
    """A runtime binary that runs `runtime` with env (the node's nvctk config)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    exports = " ".join(f"{k}='{v}'" for k, v in env.items())
    path.write_text(f'#!/bin/sh\nexec env {exports} {runtime} "$@"\n')
    os.chmod(path, 0o755)
    return str(path)
