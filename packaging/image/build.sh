#!/usr/bin/env bash
# Build dist/nvctk-image.tar: nvctk's one image for every node role (installer, device
# plugin, DRA plugin, monitor, labels: each DaemonSet in deployments/ names its command),
# an OCI image archive (a tar of an OCI image layout, as `podman save --format
# oci-archive` writes) of a Debian 12 root made with debootstrap
# (packaging/debian-base.sh) with the nvctk .deb installed by apt; the installer role
# (packaging/image/install.sh) is its entrypoint. Only Debian's own tools: debootstrap,
# apt, umoci; no daemon, no registry.
#   packaging/image/build.sh [OUTDIR]   (default dist/; uses OUTDIR's nvctk .deb of
#                                        this version, else builds it)
# The image is named localhost/nvctk:<version> (index.json's ref.name, also written to
# OUTDIR/nvctk-image.name): `ctr images import` and `podman load` take that name.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=$(mkdir -p "${1:-$repo/dist}" && cd "${1:-$repo/dist}" && pwd)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml" | head -1)
arch=$(dpkg --print-architecture)
name=localhost/nvctk:$version
deb=$out/nvctk_${version}_${arch}.deb
[ -f "$deb" ] || deb=$(bash "$repo/packaging/deb/build.sh" "$out")
base=$(bash "$repo/packaging/debian-base.sh" base)

work=$(mktemp -d)
trap 'rm -rf --one-file-system "$work"' EXIT
root=$work/root
mkdir -p "$root"
tar -C "$root" --numeric-owner -xpf "$base"
cp "$deb" "$root/tmp/nvctk.deb"
# apt resolves the .deb's dependencies (python3, runc) from the mirror, as on a host
unshare --mount --propagation private -- sh -ec '
  root=$1
  mount -t proc proc "$root/proc"
  mount --rbind /dev "$root/dev"
  exec chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends /tmp/nvctk.deb
' build "$root" >"$work/apt.log" 2>&1 || { tail -20 "$work/apt.log" >&2; exit 1; }
install -m 0755 "$here/install.sh" "$root/usr/lib/nvctk/install.sh"
install -m 0755 "$here/nvidia-container-runtime-hook" "$root/usr/lib/nvctk/nvidia-container-runtime-hook"
# what an installer image does not need: apt's lists and archives, docs, the .deb
rm -rf "$root"/tmp/nvctk.deb "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin \
  "$root"/var/cache/apt/archives/*.deb "$root"/usr/share/doc/* "$root"/usr/share/man/* \
  "$root"/usr/share/locale/* "$root"/var/log/*.log "$root"/var/log/apt/*
find "$root/dev" -mindepth 1 -delete  # the engine provides /dev

layout=$work/oci
umoci init --layout "$layout"
umoci new --image "$layout:$version"
umoci insert --image "$layout:$version" "$root" /
umoci config --image "$layout:$version" --architecture "$arch" --os linux \
  --config.entrypoint /usr/lib/nvctk/install.sh --config.workingdir / \
  --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --config.label "org.opencontainers.image.version=$version" \
  --config.label "org.opencontainers.image.title=nvctk"
umoci gc --layout "$layout"
# the tag umoci wrote is a bare "VERSION": name the image fully, as image tools read it
python3 - "$layout/index.json" "$name" <<'PY'
import json, sys
path, name = sys.argv[1:]
with open(path) as f:
    index = json.load(f)
(manifest,) = index["manifests"]
manifest.setdefault("annotations", {})["org.opencontainers.image.ref.name"] = name
manifest["annotations"]["io.containerd.image.name"] = name
with open(path, "w") as f:
    json.dump(index, f)
PY
tar -C "$layout" --numeric-owner --owner=0 --group=0 -cf "$work/image.tar" oci-layout index.json blobs
mv "$work/image.tar" "$out/nvctk-image.tar"
echo "$name" > "$out/nvctk-image.name"
echo "$out/nvctk-image.tar"
