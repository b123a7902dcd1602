#!/bin/sh
# nvctk-installer's entrypoint: copy nvctk onto the host's file system and wire it
# into the host's container engine, as the GPU Operator's toolkit container does.
#
#   install.sh [--host DIR] [--prefix PATH] [--runtime containerd|docker|crio]
#              [--engine-config PATH] [--wait] [--uninstall] [-- CONFIGURE-ARGS...]
#
# --host: where the host's / is mounted (default /host). --prefix: the install
# dir as the host sees it (default /usr/local/nvctk): bin/ (nvctk, nvctk-hook,
# nvctk-runtime and the python3 they start), lib/python3.11 (its stdlib),
# lib/nvctk/{python,libvgpu.so}. The host needs only glibc >= 2.36: the
# interpreter comes along, so the host's python3 (or none) does not matter.
# --engine-config: the engine's config as the host sees it (default: configure's).
# CONFIGURE-ARGS go to `nvctk configure` (e.g. --set-as-default, --cdi).
# --wait: stay up (a DaemonSet's container) and undo everything on SIGTERM.
# --uninstall: undo (configure --remove, then delete the prefix) and exit.
# The installer owns only the directory it created (it holds .nvctk-installer): a
# prefix that exists without that mark (/, /usr/local, anyone's directory) is
# refused, for install and uninstall alike, and nothing is touched.
# The engine is not restarted: the message says to, as `nvctk configure` does.
# For containerd and CRI-O (Kubernetes) the host's nvctk config (/etc/nvctk/config.toml)
# is written when it has none, as `nvctk config default --kubernetes` (a container's env
# selects no GPU: only the kubelet's allocations do), and removed by --uninstall while
# it is the installer's unchanged; one the host has already is kept, with a warning
# where it leaves the env path open.
set -eu
host=/host prefix=/usr/local/nvctk runtime=containerd engine_config= wait=0 uninstall=0
while [ $# -gt 0 ]; do
  case $1 in
    --host) host=$2; shift 2;;
    --prefix) prefix=$2; shift 2;;
    --runtime) runtime=$2; shift 2;;
    --engine-config) engine_config=$2; shift 2;;
    --wait) wait=1; shift;;
    --uninstall) uninstall=1; shift;;
    --) shift; break;;
    *) echo "nvctk-installer: unknown argument $1 (see $0)" >&2; exit 2;;
  esac
done
refuse() { echo "nvctk-installer: --prefix $prefix: $*; nothing changed" >&2; exit 2; }
case $prefix in /*) ;; *) refuse "must be absolute";; esac
# one spelling per directory: no //, /./, /../, trailing / (and so never / itself)
case $prefix in
  /) refuse "is the host's root";;
  */|*//*|*/./*|*/.|*/../*|*/..) refuse "must be a plain path (no '.', '..', '//' or trailing '/')";;
esac
if [ ! -d "$host" ]; then
  echo "nvctk-installer: $host is not a directory: mount the host's / there" >&2
  exit 2
fi
dest=$host$prefix
mark=.nvctk-installer
if [ -L "$dest" ]; then
  refuse "is a symbolic link on the host"
elif [ -e "$dest" ] && { [ ! -d "$dest" ] || [ ! -f "$dest/$mark" ] || [ -L "$dest/$mark" ]; }; then
  # never replace or delete what this installer did not make: moving /usr/local aside
  # and deleting it is what an unchecked prefix does
  refuse "exists and was not made by nvctk-installer (no $mark in it): choose a new directory, e.g. /usr/local/nvctk"
fi
if [ -z "$engine_config" ]; then
  case $runtime in
    containerd) engine_config=/etc/containerd/config.toml;;
    docker) engine_config=/etc/docker/daemon.json;;
    crio) engine_config=/etc/crio/crio.conf;;
    *) echo "nvctk-installer: unknown runtime $runtime" >&2; exit 2;;
  esac
fi

configure() {
  mkdir -p "$(dirname "$host$engine_config")"
  # configure checks that --runtime-path exists: make the host's path valid in here too
  if [ ! -e "$prefix" ] && [ -e "$dest" ]; then
    mkdir -p "$(dirname "$prefix")"
    ln -s "$dest" "$prefix"
  fi
  nvctk configure --runtime "$runtime" --config "$host$engine_config" \
    --runtime-path "$prefix/bin/nvctk-runtime" "$@"
}

node_config=$host/etc/nvctk/config.toml
config_mark="# made by nvctk-installer: its --uninstall deletes this file while unchanged"

write_node_config() {
  case $runtime in containerd|crio) ;; *) return 0;; esac
  if [ -e "$node_config" ] || [ -L "$node_config" ]; then
    if ! NVCTK_CONFIG=$node_config nvctk config show | grep -qx 'accept-envvar-when-unprivileged = false'; then
      echo "nvctk-installer: WARNING: $node_config lets a container's env select GPUs (any Pod" \
           "with NVIDIA_VISIBLE_DEVICES=all gets every GPU, uncapped): set" \
           "accept-envvar-when-unprivileged = false and accept-volume-mount-devices = true" \
           "there (nvctk config default --kubernetes)" >&2
    fi
    return 0
  fi
  mkdir -p "$(dirname "$node_config")"
  { echo "$config_mark"; nvctk config default --kubernetes; } > "$node_config.nvctk-new"
  mv "$node_config.nvctk-new" "$node_config"
  echo "nvctk-installer: wrote $node_config (Kubernetes: GPUs only from the kubelet's allocations)"
}

remove_node_config() {
  [ -f "$node_config" ] && [ ! -L "$node_config" ] || return 0
  { echo "$config_mark"; nvctk config default --kubernetes; } | cmp -s - "$node_config" || return 0
  rm -f "$node_config"
}

uninstall() {
  configure --remove
  remove_node_config
  # checked again: the tree is deleted only while it carries the installer's mark
  if [ -f "$dest/$mark" ] && [ ! -L "$dest" ]; then
    rm -rf --one-file-system "$dest"
  fi
  echo "nvctk-installer: removed $prefix and the $runtime runtime entry"
}

if [ "$uninstall" = 1 ]; then
  uninstall
  exit 0
fi

new=
if [ "$wait" = 1 ]; then
  # Trapped before anything is installed: as a container's PID 1 this shell would
  # otherwise drop a SIGTERM that comes while it installs (init ignores signals it
  # has no handler for), and stay up with nvctk installed. A trap runs once the
  # command in progress ends.
  trap '[ -z "$new" ] || rm -rf "$new" "$new.old"; uninstall; exit 0' TERM INT
fi

# a fresh copy beside the old one, then swapped in: an engine starting a
# container meanwhile finds the old tree or the new one, never half of one
pyver=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
mkdir -p "$(dirname "$dest")"
# a name of its own beside the target (nothing of the host's is ever reused)
new=$(mktemp -d "$dest.new.XXXXXX")
chmod 0755 "$new"
mkdir -p "$new/bin" "$new/lib/nvctk"
cp -a /usr/bin/nvctk /usr/bin/nvctk-hook /usr/bin/nvctk-runtime "$new/bin/"
cp -L "/usr/bin/python$pyver" "$new/bin/python3"
cp -a "/usr/lib/python$pyver" "$new/lib/"
cp -a /usr/lib/nvctk/python /usr/lib/nvctk/libvgpu.so "$new/lib/nvctk/"
echo "made by nvctk-installer: its --uninstall deletes this directory" > "$new/$mark"
if [ -e "$dest" ]; then
  mv "$dest" "$new.old"
fi
mv "$new" "$dest"
rm -rf "$new.old"
echo "nvctk-installer: installed nvctk $(dpkg-query -W -f '${Version}' nvctk) in $prefix"
write_node_config
configure "$@"

if [ "$wait" = 1 ]; then
  # sleep in the background: a trap runs only between commands
  while :; do sleep 3600 & wait $! || true; done
fi
