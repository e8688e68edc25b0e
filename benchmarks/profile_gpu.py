"""Where the GPU time of one energy + forces call goes (torch.profiler).

For each size: the patched model called through its own API, and
``EnergyForcesStep`` (eager, no CUDA graph), float32, ANI-2x architecture with
random weights. Prints the CUDA kernels by total GPU time, the number of kernel
launches per call and the host wall time per call, so that a slow case shows
whether it is launch/host bound (many small kernels, wall >> GPU time) or
kernel bound.

With ``--torchani``, TorchANI's own path (cuaev + ``to_infer_model()`` when
its cuaev extension is built, as in benchmark_gpu.py) is profiled as well.

Usage: python benchmarks/profile_gpu.py [--sizes 46,10000] [--torchani] [--out FILE]
"""
import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import torchani_fast
from torchani_fast.step import EnergyForcesStep
from torchani_fast.testing import random_ani2x

# The same systems and step as the benchmark (this folder is on sys.path when
# the script runs).
from benchmark_gpu import CUAEV_IS_INSTALLED, energy_forces, system


def report(name, fn, reps, out):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / reps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time_total for e in kernels) / reps
    launches = sum(e.count for e in kernels) / reps
    print(f"\n### {name}: wall {wall_ms:.3f} ms/call, GPU busy {gpu_us / 1e3:.3f} ms/call, "
          f"{launches:.0f} kernels/call", file=out, flush=True)
    print(events.table(sort_by="device_time_total", row_limit=18, max_name_column_width=60),
          file=out, flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="46,10000")
    p.add_argument("--out", default=None)
    p.add_argument("--torchani", action="store_true", help="profile TorchANI's path too")
    a = p.parse_args(argv)
    out = open(a.out, "w") if a.out else sys.stdout
    for n in (int(s) for s in a.sizes.split(",")):
        _, (z, x, cell, pbc) = system(n)
        nl = "all_pairs" if cell is None else "cell_list"
        model = torchani_fast.patch(random_ani2x(0, "pyaev", nl)).to("cuda", torch.float32)
        args = (z.cuda(), x.to("cuda", torch.float32),
                None if cell is None else cell.to("cuda", torch.float32),
                None if pbc is None else pbc.cuda())
        reps = 20 if n < 5000 else 5
        if a.torchani:
            strategy = "cuaev" if CUAEV_IS_INSTALLED else "pyaev"
            ref = random_ani2x(0, strategy, nl).to("cuda", torch.float32).to_infer_model()
            report(f"{z.shape[1]} atoms, TorchANI ({strategy} + to_infer_model)",
                   lambda: energy_forces(ref, *args), reps, out)
            del ref
        report(f"{z.shape[1]} atoms, model API", lambda: energy_forces(model, *args), reps, out)
        step = EnergyForcesStep(model, *args, cuda_graph=False)
        report(f"{z.shape[1]} atoms, EnergyForcesStep eager", lambda: step(args[1]), reps, out)
        del model, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
