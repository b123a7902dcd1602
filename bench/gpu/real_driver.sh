#!/usr/bin/env bash
# The real-GPU checks of ../shared/gpu/README.md, as one script for a lent GPU machine
# (no package registry there): run from the repository root with .gpu/ carried, holding
#   check_vgpu.py (from ../shared/gpu), libvgpu-host.so (a fallback build), the .debs of
#   runc, libseccomp2 and busybox-static, and whl/ (nvctk's pure-Python dependencies and
#   cp312 builds of pyyaml and rpds-py).
# Writes $OUT/log.txt, $OUT/vgpu.json, $OUT/runtime.json.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
G=$PWD/.gpu
echo "== the machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
uname -r; head -2 /etc/os-release; command -v gcc python3; python3 -V
ls /dev/nvidia*; ldconfig -p | grep -E 'libcuda.so|libnvidia-ml.so'; ls -la /sbin/ldconfig*

echo "== 1. libvgpu under PyTorch (check_vgpu.py)"
make -s -C libvgpu build/libvgpu.so || { mkdir -p libvgpu/build; cp "$G/libvgpu-host.so" libvgpu/build/libvgpu.so; echo "(built here)"; }
timeout 420 python3 "$G/check_vgpu.py" --lib libvgpu/build/libvgpu.so --json "$OUT/vgpu.json"
echo "check_vgpu rc=$?"

echo "== 2. nvctk-runtime on the real driver"
PY=/usr/bin/python3
inc=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null)
[ -f "$inc/Python.h" ] || { PY=$(command -v python3); inc=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["include"])'); }
echo "python: $PY ($($PY -V)), headers $inc"
T=/tmp/nvt; mkdir -p $T/bin
python3 -m pip install -q --no-index --no-deps --target $T "$G"/whl/*.whl
ext=$($PY -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
gcc -O2 -shared -fPIC -I"$inc" nvctk/_sys.c -o "nvctk/_sys$ext" || echo "_sys build FAILED"
ln -sfn "$PWD/nvctk" $T/nvctk; ln -sfn "$PY" $T/bin/python3
gcc -O2 -o $T/bin/nvctk cli/nvctk.c && gcc -O2 -o $T/bin/nvctk-hook hooks/nvctk-hook.c \
  && gcc -O2 -o $T/bin/nvctk-runtime runtime_shim/nvctk-runtime.c || echo "launchers FAILED"
gcc -O2 -o /tmp/cuprobe bench/gpu/cuprobe.c -ldl
for d in runc libseccomp2 busybox-static; do dpkg -x "$G"/${d}_*.deb /tmp/debx; done
[ -x /bin/busybox ] || cp /tmp/debx/bin/busybox /bin/busybox
printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/debx/usr/lib/x86_64-linux-gnu exec /tmp/debx/usr/sbin/runc "$@"\n' > /tmp/runc; chmod +x /tmp/runc
/tmp/runc --version | head -1
R="$PY bench/gpu/real_driver.py --bin $T/bin --runc /tmp/runc --probe /tmp/cuprobe --libvgpu $PWD/libvgpu/build/libvgpu.so"
PYTHONPATH=$T timeout 150 $R --log "$OUT/nvctk.log" --json "$OUT/runtime.json"
rc=$?; echo "real_driver rc=$rc"
if [ $rc != 0 ] && [ -x /sbin/ldconfig.real ]; then
  echo "== 2b. again with ldconfig = /sbin/ldconfig.real"
  PYTHONPATH=$T timeout 150 $R --ldconfig /sbin/ldconfig.real --log "$OUT/nvctk-real.log" --json "$OUT/runtime-ldreal.json"
  echo "real_driver (ldconfig.real) rc=$?"
fi
