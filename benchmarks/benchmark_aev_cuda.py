"""The CUDA AEV ops alone: forward, backward and forward + backward (the forward's
slots kept for the backward, as autograd does), for the warp kernels and the old ones
(TORCHANI_FAST_CUDA_AEV, read on every call) in one process.

    python benchmarks/benchmark_aev_cuda.py --sizes 46,1000,10000,100000 [--dtype float32]
"""
import argparse
import os

import torch

from torchani_fast import ops
from torchani_fast.testing import random_ani2x, random_molecule, water_box

CUTOFF = 5.2


def inputs(n_atoms, dtype):
    model = random_ani2x(0)
    if n_atoms <= 100:
        z, x = random_molecule(n_atoms)
        cell = pbc = None
    else:
        z, x, cell, pbc = water_box(max(1, n_atoms // 3))
    species = model.species_converter(z).cuda()
    x = x.to("cuda", dtype)
    cell = None if cell is None else cell.to("cuda", dtype)
    pbc = None if pbc is None else pbc.cuda()
    pairs, images = ops.neighbor_pairs(species, x, cell, pbc, CUTOFF, True)
    flat = x.reshape(-1, 3)
    diff = flat[pairs[0]] - flat[pairs[1]]
    if cell is not None:
        diff = diff + images @ cell
    a, r = model.aev_computer.angular, model.aev_computer.radial
    args = [t.to("cuda", dtype) for t in (r.eta, r.shifts, a.eta, a.zeta, a.shifts, a.sections)]
    args += [float(r.cutoff), float(a.cutoff), model.aev_computer.num_species]
    return species, pairs, diff, args


def timed(fn, repeats=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="46,1000,10000,100000")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    opts = parser.parse_args()
    dtype = getattr(torch, opts.dtype)
    print(f"{torch.cuda.get_device_name()}, {opts.dtype}: ms per call")
    print(f"{'atoms':>8} {'kernels':>8} {'forward':>9} {'backward':>9} {'fwd+bwd':>9}")
    for n in (int(s) for s in opts.sizes.split(",")):
        species, pairs, diff, args = inputs(n, dtype)
        g = torch.randn(*species.shape, ops.aev(species, pairs, diff, *args).shape[-1],
                        device="cuda", dtype=dtype)

        def both():
            _, edges = torch.ops.torchani_fast.aev_with_edges(species, pairs, diff, *args)
            torch.ops.torchani_fast.aev_backward_edges(g, edges, species, pairs, diff, *args)

        for which in ("old", "warp"):
            os.environ["TORCHANI_FAST_CUDA_AEV"] = which
            fwd = timed(lambda: ops.aev(species, pairs, diff, *args))
            bwd = timed(lambda: ops.aev_backward(g, species, pairs, diff, *args))
            print(f"{species.numel():>8} {which:>8} {fwd:9.3f} {bwd:9.3f} {timed(both):9.3f}")


if __name__ == "__main__":
    main()
