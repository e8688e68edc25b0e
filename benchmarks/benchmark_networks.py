"""The networks stage alone: TorchANI's networks against the fused ones, on the same AEVs.

Energies and their gradient with respect to the AEVs (what forces need), for
the CELU networks of ANI-2x and the GELU, bias-free networks of ANI-2xr (and
any other factory given), with seeded random weights of the exact
architecture (torchani_fast.testing.random_model). The AEVs are TorchANI's
for random organic-like systems of the given sizes.

    python benchmarks/benchmark_networks.py --rounds 20 --sizes 30 300 3000
"""
import argparse
import statistics
import time
import warnings

import torch

import torchani_fast
from torchani_fast.nn import fuse_networks
from torchani_fast.testing import random_model


def system(n, symbols, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.tensor(symbols)[torch.randint(len(symbols), (1, n), generator=g)]
    side = (n / 0.1) ** (1 / 3)  # about 0.1 atoms per cubic angstrom
    return z, torch.rand(1, n, 3, generator=g, dtype=torch.float64) * side


def time_call(fn, rounds):
    fn()
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["ANI2x", "ANI2xr"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[30, 300, 3000])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"threads {torch.get_num_threads()}, {args.dtype}, cpu_isa {torchani_fast.cpu_isa()}")
    print(f"{'model':8} {'atoms':>6} {'torchani ms':>12} {'fused ms':>9} {'speed-up':>8}")
    for name in args.models:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = random_model(name).to(dtype)
        nnp = model.potentials["nnp"]
        ref = nnp.neural_networks
        fused = fuse_networks(ref, nnp.aev_computer)
        for n in args.sizes:
            z, xyz = system(n, [1, 1, 6, 7, 8])
            elem = model.species_converter(z)
            with torch.no_grad():
                aev = nnp.aev_computer(elem, xyz.to(dtype))

            def run(net):
                x = aev.clone().requires_grad_(True)
                e = net(elem, x)
                torch.autograd.grad(e.sum(), x)

            t_ref = time_call(lambda: run(ref), args.rounds)
            t_fused = time_call(lambda: run(fused), args.rounds)
            print(f"{name:8} {n:6d} {1e3 * t_ref:12.2f} {1e3 * t_fused:9.2f} {t_ref / t_fused:8.2f}")


if __name__ == "__main__":
    main()
