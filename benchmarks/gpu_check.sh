#!/bin/bash
# One-shot GPU check for torchani_fast (docs/cuda.md): on a fresh GPU machine
# with Python, a CUDA build of torch and nvcc already installed, and no
# internet, it
#   1. installs torchani (and ase) from the wheels carried in .whl/,
#   2. builds TorchANI's cuaev extension (in the background) and torchani_fast
#      with its CUDA kernels,
#   3. runs tests/test_cuda.py,
#   4. runs benchmarks/benchmark_gpu.py (TorchANI vs torchani_fast, 46 atoms to
#      100k atoms, with and without CUDA graphs),
#   4b. times batched BFGS against one structure at a time through ASE
#      (benchmarks/benchmark_batched_optimize.py, random weights),
#   5. profiles one call (benchmarks/profile_gpu.py),
#   6. runs compute-sanitizer over the kernels' tests while time is left
#      (DEADLINE seconds after the start, default 450): memcheck, then racecheck
#      and synccheck (shared memory and warp votes of the AEV and neighbour
#      kernels), then initcheck,
# STAGES picks among "tests benchmark batched profile memcheck racecheck" (default: all);
# the benchmark times the new kernels and the ones they replace in one process
# (TORCHANI_FAST_CUDA_NEIGHBORS=old, TORCHANI_FAST_CUDA_AEV=old,
# TORCHANI_FAST_CUDA_NETWORKS=aten: read at every call).
# REUSE_BUILD=1 keeps a torchani_fast/_C*.so carried from an earlier call
# (the .so that step 2 leaves in $OUT) instead of building; PROFILE_SIZES and
# PROFILE_TORCHANI=1 (profile TorchANI's path too) set up step 5;
# writing everything under $OUT (default ./gpu_check_out). Sized for < 8 minutes
# on an H200 with 16 cores. Run from the repository root:
#   bash benchmarks/gpu_check.sh
set -u -o pipefail
T0=$(date +%s)
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
elapsed() { echo "[gpu_check +$(( $(date +%s) - T0 ))s] $*"; }

PY=${PYTHON:-python3}
JOBS=${MAX_JOBS:-$(nproc)}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TORCHANI_NO_WARN_EXTENSIONS=1
# TorchANI looks for a cuaev it built under $TORCHANI_DATA_DIR/../../lib/Torchani.
export TORCHANI_DATA_DIR=/tmp/tani/share/Torchani
mkdir -p "$TORCHANI_DATA_DIR" /tmp/tani/lib/Torchani

elapsed "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
nvcc --version | tail -1 || true
$PY -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"

elapsed "1. wheels from .whl/"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
$PY -c "import torchani; print('torchani', torchani.__version__)" || exit 1

ARCH=$($PY -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}.{n}')")
elapsed "2. builds for sm $ARCH ($JOBS jobs)"
# TorchANI's cuaev: the same sources and flags as `ani build-extensions`, cuaev only
# (mnp and cell_list are not needed by the benchmark). Only the benchmark waits for it.
( cd /tmp && TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS=4 $PY - <<'EOF2'
import os
from pathlib import Path
import torch, torchani
from torch.utils.cpp_extension import load, include_paths
src = Path(torchani.__file__).parent / "csrc"
out = Path(os.environ["TORCHANI_DATA_DIR"]).parent.parent / "lib" / "Torchani"
load(name="cuaev", sources=[str(src / "cuaev.cpp"), str(src / "aev.cu")],
     extra_include_paths=include_paths(device_type="cuda") + [str(src)],
     build_directory=str(out), with_cuda=True, is_python_module=False,
     extra_cflags=["-std=c++17"],
     extra_cuda_cflags=["--expt-extended-lambda", "-DCUB_NS_QUALIFIER=::cuaev::cub",
                        "-DCUB_NS_PREFIX='namespace cuaev {'", "-DCUB_NS_POSTFIX=}",
                        "-DTORCHANI_OPT", "-use_fast_math"])
print("cuaev built in", out)
EOF2
) > /tmp/cuaev_build.log 2>&1 &
CUAEV_PID=$!
if [ "${REUSE_BUILD:-0}" = 1 ] && ls torchani_fast/_C*.so > /dev/null 2>&1; then
  elapsed "torchani_fast: REUSE_BUILD=1, using the carried $(ls torchani_fast/_C*.so)"
else
  rm -f torchani_fast/_C*.so
  TORCHANI_FAST_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS=$JOBS \
    timeout 400 $PY setup.py -q build_ext --inplace > "$OUT/torchani_fast_build.log" 2>&1
  BUILD_RC=$?
  elapsed "torchani_fast build rc=$BUILD_RC"
  if [ $BUILD_RC -ne 0 ]; then grep -E "error" -A3 "$OUT/torchani_fast_build.log" | head -60; exit 1; fi
  # libstdc++ linked statically (/opt/gcc on the GPU machines) must not be
  # exported from _C.so (setup.py): count the std:: symbols it exports.
  echo "std:: symbols exported by _C.so: $(nm -D --defined-only torchani_fast/_C*.so | grep -c ' _ZNS\| _ZSt')"
  # The built extension comes back (debug info stripped) so that a second call can
  # carry it instead of building again (REUSE_BUILD=1).
  for so in torchani_fast/_C*.so; do strip --strip-debug -o "$OUT/$(basename "$so")" "$so"; done
fi
STAGES=${STAGES:-tests benchmark batched profile memcheck racecheck}
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has tests; then
  elapsed "3. tests/test_cuda.py"
  timeout 200 $PY -m pytest tests/test_cuda.py -q -rs -p no:cacheprovider --tb=short \
    --durations=8 2>&1 | tail -150
  elapsed "tests rc=$?"
fi

wait $CUAEV_PID
elapsed "cuaev build rc=$? (the benchmark falls back to pyaev without it)"
tail -3 /tmp/cuaev_build.log

if has benchmark; then
  elapsed "4. benchmark"
  timeout 240 $PY benchmarks/benchmark_gpu.py --out "$OUT"
  elapsed "benchmark rc=$?"
fi

if has batched; then  # issue 59: batched BFGS against ASE's BFGS one structure at a time, on the GPU
  elapsed "4b. batched optimisation"
  timeout 100 $PY benchmarks/benchmark_batched_optimize.py --device cuda --n 200 --per-structure 10 \
    --stock 0 --optimizers BFGS --random-weights --steps 200 2>&1 | grep -v Warning | tail -8
  elapsed "batched rc=$?"
fi

if has profile; then
  elapsed "5. profile"
  timeout 90 $PY benchmarks/profile_gpu.py --sizes "${PROFILE_SIZES:-46,10000}" \
    ${PROFILE_TORCHANI:+--torchani} --out "$OUT/profile_gpu.txt"
  elapsed "profile rc=$?"
  head -c 1500 "$OUT/profile_gpu.txt"
fi

# 6. compute-sanitizer over the kernels' tests, as far as the time allows (caching
#    allocator off, so out-of-bounds accesses hit unallocated memory).
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
left() { echo $(( ${DEADLINE:-450} - ($(date +%s) - T0) )); }
sanitize() {  # tool, pytest -k expression
  local LEFT; LEFT=$(left)
  if [ -z "$SAN" ] || [ "$LEFT" -le 40 ]; then
    elapsed "6. $1 skipped (sanitizer: '${SAN}', $LEFT s left)"; return
  fi
  elapsed "6. $1 ($LEFT s left)"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout $(( LEFT - 10 )) "$SAN" --tool "$1" \
    --print-limit 20 --log-file "$OUT/$1.log" $PY -m pytest tests/test_cuda.py -q -x \
    -p no:cacheprovider -k "$2" 2>&1 | tail -8
  elapsed "$1 rc=$?"
  tail -5 "$OUT/$1.log"
}
if has memcheck; then
  sanitize memcheck "(neighbor_pairs_cuda_matches_cpu and tiny_cell) or \
(aev_cuda_matches_cpu and (tiny_cell or padded)) or warp_and_old_kernels or warp_too_many_neighbours or \
pair_vectors_cuda_matches_cpu or (second_derivative and tiny_cell) or \
(energy_forces_cuda_vs_torchani and triclinic) or all_launch_shapes or neighbor_errors"
fi
if has racecheck; then
  RACE="(warp_and_old_kernels and tiny_cell) or (neighbor_pairs_cuda_matches_cpu and tiny_cell) or \
(pair_vectors_cuda_matches_cpu and float32)"
  sanitize racecheck "$RACE"
  sanitize synccheck "$RACE"
  sanitize initcheck "(warp_and_old_kernels and padded) or (neighbor_pairs_padded and cuda)"
fi
elapsed "done"
