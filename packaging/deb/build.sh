#!/usr/bin/env bash
# Build nvctk_<version>_<arch>.deb without debhelper: nvctk and its Python
# dependencies go to /usr/lib/nvctk/python (so they never clash with Debian's
# python3-* packages; why each is private: packaging/README.md), libvgpu.so to
# /usr/lib/nvctk/, the launchers to /usr/bin, /etc/nvctk/config.toml (a conffile).
#   packaging/deb/build.sh [OUTDIR]      (default: dist/)
# PYTHON (default /usr/bin/python3) must be the python3 of the Debian release the
# package is for: the dependencies' compiled extensions are built for it.
# Prints the .deb's path. Checked by lintian in tests/e2e/test_deb.py (overrides:
# packaging/deb/lintian-overrides, each with its reason).
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=$(mkdir -p "${1:-$repo/dist}" && cd "${1:-$repo/dist}" && pwd)
python=${PYTHON:-/usr/bin/python3}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml" | head -1)
arch=$(dpkg --print-architecture)
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
pynext=$("$python" -c 'import sys; print("%d.%d" % (sys.version_info[0], sys.version_info[1] + 1))')
# the changelog's date: the last commit's, so that a rebuild of a commit is the same
date=$(git -C "$repo" log -1 --format=%cD 2>/dev/null || date -R)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
src=$work/src stage=$work/stage lib=$work/stage/usr/lib/nvctk doc=$work/stage/usr/share/doc/nvctk

# Build from a clean copy: setuptools' build/ in the tree may hold stale modules,
# and libvgpu is compiled afresh (setup.py's build_py runs make and puts the
# library into the wheel as nvctk/lib/libvgpu.so).
mkdir -p "$src"
tar -C "$repo" --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./dist \
  --exclude='*.egg-info' --exclude=__pycache__ --exclude=./libvgpu/build -cf - . \
  | tar -C "$src" -xf -
"$python" -m pip wheel -q --no-deps --wheel-dir "$work/wheel" "$src"
mkdir -p "$stage/DEBIAN" "$stage/usr/bin" "$lib" "$stage/etc/nvctk" "$doc" \
  "$stage/usr/share/man/man1" "$stage/usr/share/lintian/overrides"
"$python" -m pip install -q --no-compile --no-warn-script-location --target "$lib/python" \
  "$work"/wheel/nvctk-*.whl
# the wheel's scripts are the compiled launchers (runtime_shim/launcher.c): from
# /usr/bin they find the package in ../lib/nvctk/python and run /usr/bin/python3
mv "$lib/python/bin/nvctk" "$lib/python/bin/nvctk-hook" "$lib/python/bin/nvctk-runtime" \
  "$stage/usr/bin/"
rm -rf "$lib/python/bin"
# the bundled modules are imported, never run: their "#!/usr/bin/env python" lines
# (prometheus_client's) are dropped, as dh_python3 does for private modules
find "$lib/python" -name '*.py' -exec sed -i '1{/^#!/d}' {} +
# bytecode is written by postinst (Debian policy: no __pycache__ in a package)
find "$lib/python" -depth -type d -name __pycache__ -exec rm -rf {} +

# one copy of the library, where the config below names it; the package's own
# nvctk/lib/libvgpu.so (what nvctk.host.paths looks for) points at it
if [ ! -f "$lib/python/nvctk/lib/libvgpu.so" ]; then
  echo "build.sh: the wheel lacks nvctk/lib/libvgpu.so" >&2
  exit 1
fi
mv "$lib/python/nvctk/lib/libvgpu.so" "$lib/libvgpu.so"
ln -s ../../../libvgpu.so "$lib/python/nvctk/lib/libvgpu.so"

# modes as Debian wants them: only ELF programs and #! scripts executable, and
# binaries stripped as dh_strip does (dynamic symbols stay: libvgpu interposes by them)
find "$stage/usr" -type f -exec chmod 0644 {} +
chmod 0755 "$stage"/usr/bin/*
elfs=()
while IFS= read -r -d '' f; do
  [ "$(head -c4 "$f" | od -An -c | tr -d ' ')" = '177ELF' ] && elfs+=("$f")
done < <(find "$stage/usr" -type f -print0)
strip --strip-unneeded --remove-section=.comment --remove-section=.note "${elfs[@]}"

install -m 0644 "$here/config.toml" "$stage/etc/nvctk/config.toml"
for page in "$here"/man/*.1; do
  gzip -9n < "$page" > "$stage/usr/share/man/man1/$(basename "$page").gz"
done
install -m 0644 "$here/lintian-overrides" "$stage/usr/share/lintian/overrides/nvctk"
printf 'nvctk (%s) unstable; urgency=medium\n\n  * Release %s; the project history is its git log.\n\n -- nvctk developers <dev@nvctk.invalid>  %s\n' \
  "$version" "$version" "$date" | gzip -9n > "$doc/changelog.gz"
# copyright: nvctk's, then one stanza per private Python dependency (from its metadata)
{
  sed "s/@YEAR@/$(date -d "$date" +%Y)/" "$here/copyright"
  "$python" - "$lib/python" <<'PY'
import email.parser, pathlib, sys
for meta in sorted(pathlib.Path(sys.argv[1]).glob("*.dist-info/METADATA")):
    m = email.parser.Parser().parsestr(meta.read_text(errors="replace"), headersonly=True)
    if m["Name"] == "nvctk":
        continue
    # what the distribution installed: the top-level names its RECORD lists
    record = (meta.parent / "RECORD").read_text().splitlines()
    tops = sorted({line.split(",")[0].split("/")[0] for line in record if line} - {"..", "bin"})
    files = " ".join(f"usr/lib/nvctk/python/{t}" + ("" if t.endswith(".py") else "/*")
                     for t in tops)
    lic = m.get("License-Expression") or next(
        (c.split(" :: ")[-1] for c in m.get_all("Classifier") or [] if c.startswith("License ::")),
        None) or (m.get("License") or "see its METADATA").splitlines()[0]
    who = m.get("Author") or m.get("Author-email") or m.get("Maintainer-email") or "its authors"
    print(f"\nFiles: {files}\nComment: {m['Name']} {m['Version']}, a wheel from PyPI\n"
          f"Copyright: {who}\nLicense: {lic}")
PY
} > "$doc/copyright"
chmod 0644 "$doc/copyright"

# Depends: the libraries the ELF files link (dpkg-shlibdeps wants a debian/control)
mkdir -p "$work/shlibs/debian"
printf 'Source: nvctk\n\nPackage: nvctk\nArchitecture: any\n' > "$work/shlibs/debian/control"
shlibs=$(cd "$work/shlibs" && dpkg-shlibdeps -O --ignore-missing-info "${elfs[@]}" 2>/dev/null \
  | sed -n 's/^shlibs:Depends=//p')

for script in postinst prerm postrm; do
  install -m 0755 "$here/$script" "$stage/DEBIAN/$script"
done
size=$(du -sk --exclude=DEBIAN "$stage" | cut -f1)
cat > "$stage/DEBIAN/control" <<CTRL
Package: nvctk
Version: $version
Architecture: $arch
Maintainer: nvctk developers <dev@nvctk.invalid>
Depends: python3 (>= $pyver), python3 (<< $pynext), runc | crun${shlibs:+, $shlibs}
Suggests: containerd | docker.io, gcc, libc6-dev
Installed-Size: $size
Section: admin
Priority: optional
Description: GPU container toolkit with GPU sharing
 A runc wrapper, an OCI prestart hook and a host CLI that give containers
 NVIDIA GPUs, whole or shared, with libvgpu capping GPU memory and SM share.
 .
 gcc and libc6-dev are needed only by "nvctk sim init", which compiles the
 simulated driver of a test host without a GPU.
CTRL
echo /etc/nvctk/config.toml > "$stage/DEBIAN/conffiles"
deb=$out/nvctk_${version}_${arch}.deb
dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >/dev/null
echo "$deb"
