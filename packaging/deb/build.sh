#!/usr/bin/env bash
# Build nvctk_<version>_<arch>.deb without debhelper: nvctk and its Python
# dependencies go to /usr/lib/nvctk/python (so they never clash with Debian's
# python3-* packages), libvgpu.so to /usr/lib/nvctk/, the launchers to /usr/bin.
#   packaging/deb/build.sh [OUTDIR]      (default: dist/)
# PYTHON (default /usr/bin/python3) must be the python3 of the Debian release the
# package is for: the dependencies' compiled extensions are built for it.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=$(mkdir -p "${1:-$repo/dist}" && cd "${1:-$repo/dist}" && pwd)
python=${PYTHON:-/usr/bin/python3}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml" | head -1)
arch=$(dpkg --print-architecture)
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
pynext=$("$python" -c 'import sys; print("%d.%d" % (sys.version_info[0], sys.version_info[1] + 1))')
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
src=$work/src stage=$work/stage lib=$work/stage/usr/lib/nvctk

# Build from a clean copy: setuptools' build/ in the tree may hold stale modules,
# and libvgpu is compiled afresh (setup.py's build_py runs make and puts the
# library into the wheel as nvctk/lib/libvgpu.so).
mkdir -p "$src"
tar -C "$repo" --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./dist \
  --exclude='*.egg-info' --exclude=__pycache__ --exclude=./libvgpu/build -cf - . \
  | tar -C "$src" -xf -
"$python" -m pip wheel -q --no-deps --wheel-dir "$work/wheel" "$src"
mkdir -p "$stage/DEBIAN" "$stage/usr/bin" "$lib" "$stage/etc/nvctk"
"$python" -m pip install -q --no-compile --no-warn-script-location --target "$lib/python" \
  "$work"/wheel/nvctk-*.whl
# the wheel's scripts are the compiled launchers (runtime_shim/launcher.c): from
# /usr/bin they find the package in ../lib/nvctk/python and run /usr/bin/python3
mv "$lib/python/bin/nvctk" "$lib/python/bin/nvctk-hook" "$lib/python/bin/nvctk-runtime" \
  "$stage/usr/bin/"
rm -rf "$lib/python/bin"
"$python" -m compileall -q -j0 "$lib/python" >/dev/null

# one copy of the library, where the config below names it; the package's own
# nvctk/lib/libvgpu.so (what nvctk.paths looks for) points at it
if [ ! -f "$lib/python/nvctk/lib/libvgpu.so" ]; then
  echo "build.sh: the wheel lacks nvctk/lib/libvgpu.so" >&2
  exit 1
fi
mv "$lib/python/nvctk/lib/libvgpu.so" "$lib/libvgpu.so"
chmod 0644 "$lib/libvgpu.so"
ln -s ../../../libvgpu.so "$lib/python/nvctk/lib/libvgpu.so"

cat > "$stage/etc/nvctk/config.toml" <<'TOML'
# nvctk configuration; `nvctk config default` lists every key with its default.
vgpu-library = "/usr/lib/nvctk/libvgpu.so"
hook-path = "/usr/bin/nvctk-hook"
TOML

# bytecode that another python3 writes at run time is not in the package's list
cat > "$stage/DEBIAN/postrm" <<'SH'
#!/bin/sh
set -e
if [ "$1" = remove ] || [ "$1" = purge ]; then
  rm -rf /usr/lib/nvctk/python
fi
SH
chmod 0755 "$stage/DEBIAN/postrm"

size=$(du -sk --exclude=DEBIAN "$stage" | cut -f1)
cat > "$stage/DEBIAN/control" <<CTRL
Package: nvctk
Version: $version
Architecture: $arch
Maintainer: nvctk developers <dev@nvctk.invalid>
Depends: python3 (>= $pyver), python3 (<< $pynext), runc | crun
Suggests: containerd | docker.io
Installed-Size: $size
Section: admin
Priority: optional
Description: GPU container toolkit with GPU sharing
 A runc wrapper, an OCI prestart hook and a host CLI that give containers
 NVIDIA GPUs, whole or shared, with libvgpu capping GPU memory and SM share.
CTRL
echo /etc/nvctk/config.toml > "$stage/DEBIAN/conffiles"
deb=$out/nvctk_${version}_${arch}.deb
dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >/dev/null
echo "$deb"
