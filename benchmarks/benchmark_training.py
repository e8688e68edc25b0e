"""Training steps: TorchANI against torchani_fast, side by side in one process.

One step is what a training loop runs per batch: zero the gradients, energies
of the batch (and, for the force loss, forces by ``autograd.grad(...,
create_graph=True)``), a squared-error loss against fixed targets, backward to
the networks' weights, an optimizer step (Adam). Both models start from the
same weights and take the same steps; their steps alternate (A, B, A, B...)
and the medians are compared.

Denormal floats: float32 training makes some (CELU's derivative is exp(x / alpha)
of a large negative x), and on Intel CPUs a matrix product that reads them runs
several times slower. TorchANI's float32 steps meet them in its ATen products;
--flush-denormals turns them into zeros in both models (a setting users can
choose too), so that the ratio is not made of that stall.

Batches:
  * ch4: 256 conformers of CH4 (CH4-5.xyz in --molecules, default tests/data, else random ones);
  * 2iuz: 32 jittered copies of the 46-atom ligand 2iuz (ANI-2x);
  * mixed: 256 random conformers of small CHNO molecules (ase.build), padded
    to the largest, as in ANI datasets.

    python benchmarks/benchmark_training.py --cases ch4 2iuz --loss force --rounds 10
    python benchmarks/benchmark_training.py --profile ch4   # where the time goes
    python benchmarks/benchmark_training.py --floor ch4 --members 1 --dtypes float32 --loss force

(From a checkout that is not the installed package: ``PYTHONPATH=.`` first.)
"""
import argparse
import copy
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torchani

import torchani_fast
from torchani_fast.testing import random_model

# The molecules the tests ship (CH4-5.xyz, 2iuz_ligand.xyz): present in every checkout.
MOLECULES = Path(__file__).resolve().parent.parent / "tests" / "data"
SMALL = ["CH4", "H2O", "NH3", "CH3OH", "HCN", "C2H6", "CH3CHO", "HCOOH", "CH3CN", "C2H4", "CH3CH2OH"]


def load_model(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return getattr(torchani.models, name)()
        except Exception:  # no weights here: the same architecture, seeded weights
            return random_model(name)


def jitter(coords, n, scale, seed):
    g = torch.Generator().manual_seed(seed)
    base = coords.expand(n, -1, -1)
    return base + scale * torch.randn(base.shape, generator=g, dtype=torch.float64)


def batch(case, molecules):
    """(species (M, A) atomic numbers with -1 padding, coords (M, A, 3) float64)."""
    import ase.build
    import ase.io

    if case == "ch4":
        path = molecules / "CH4-5.xyz"
        if path.is_file():
            frames = ase.io.read(path, index=":256")
            z = torch.tensor(np.array([f.numbers for f in frames]))
            return z, torch.tensor(np.array([f.positions for f in frames]), dtype=torch.float64)
        m = ase.build.molecule("CH4")
        return (torch.tensor(m.numbers).expand(256, -1),
                jitter(torch.tensor(m.positions).unsqueeze(0), 256, 0.1, 0))
    if case == "2iuz":
        m = ase.io.read(molecules / "2iuz_ligand.xyz")
        return (torch.tensor(m.numbers).expand(32, -1).contiguous(),
                jitter(torch.tensor(m.positions).unsqueeze(0), 32, 0.05, 1))
    if case == "mixed":
        g = torch.Generator().manual_seed(2)
        mols = [ase.build.molecule(s) for s in SMALL]
        width = max(len(m) for m in mols)
        z = torch.full((256, width), -1, dtype=torch.long)
        xyz = torch.zeros((256, width, 3), dtype=torch.float64)
        for i in range(256):
            m = mols[int(torch.randint(len(mols), (1,), generator=g))]
            n = len(m)
            z[i, :n] = torch.tensor(m.numbers)
            xyz[i, :n] = torch.tensor(m.positions) + 0.08 * torch.randn((n, 3), generator=g,
                                                                         dtype=torch.float64)
        return z, xyz
    raise ValueError(f"unknown case {case!r}")


MODEL_OF = {"ch4": "ANI1x", "2iuz": "ANI2x", "mixed": "ANI1x"}


class Trainer:
    """One model, its optimizer and a fixed batch with targets."""

    def __init__(self, model, species, coords, targets, force, lr=1e-5, weights_only=False):
        self.model = model
        self.species = species
        self.coords = coords
        self.e_ref, self.f_ref = targets
        self.force = force
        params = [p for n, p in model.named_parameters() if "neural_networks" in n]
        for p in model.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        self.params = params
        self.opt = torch.optim.Adam(params, lr=lr)
        # backward(inputs=params): no gradient for the coordinates, which the force
        # loss otherwise also gets (its second derivatives through the AEV).
        self.inputs = params if weights_only else None

    def step(self):
        self.opt.zero_grad()
        x = self.coords.clone().requires_grad_(self.force)
        e = self.model((self.species, x)).energies
        loss = ((e - self.e_ref) ** 2).mean()
        if self.force:
            (g,) = torch.autograd.grad(e.sum(), x, create_graph=True)
            loss = loss + ((-g - self.f_ref) ** 2).mean()
        loss.backward(inputs=self.inputs)
        self.opt.step()
        return loss.detach()


def make_pair(case, members, dtype, force, molecules, weights_only=False):
    ref = load_model(MODEL_OF[case]).to(dtype)
    if members == 1:
        ref = ref[0]
    fast = torchani_fast.patch(copy.deepcopy(ref))
    z, xyz = batch(case, molecules)
    species = z
    coords = xyz.to(dtype)
    with torch.no_grad():
        e = ref((species, coords)).energies
    # Targets near the model's own values (a loss of typical size, not 0).
    g = torch.Generator().manual_seed(3)
    e_ref = (e + 1e-3 * torch.randn(e.shape, generator=g, dtype=torch.float64).to(dtype)).detach()
    f_ref = (1e-2 * torch.randn(coords.shape, generator=g, dtype=torch.float64).to(dtype)
             * (species >= 0).unsqueeze(-1))
    targets = (e_ref, f_ref)
    return (Trainer(ref, species, coords, targets, force, weights_only=weights_only),
            Trainer(fast, species, coords, targets, force, weights_only=weights_only))


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def compare(case, members, dtype, force, rounds, molecules, weights_only=False):
    a, b = make_pair(case, members, dtype, force, molecules, weights_only)
    for _ in range(2):  # warm-up (caches, allocator)
        la, lb = a.step(), b.step()
    ta, tb = [], []
    for _ in range(rounds):
        t, la = timed(a.step)
        ta.append(t)
        t, lb = timed(b.step)
        tb.append(t)
    # Both took the same steps from the same weights: the losses agree.
    rel = abs(float(la) - float(lb)) / max(abs(float(la)), 1e-300)
    return statistics.median(ta), statistics.median(tb), rel


def profile(case, members, dtype, force, molecules, rows):
    from torch.profiler import ProfilerActivity, profile as prof

    pair = make_pair(case, members, dtype, force, molecules)
    for name, trainer in zip(("torchani", "torchani_fast"), pair):
        for _ in range(2):
            trainer.step()
        with prof(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(3):
                trainer.step()
        print(f"--- {name}: {case}, {members} member(s), {dtype}, "
              f"{'energy + force' if force else 'energy'} loss (3 steps)")
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


GEMMS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")


def floor(case, members, dtype, force, molecules, steps=3):
    """Per step: the wall time (median, not profiled), the networks' matrix products
    (GFLOP and ms, from the profiler's FLOP counts and op times) and the
    optimizer's ms, for both models; then the most a step
    of torchani_fast could gain over TorchANI's with everything else free:
    TorchANI's step over torchani_fast's products + optimizer."""
    from torch.profiler import ProfilerActivity, profile as prof

    rows = {}
    for name, trainer in zip(("torchani", "torchani_fast"), make_pair(case, members, dtype, force,
                                                                         molecules)):
        for _ in range(2):
            trainer.step()
        wall = statistics.median(timed(trainer.step)[0] for _ in range(2 * steps + 1))
        with prof(activities=[ProfilerActivity.CPU], with_flops=True) as p:
            for _ in range(steps):
                trainer.step()
        ev = p.key_averages()
        flops = sum(e.flops for e in ev if e.key in GEMMS) / steps
        gemm = sum(e.self_cpu_time_total for e in ev if e.key in GEMMS) / steps / 1e6
        opt = sum(e.cpu_time_total for e in ev if e.key.startswith("Optimizer.step")) / steps / 1e6
        rows[name] = (wall, flops, gemm, opt)
        print(f"{name:14} step {1e3 * wall:7.1f} ms  products {flops / 1e9:6.3f} GFLOP "
              f"in {1e3 * gemm:6.1f} ms ({flops / max(gemm, 1e-12) / 1e9:5.0f} GFLOP/s)  "
              f"optimizer {1e3 * opt:5.1f} ms")
    wall_ref = rows["torchani"][0]
    _, _, gemm, opt = rows["torchani_fast"]
    print(f"bound: TorchANI's step / (torchani_fast's products + optimizer) = "
          f"{wall_ref / (gemm + opt):.1f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=["ch4", "2iuz", "mixed"],
                        choices=["ch4", "2iuz", "mixed"])
    parser.add_argument("--members", nargs="+", type=int, default=[1, 8],
                        help="1: model[0]; 8: the whole ensemble")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    parser.add_argument("--loss", nargs="+", default=["energy", "force"], choices=["energy", "force"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--molecules", type=Path, default=MOLECULES)
    parser.add_argument("--profile", metavar="CASE", choices=["ch4", "2iuz", "mixed"],
                        help="torch.profiler tables of both steps for this case instead")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--floor", metavar="CASE", choices=["ch4", "2iuz", "mixed"],
                        help="the products' FLOPs and time per step, and the bound they set, instead")
    parser.add_argument("--weights-only", action="store_true",
                        help="loss.backward(inputs=parameters): no coordinate gradient (both models)")
    parser.add_argument("--flush-denormals", action="store_true",
                        help="torch.set_flush_denormal(True) before any thread starts (the threads "
                             "inherit it): denormal floats read and written as 0 in both models")
    args = parser.parse_args()
    import os
    if args.flush_denormals and not torch.set_flush_denormal(True):
        parser.error("--flush-denormals: this CPU cannot flush denormals (no SSE3)")
    print(f"threads {torch.get_num_threads()}, cpu_isa {torchani_fast.cpu_isa()}, "
          f"flush denormals {args.flush_denormals}, load {os.getloadavg()[0]:.2f}")
    if args.floor:
        floor(args.floor, args.members[0], getattr(torch, args.dtypes[0]), "force" in args.loss,
              args.molecules)
        return
    if args.profile:
        profile(args.profile, args.members[0], getattr(torch, args.dtypes[0]), "force" in args.loss,
                args.molecules, args.rows)
        return
    print(f"{'case':6} {'members':>7} {'dtype':8} {'loss':7} {'torchani ms':>11} {'fast ms':>8} "
          f"{'speed-up':>8} {'loss rel diff':>13}")
    for case in args.cases:
        for members in args.members:
            for dt in args.dtypes:
                for loss in args.loss:
                    ta, tb, rel = compare(case, members, getattr(torch, dt), loss == "force",
                                          args.rounds, args.molecules, args.weights_only)
                    print(f"{case:6} {members:7d} {dt:8} {loss:7} {1e3 * ta:11.1f} {1e3 * tb:8.1f} "
                          f"{ta / tb:7.2f}x {rel:13.1e}", flush=True)
    print(f"load at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
