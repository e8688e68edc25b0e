"""Build torch.ops.torchani_fast_emu: the CUDA kernels of kernels/*.cu run on the CPU.

The .cu sources (and the .cuh headers they include) are copied, their launches `k<<<grid, block, smem, stream>>>(...)`
rewritten to `::emu::launch(&k, grid, block, smem, stream, ...)` and their
dynamic shared memory to a pointer, then compiled as host C++ against
emu_runtime.h (in place of kernels/cuda_common.cuh). See emu_runtime.h.
"""
import re
import tempfile
from pathlib import Path

import torch
from torch.utils import cpp_extension

HERE = Path(__file__).resolve().parent
KERNELS = HERE.parents[1] / "kernels"

LAUNCH = re.compile(r"([\w:]+(?:<\w+>)?)\s*<<<(.*?)>>>\(", re.S)
SMEM = re.compile(r"extern __shared__ __align__\(\d+\) unsigned char (\w+)\[\];")


def translate(source: str) -> str:
    source = LAUNCH.sub(lambda m: f"::emu::launch(&{m.group(1)}, {m.group(2)}, ", source)
    return SMEM.sub(lambda m: f"unsigned char* {m.group(1)} = ::emu::dynamic_smem();", source)


def load(verbose=False):
    """Compile (cached by torch in its extensions dir) and load; returns torch.ops.torchani_fast_emu."""
    out = Path(tempfile.gettempdir()) / "torchani_fast_emu_src"
    out.mkdir(exist_ok=True)
    (out / "cuda_common.cuh").write_text('#include "emu_runtime.h"\n')
    sources = []
    # Headers with kernels and launches (all .cuh but cuda_common.cuh) are
    # translated next to the translated sources, which include them by name.
    for cuh in sorted(KERNELS.glob("*.cuh")):
        if cuh.name == "cuda_common.cuh":
            continue
        dst = out / cuh.name
        text = translate(cuh.read_text())
        if not dst.exists() or dst.read_text() != text:
            dst.write_text(text)
    for cu in sorted(KERNELS.glob("*.cu")):
        dst = out / (cu.stem + ".cpp")
        text = translate(cu.read_text())
        if not dst.exists() or dst.read_text() != text:
            dst.write_text(text)
        sources.append(str(dst))
    sources += [str(KERNELS / "aev_cpu.cpp"), str(KERNELS / "neighbors_cpu.cpp"),
                str(HERE / "emu_registration.cpp")]
    flags = ["-O1", "-std=c++20", "-fopenmp", "-DTORCHANI_FAST_CUDA",
             "-Dtorchani_fast=torchani_fast_emu", f"-I{out}", f"-I{HERE}", f"-I{KERNELS}"]
    cpp_extension.load(
        name="torchani_fast_emu", sources=sources, extra_cflags=flags,
        extra_ldflags=["-fopenmp"], is_python_module=False, verbose=verbose,
    )
    return torch.ops.torchani_fast_emu


if __name__ == "__main__":
    load(verbose=True)
    print("ok")
