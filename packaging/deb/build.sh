#!/usr/bin/env bash
# Build nvctk_<version>_<arch>.deb without debhelper: nvctk and its Python
# dependencies go to /usr/lib/nvctk/python (so they never clash with Debian's
# python3-* packages), libvgpu.so to /usr/lib/nvctk/, thin launchers to /usr/bin.
#   packaging/deb/build.sh [OUTDIR]      (default: dist/)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$repo/dist}
python=${PYTHON:-/usr/bin/python3}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml" | head -1)
arch=$(dpkg --print-architecture)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

make -s -C "$repo/libvgpu"
mkdir -p "$stage/DEBIAN" "$stage/usr/bin" "$stage/usr/lib/nvctk" "$stage/etc/nvctk" "$out"
"$python" -m pip install -q --no-compile --target "$stage/usr/lib/nvctk/python" "$repo"
rm -rf "$stage/usr/lib/nvctk/python/bin"
install -m 0644 "$repo/libvgpu/build/libvgpu.so" "$stage/usr/lib/nvctk/libvgpu.so"

for exe in nvctk nvctk-hook; do
  mod=$([ $exe = nvctk ] && echo nvctk.cli.main || echo nvctk.hooks.main)
  cat > "$stage/usr/bin/$exe" <<SH
#!/usr/bin/python3 -I
import sys
sys.path.insert(0, "/usr/lib/nvctk/python")
from $mod import main
sys.exit(main())
SH
  chmod 0755 "$stage/usr/bin/$exe"
done
# the runtime's launcher finds /usr/bin/python3 beside itself; its package dir:
sed 's|^sys.path.insert(1, "/usr/lib/python3/dist-packages")|sys.path.insert(0, "/usr/lib/nvctk/python")|' \
  "$repo/runtime_shim/nvctk-runtime" > "$stage/usr/bin/nvctk-runtime"
chmod 0755 "$stage/usr/bin/nvctk-runtime"
cat > "$stage/etc/nvctk/config.toml" <<'TOML'
# nvctk configuration; `nvctk config default` lists every key with its default.
vgpu-library = "/usr/lib/nvctk/libvgpu.so"
hook-path = "/usr/bin/nvctk-hook"
TOML

size=$(du -sk "$stage" | cut -f1)
cat > "$stage/DEBIAN/control" <<CTRL
Package: nvctk
Version: $version
Architecture: $arch
Maintainer: nvctk developers <dev@nvctk.invalid>
Depends: python3 (>= 3.10), runc | crun
Suggests: containerd | docker.io
Installed-Size: $size
Section: admin
Priority: optional
Description: GPU container toolkit with GPU sharing
 A runc wrapper, an OCI prestart hook and a host CLI that give containers
 NVIDIA GPUs, whole or shared, with libvgpu capping GPU memory and SM share.
CTRL
echo /etc/nvctk/config.toml > "$stage/DEBIAN/conffiles"
dpkg-deb --root-owner-group --build "$stage" "$out/nvctk_${version}_${arch}.deb" >/dev/null
echo "$out/nvctk_${version}_${arch}.deb"
