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
# (mnp and cell_list are not needed by the benchmark).
( cd /tmp && TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS=4 $PY - <<'EOF'
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
EOF
) > "$OUT/cuaev_build.log" 2>&1 &
CUAEV_PID=$!
rm -f torchani_fast/_C*.so
TORCHANI_FAST_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS=$JOBS \
  $PY setup.py -q build_ext --inplace > "$OUT/torchani_fast_build.log" 2>&1
BUILD_RC=$?
elapsed "torchani_fast build rc=$BUILD_RC"
if [ $BUILD_RC -ne 0 ]; then grep -E "error" -A3 "$OUT/torchani_fast_build.log" | head -60; fi
wait $CUAEV_PID
elapsed "cuaev build rc=$? (the benchmark falls back to pyaev without it)"
tail -3 "$OUT/cuaev_build.log"
[ $BUILD_RC -eq 0 ] || exit 1

elapsed "3. tests/test_cuda.py"
timeout 240 $PY -m pytest tests/test_cuda.py -q -rs -p no:cacheprovider \
  --junitxml="$OUT/test_cuda.xml" 2>&1 | tail -40
elapsed "tests rc=$?"

elapsed "4. benchmark"
timeout 240 $PY benchmarks/benchmark_gpu.py --out "$OUT"
elapsed "benchmark rc=$?"
elapsed "done"
