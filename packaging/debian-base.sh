#!/usr/bin/env bash
# A Debian 12 root file system made with debootstrap, cached as a tarball; prints
# the tarball's path.
#   packaging/debian-base.sh base    minbase + apt's package lists (the installer image's base)
#   packaging/debian-base.sh test    base + gcc, libc6-dev, busybox-static (what `nvctk sim
#                                    init` and a test container need) and the .debs of
#                                    python3 and runc downloaded, not installed (tests/e2e/test_deb.py)
# The cache is $NVCTK_BASE_CACHE (default /var/cache/nvctk-build), one tarball per
# suite, architecture, variant and ISO week: a week-old base is rebuilt, older ones
# are deleted. Mirror: $NVCTK_DEBIAN_MIRROR (default http://deb.debian.org/debian).
# Exit status 3: the mirror could not be reached (the tests skip then).
set -euo pipefail
variant=${1:?usage: debian-base.sh base|test}
case $variant in base|test) ;; *) echo "debian-base.sh: unknown variant $variant" >&2; exit 2;; esac
suite=bookworm
mirror=${NVCTK_DEBIAN_MIRROR:-http://deb.debian.org/debian}
cache=${NVCTK_BASE_CACHE:-/var/cache/nvctk-build}
arch=$(dpkg --print-architecture)
key="$suite-$arch-$variant-$(date +%G)w$(date +%V)"
tarball=$cache/$key.tar
mkdir -p "$cache"
here=$(cd "$(dirname "$0")" && pwd)

# one builder at a time per cache (two test sessions, `make image` beside a test)
exec 9>"$cache/.lock-$variant"
flock 9
if [ -s "$tarball" ]; then
  echo "$tarball"
  exit 0
fi

# run a command chrooted into $1 with /proc, /sys and /dev mounted in a private
# mount namespace: the mounts end with the command, whatever happens
in_root() {
  local root=$1; shift
  unshare --mount --propagation private -- sh -ec '
    root=$1; shift
    mount -t proc proc "$root/proc"
    mount --rbind /sys "$root/sys"
    mount --rbind /dev "$root/dev"
    exec chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive "$@"
  ' in_root "$root" "$@"
}

work=$(mktemp -d "$cache/.build-XXXXXX")
trap 'rm -rf --one-file-system "$work"' EXIT
root=$work/root
if [ "$variant" = base ]; then
  if ! debootstrap --variant=minbase "$suite" "$root" "$mirror" >"$work/debootstrap.log" 2>&1; then
    tail -5 "$work/debootstrap.log" >&2
    if grep -qE "Failed getting release file|Couldn't download|Could not resolve|Temporary failure" \
        "$work/debootstrap.log"; then
      echo "debian-base.sh: cannot reach the Debian mirror $mirror" >&2
      exit 3
    fi
    exit 1
  fi
  # no service starts in a chroot; the security suite too, as on an installed system
  printf '#!/bin/sh\nexit 101\n' > "$root/usr/sbin/policy-rc.d"
  chmod 0755 "$root/usr/sbin/policy-rc.d"
  security=${mirror%/debian}/debian-security
  printf 'deb %s %s main\ndeb %s %s-updates main\ndeb %s %s-security main\n' \
    "$mirror" "$suite" "$mirror" "$suite" "$security" "$suite" > "$root/etc/apt/sources.list"
  in_root "$root" apt-get update -qq >"$work/apt.log" 2>&1 || {
    tail -5 "$work/apt.log" >&2; echo "debian-base.sh: apt-get update failed in the base" >&2; exit 3; }
  rm -f "$root"/var/cache/apt/archives/*.deb
else
  base=$("$here/debian-base.sh" base)
  mkdir -p "$root"
  tar -C "$root" --numeric-owner -xpf "$base"
  in_root "$root" apt-get install -y -qq --no-install-recommends gcc libc6-dev busybox-static \
    >"$work/apt.log" 2>&1 || { tail -5 "$work/apt.log" >&2; exit 1; }
  # what `apt-get install ./nvctk_*.deb` will want, at hand: the test reads no mirror
  in_root "$root" apt-get install -y -qq --download-only --no-install-recommends python3 runc \
    >>"$work/apt.log" 2>&1 || { tail -5 "$work/apt.log" >&2; exit 1; }
fi
tar -C "$root" --numeric-owner -cf "$work/root.tar" .
# older bases of this variant go: a cache that only grows fills the disk
find "$cache" -maxdepth 1 -name "$suite-$arch-$variant-*.tar" ! -name "$key.tar" -delete
mv "$work/root.tar" "$tarball"
echo "$tarball"
