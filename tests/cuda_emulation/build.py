"""Build torch.ops.torchani_fast_emu: the CUDA kernels of csrc/**/*.cu run on the CPU.

The .cu sources (and the .cuh headers they include) are copied, their launches `k<<<grid, block, smem, stream>>>(...)`
rewritten to `::emu::launch(&k, grid, block, smem, stream, ...)` and their
dynamic shared memory to a pointer, then compiled as host C++ against
emu_runtime.h (in place of csrc/common/cuda_common.cuh). See emu_runtime.h.
"""
import re
from pathlib import Path

import torch
from torch.utils import cpp_extension

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[1] / "csrc"

LAUNCH = re.compile(r"([\w:]+(?:<\w+>)?)\s*<<<(.*?)>>>\(", re.S)
SMEM = re.compile(r"extern __shared__ __align__\(\d+\) unsigned char (\w+)\[\];")


def translate(source: str) -> str:
    source = LAUNCH.sub(lambda m: f"::emu::launch(&{m.group(1)}, {m.group(2)}, ", source)
    return SMEM.sub(lambda m: f"unsigned char* {m.group(1)} = ::emu::dynamic_smem();", source)


def load(verbose=False):
    """Compile (cached in this checkout's build/cuda_emulation: two checkouts never share
    a build, nor its lock) and load; returns torch.ops.torchani_fast_emu."""
    base = CSRC.parent / "build" / "cuda_emulation"
    out = base / "src"
    out.mkdir(parents=True, exist_ok=True)
    (base / "ext").mkdir(exist_ok=True)
    # The translated tree mirrors csrc/ (includes are relative to csrc/, and
    # -I{out} comes first), with common/cuda_common.cuh replaced by the emulator.
    (out / "common").mkdir(exist_ok=True)
    (out / "common" / "cuda_common.cuh").write_text('#include "emu_runtime.h"\n')
    sources = []
    for path in sorted(CSRC.rglob("*.cu")) + sorted(CSRC.rglob("*.cuh")):
        if path.name == "cuda_common.cuh":
            continue
        rel = path.relative_to(CSRC)
        dst = out / (rel.with_suffix(".cpp") if path.suffix == ".cu" else rel)
        dst.parent.mkdir(parents=True, exist_ok=True)
        text = translate(path.read_text())
        if not dst.exists() or dst.read_text() != text:
            dst.write_text(text)
        if path.suffix == ".cu":
            sources.append(str(dst))
    sources += [str(CSRC / "aev" / "aev_cpu.cpp"), str(CSRC / "aev" / "vector_cpu.cpp"),
                str(CSRC / "aev" / "vector_f64_cpu.cpp"),
                str(CSRC / "neighbors" / "neighbors_cpu.cpp"), str(CSRC / "common" / "parallel.cpp"),
                str(CSRC / "common" / "workspace.cpp"), str(HERE / "emu_registration.cpp")]
    # (ensemble_dense splits the members over blocks below 2 tiles instead of 128:
    # the emulator's few atoms then take both of its paths.)
    flags = ["-O1", "-std=c++20", "-fopenmp", "-DTORCHANI_FAST_CUDA", "-DTORCHANI_FAST_DENSE_SPLIT_TILES=2",
             "-Dtorchani_fast=torchani_fast_emu", f"-I{out}", f"-I{HERE}", f"-I{CSRC}"]
    cpp_extension.load(
        name="torchani_fast_emu", sources=sources, extra_cflags=flags,
        extra_ldflags=["-fopenmp"], is_python_module=False, verbose=verbose,
        build_directory=str(base / "ext"),
    )
    return torch.ops.torchani_fast_emu


if __name__ == "__main__":
    load(verbose=True)
    print("ok")
