#!/usr/bin/env bash
# Where libvgpu stops on a real driver: each case runs a CUDA client under libvgpu with a
# time limit; a case still running after a few seconds gets its threads' stacks (cuda-gdb).
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
exec > >(tee "$OUT/diag.txt") 2>&1
make -s -C libvgpu build/libvgpu.so || exit 1
gcc -O2 -o /tmp/cuprobe bench/gpu/cuprobe.c -ldl
L=$PWD/libvgpu/build/libvgpu.so
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
mkdir -p /tmp/lf; printf 'CUDA_DEVICE_MEMORY_LIMIT=4294967296\nNVCTK_VGPU_UUID_0=%s\n' "$UUID" > /tmp/lf/limits
TORCH='import torch; print("mem_get_info", torch.cuda.mem_get_info(), flush=True); a=torch.empty(1<<30, dtype=torch.uint8, device="cuda"); print("alloc ok", flush=True)'
case_() {  # NAME WAIT CMD...   (env in E)
  local name=$1 wait=$2; shift 2
  echo "== $name"
  env $E LIBVGPU_LOG_LEVEL=debug "$@" > "$OUT/$name.txt" 2>&1 & local pid=$!
  for _ in $(seq $((wait * 5))); do kill -0 $pid 2>/dev/null || break; sleep 0.2; done
  if kill -0 $pid 2>/dev/null; then
    echo "still running after ${wait}s: stacks"
    timeout -s KILL 25 cuda-gdb -batch -p $pid -ex "info threads" -ex "thread apply all bt 25" > "$OUT/$name.bt" 2>&1
    grep -E '^#|^Thread|^\*' "$OUT/$name.bt" | head -60
    kill -9 $pid
  fi
  wait $pid; echo "rc=$?"; tail -n 12 "$OUT/$name.txt"
}
E="LD_PRELOAD=$L CUDA_DEVICE_MEMORY_LIMIT=4096m CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/r1"; case_ probe_env 8 /tmp/cuprobe info
E="LD_PRELOAD=$L NVCTK_VGPU_LIMITS_FILE=/tmp/lf/limits"; case_ probe_file 8 /tmp/cuprobe info
E="LD_PRELOAD=$L NVCTK_VGPU_LIMITS_FILE=/tmp/lf/limits"; case_ torch_file 20 python3 -c "$TORCH"
E="LD_PRELOAD=$L CUDA_DEVICE_MEMORY_LIMIT=4096m CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/r2"; case_ torch_env 20 python3 -c "$TORCH"
E="LD_PRELOAD=$L CUDA_DEVICE_MEMORY_LIMIT=4096m"; case_ smi_env 8 nvidia-smi --query-gpu=memory.total,memory.used --format=csv
E="LD_PRELOAD=$L CUDA_DEVICE_SM_LIMIT=50"; case_ torch_sm 20 python3 -c "$TORCH"
