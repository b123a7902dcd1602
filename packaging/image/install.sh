#!/bin/sh
# nvctk's installer role (the image's entrypoint): copy nvctk onto the host's file system
# and wire it into the host's container engine, as the GPU Operator's toolkit container
# does.
#
#   install.sh [--host DIR] [--prefix PATH] [--runtime containerd|docker|crio]
#              [--engine-config PATH] [--driver-root DIR]
#              [--restart-mode signal|systemd|none] [--socket PATH] [--restart-timeout S]
#              [--wait] [--uninstall] [-- CONFIGURE-ARGS...]
#
# --host: where the host's / is mounted (default /host). --prefix: the install
# dir as the host sees it (default /usr/local/nvctk): bin/ (nvctk, nvctk-hook,
# nvctk-runtime and the python3 they start), lib/python3.11 (its stdlib),
# lib/nvctk/{python,libvgpu.so}. The host needs only glibc >= 2.36: the
# interpreter comes along, so the host's python3 (or none) does not matter.
# --engine-config: the engine's config as the host sees it (default: configure's).
# --driver-root: where the NVIDIA driver is on the host (/, or a driver container's
# /run/nvidia/driver): checked first (no driver there: nothing is installed), then
# written with the hook's host path into the host's nvctk config.
# The host's nvctk config (/etc/nvctk/config.toml) is the installer's to write only when
# the host has none (or the installer made it; its --uninstall deletes it): for
# containerd and CRI-O (Kubernetes) it is `nvctk config default --kubernetes` (a
# container's env selects no GPU: only the kubelet's allocations do), with --driver-root's
# driver-root and hook-path. One the host has already is kept: --driver-root is then
# refused, and a warning says so where it leaves the env path open.
# --restart-mode: then make the engine take the config (signal: SIGHUP, which needs the
# host's pids; systemd: systemctl restart in the host's root; none: the message says
# how) and wait until it answers with the runtime (`nvctk configure --restart-mode`);
# an engine that does not come back gets its config back and is restarted again.
# --socket: the engine's socket as the host sees it (default: configure's).
# CONFIGURE-ARGS go to `nvctk configure` (e.g. --set-as-default, --cdi).
# --runtime docker also puts nvctk's nvidia-container-runtime-hook into the host's
# /usr/local/bin when that name is free there: dockerd accepts `--gpus` only when a
# binary of that name is on its PATH at its start; nvctk-runtime removes the hook
# from every spec, and run by another runtime it refuses the container.
# --wait: stay up (a DaemonSet's container) and undo everything on SIGTERM.
# --uninstall: undo (configure --remove, then delete the prefix) and exit.
# The installer owns only the directory it created (it holds .nvctk-installer): a
# prefix that exists without that mark (/, /usr/local, anyone's directory) is
# refused, for install and uninstall alike, and nothing is touched. An image older
# than the nvctk it installed there is refused too (use the newer image).
set -eu
host=/host prefix=/usr/local/nvctk runtime=containerd engine_config= wait=0 uninstall=0
driver_root= restart_mode=none socket= restart_timeout=60
while [ $# -gt 0 ]; do
  case $1 in
    --host) host=$2; shift 2;;
    --prefix) prefix=$2; shift 2;;
    --runtime) runtime=$2; shift 2;;
    --engine-config) engine_config=$2; shift 2;;
    --driver-root) driver_root=$2; shift 2;;
    --restart-mode) restart_mode=$2; shift 2;;
    --socket) socket=$2; shift 2;;
    --restart-timeout) restart_timeout=$2; shift 2;;
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
case $runtime in
  containerd) default_config=/etc/containerd/config.toml default_socket=/run/containerd/containerd.sock;;
  docker) default_config=/etc/docker/daemon.json default_socket=/var/run/docker.sock;;
  crio) default_config=/etc/crio/crio.conf default_socket=/var/run/crio/crio.sock;;
  *) echo "nvctk-installer: unknown runtime $runtime" >&2; exit 2;;
esac
engine_config=${engine_config:-$default_config}
socket=${socket:-$default_socket}

case $restart_mode in signal|systemd|none) ;; *)
  echo "nvctk-installer: --restart-mode $restart_mode: one of signal, systemd, none" >&2; exit 2;;
esac
version=$(dpkg-query -W -f '${Version}' nvctk 2>/dev/null || echo 0)
# the host's nvctk config when the installer writes one, and the name dockerd looks for
# before it accepts --gpus
host_config=/etc/nvctk/config.toml
gpus_hook=/usr/local/bin/nvidia-container-runtime-hook
config_mark="# made by nvctk-installer: its --uninstall deletes this file"

configure() {
  mkdir -p "$(dirname "$host$engine_config")"
  # configure checks that --runtime-path exists: make the host's path valid in here too
  if [ ! -e "$prefix" ] && [ -e "$dest" ]; then
    mkdir -p "$(dirname "$prefix")"
    ln -s "$dest" "$prefix"
  fi
  set -- --restart-mode "$restart_mode" --host-root "$host" --restart-timeout "$restart_timeout" \
    --socket "$host$socket" "$@"
  nvctk configure --runtime "$runtime" --config "$host$engine_config" \
    --runtime-path "$prefix/bin/nvctk-runtime" "$@"
}

is_ours() {  # the host's nvctk config is the installer's (its mark on the first line)
  [ -f "$host$host_config" ] && [ ! -L "$host$host_config" ] && \
    [ "$(head -n 1 "$host$host_config")" = "$config_mark" ]
}

node_config() {  # what the installer writes as the host's nvctk config ("": nothing)
  case $runtime in
    containerd|crio) nvctk config default --kubernetes | grep -v '^#' | \
      if [ -n "$driver_root" ]; then
        sed -e "s|^driver-root = .*|driver-root = \"$driver_root\"|" \
            -e "s|^hook-path = .*|hook-path = \"$prefix/bin/nvctk-hook\"|"
      else cat; fi;;
    *) if [ -n "$driver_root" ]; then
         printf 'driver-root = "%s"\nhook-path = "%s"\n' "$driver_root" "$prefix/bin/nvctk-hook"
       fi;;
  esac
}

write_node_config() {
  if [ -e "$host$host_config" ] || [ -L "$host$host_config" ]; then
    if ! is_ours; then
      case $runtime in containerd|crio)
        if ! NVCTK_CONFIG=$host$host_config nvctk config show | \
            grep -qx 'accept-envvar-when-unprivileged = false'; then
          echo "nvctk-installer: WARNING: $host_config lets a container's env select GPUs (any" \
               "Pod with NVIDIA_VISIBLE_DEVICES=all gets every GPU, uncapped): set" \
               "accept-envvar-when-unprivileged = false and accept-volume-mount-devices = true" \
               "there (nvctk config default --kubernetes)" >&2
        fi;;
      esac
      return 0
    fi
  fi
  text=$(node_config)
  [ -n "$text" ] || return 0
  mkdir -p "$host$(dirname "$host_config")"
  printf '%s\n%s\n' "$config_mark" "$text" > "$host$host_config.new"
  mv "$host$host_config.new" "$host$host_config"
  echo "nvctk-installer: wrote $host_config${driver_root:+ (driver-root $driver_root)}"
}

remove_files() {
  # each only while it is the installer's: its mark, its link into the prefix
  if is_ours; then
    rm -f "$host$host_config"
    rmdir "$host$(dirname "$host_config")" 2>/dev/null || true
  fi
  if [ -L "$host$gpus_hook" ] && [ "$(readlink "$host$gpus_hook")" = "$prefix/bin/nvidia-container-runtime-hook" ]; then
    rm -f "$host$gpus_hook"
  fi
  # checked again: the tree is deleted only while it carries the installer's mark
  if [ -f "$dest/$mark" ] && [ ! -L "$dest" ]; then
    rm -rf --one-file-system "$dest"
  fi
}

uninstall() {
  configure --remove
  remove_files
  echo "nvctk-installer: removed $prefix and the $runtime runtime entry"
}

if [ "$uninstall" = 1 ]; then
  uninstall
  exit 0
fi

# an older image never replaces a newer nvctk it installed (a rollout gone backwards)
if [ -f "$dest/$mark" ]; then
  had=$(sed -n 's/^version //p' "$dest/$mark")
  if [ -n "$had" ] && dpkg --compare-versions "$version" lt "$had"; then
    echo "nvctk-installer $version: $prefix holds nvctk $had, installed by a newer image:" \
      "run that image (or --uninstall with it first); nothing changed" >&2
    exit 2
  fi
fi
if [ -n "$driver_root" ]; then
  case $driver_root in /*) ;; *)
    echo "nvctk-installer: --driver-root $driver_root: must be absolute" >&2; exit 2;;
  esac
  # the driver where the host's runtime will look for it, or nothing is installed
  if ! out=$(nvctk --driver-root "$host$driver_root" --host-driver-root "$driver_root" \
      labels 2>&1 >/dev/null); then
    echo "nvctk-installer: $out" | sed 's/^nvctk-installer: Error: /nvctk-installer: /' >&2
    echo "nvctk-installer: nothing installed (--driver-root $driver_root)" >&2
    exit 1
  fi
  if { [ -e "$host$host_config" ] || [ -L "$host$host_config" ]; } && ! is_ours; then
    echo "nvctk-installer: the host's $host_config exists and is not the installer's:" \
      "set driver-root = \"$driver_root\" there yourself, or run without --driver-root;" \
      "nothing changed" >&2
    exit 2
  fi
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
install -m 0755 /usr/lib/nvctk/nvidia-container-runtime-hook "$new/bin/"
printf 'made by nvctk-installer: its --uninstall deletes this directory\nversion %s\n' \
  "$version" > "$new/$mark"
if [ -e "$dest" ]; then
  mv "$dest" "$new.old"
fi
mv "$new" "$dest"
rm -rf "$new.old"
echo "nvctk-installer: installed nvctk $version in $prefix"
write_node_config
if [ "$runtime" = docker ] && [ ! -e "$host$gpus_hook" ] && [ ! -L "$host$gpus_hook" ]; then
  mkdir -p "$host$(dirname "$gpus_hook")"
  ln -s "$prefix/bin/nvidia-container-runtime-hook" "$host$gpus_hook"
  echo "nvctk-installer: $gpus_hook for docker run --gpus (restart dockerd once: it looks at its start)"
fi
if ! configure "$@"; then
  # the engine's config is back as it was (configure undid it): nothing else stays
  [ -z "$new" ] || rm -rf "$new" "$new.old"
  remove_files
  echo "nvctk-installer: nothing installed: the $runtime configuration failed (above)" >&2
  exit 1
fi

if [ "$wait" = 1 ]; then
  # sleep in the background: a trap runs only between commands
  while :; do sleep 3600 & wait $! || true; done
fi
