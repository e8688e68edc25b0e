"""Conformer relaxation throughput: batched L-BFGS/FIRE against one structure at a time through ASE.

Workload (issue 59): N conformers of the 2iuz ligand (46 atoms; Gaussian noise of
0.1-0.2 Å, drawn per conformer) and N frames of CH4-5.xyz, relaxed to
fmax 0.01 eV/Å (at most --steps steps), ANI-2x in float64, torch with --threads threads.
In one run:

  * batched: :func:`torchani_fast.batched.optimize` on all 2N structures (in-flight
    batching, --max-atoms padded atoms per call), with each of --optimizers
    (BFGS: from Lindh's model Hessian, the default; BFGS-ase: from ASE's
    70 eV/Å² x I, so ASE's BFGS step for step, the same steps as the
    per-structure runs; LBFGS, FIRE);
  * per-structure torchani_fast: ASE's BFGS on each structure alone with
    torchani_fast's calculator (``patched.ase()``; what ``torchani-fast optimize``
    does today), on the first --per-structure conformers and as many CH4 frames;
  * stock TorchANI: ASE's BFGS with TorchANI's own calculator on the first
    --stock conformers and as many CH4 frames.

Printed: structures/s of each (the same conformer/CH4 mix, so comparable), the
batched path's speed-up over the two others, optimiser steps per second (all
structures' steps over the time: the throughput at equal work, which does not
depend on how many structures of a sample ASE's BFGS fails to converge: about 1%
of these conformers run to the step limit on either path), the mean steps per
structure (of the structures the per-structure torchani_fast run relaxed), and
the final energies of the structures every path relaxed against per-structure
BFGS: the largest (E_batched - E_BFGS)/atoms and how many are above 1e-5 eV/atom
(another, higher minimum) and below -1e-5 (a lower one).

    python benchmarks/benchmark_batched_optimize.py [--n 1000] [--per-structure 50] [--stock 10]
"""
import argparse
import time
from pathlib import Path

import numpy as np
import torch

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


def structures(n: int, seed: int = 0):
    import ase.io

    rng = np.random.default_rng(seed)
    ligand = ase.io.read(DATA / "2iuz_ligand.xyz")
    confs = []
    for _ in range(n):
        a = ligand.copy()
        a.positions += rng.normal(scale=rng.uniform(0.1, 0.2), size=a.positions.shape)
        confs.append(a)
    frames = ase.io.read(DATA / "CH4-5.xyz", index=":")
    return confs, [frames[k % len(frames)].copy() for k in range(n)]


def per_structure(calc_factory, batch, fmax, steps):
    """ASE BFGS on each structure alone: (seconds, energies eV, steps)."""
    import ase.optimize

    energies, counts = [], []
    start = time.perf_counter()
    calc = calc_factory()
    for atoms in batch:
        a = atoms.copy()
        a.calc = calc
        opt = ase.optimize.BFGS(a, logfile=None)
        opt.run(fmax=fmax, steps=steps)
        energies.append(a.get_potential_energy())
        counts.append(opt.nsteps)
    return time.perf_counter() - start, np.array(energies), np.array(counts)


def main() -> None:
    import torchani

    import torchani_fast
    from torchani_fast import batched

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000, help="conformers and CH4 frames each (default 1000)")
    parser.add_argument("--per-structure", type=int, default=50,
                        help="conformers (and CH4 frames) for per-structure torchani_fast BFGS")
    parser.add_argument("--stock", type=int, default=10, help="conformers (and CH4 frames) for stock TorchANI")
    parser.add_argument("--optimizers", default="BFGS,BFGS-ase",
                        help="batched optimisers (default BFGS,BFGS-ase; LBFGS, FIRE too)")
    parser.add_argument("--fmax", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--max-atoms", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="the models' device (default cpu; cuda on a GPU)")
    parser.add_argument("--random-weights", action="store_true",
                        help="ANI-2x's architecture with seeded random weights (no weight files needed; "
                             "the speeds stand, the minima and step counts are not ANI-2x's)")
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"],
                        help="the models' dtype, every path (default float64, the command line's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    confs, ch4 = structures(args.n)
    everything = confs + ch4
    dtype = getattr(torch, args.dtype)
    if args.random_weights:
        from torchani_fast.testing import random_model

        make = lambda: random_model("ANI2x")  # noqa: E731
    else:
        make = torchani.models.ANI2x
    stock = make().to(dtype).to(args.device)
    model = torchani_fast.patch(make().to(dtype)).to(args.device)
    print(f"{args.n} 2iuz conformers + {args.n} CH4-5 frames, fmax {args.fmax} eV/Å, ANI-2x {args.dtype}, "
          f"{args.device}, {torch.get_num_threads()} threads")

    rows = []
    k = min(args.per_structure, args.n)
    t, e_ref, n_ref = per_structure(lambda: model.ase(), confs[:k] + ch4[:k], args.fmax, args.steps)
    rows.append(("per-structure BFGS, torchani_fast", 2 * k / t, n_ref.mean(), n_ref.sum() / t))
    print(f"per-structure torchani_fast: {2 * k} structures in {t:.1f} s", flush=True)
    ks = min(args.stock, k)
    if ks:
        t, e_stock, n_stock = per_structure(lambda: stock.ase(), confs[:ks] + ch4[:ks], args.fmax, args.steps)
        rows.append(("per-structure BFGS, stock TorchANI", 2 * ks / t, n_stock.mean(), n_stock.sum() / t))
        print(f"per-structure stock TorchANI: {2 * ks} structures in {t:.1f} s", flush=True)
    ref_rate = rows[0][1]
    stock_rate = rows[1][1] if ks else float("nan")
    natoms = np.array([len(a) for a in confs[:k] + ch4[:k]])
    agreement = []
    for name in args.optimizers.split(","):
        start = time.perf_counter()
        optimizer = batched.BFGS(hessian="ase") if name.upper() == "BFGS-ASE" else name
        out = batched.optimize(model, everything, fmax=args.fmax, steps=args.steps, optimizer=optimizer,
                               max_atoms=args.max_atoms)
        t = time.perf_counter() - start
        steps = np.array([r.steps for r in out[:k]] + [r.steps for r in out[args.n:args.n + k]])
        rows.append((f"batched {name}", len(everything) / t, steps.mean(), sum(r.steps for r in out) / t))
        print(f"batched {name}: {len(everything)} structures in {t:.1f} s", flush=True)
        mine = np.array([r.energy for r in out[:k]] + [r.energy for r in out[args.n:args.n + k]])
        d = (mine - e_ref) / natoms
        unconverged = sum(not r.converged for r in out)
        agreement.append((name, d.max(), int((d > 1e-5).sum()), int((d < -1e-5).sum()), 2 * k, unconverged))

    ref_steps = rows[0][3]
    stock_steps = rows[1][3] if ks else float("nan")
    print(f"{'path':38s} {'structures/s':>13s} {'mean steps':>11s} {'vs per-structure':>17s} {'vs stock':>9s} "
          f"{'steps/s':>9s} {'vs per-structure':>17s} {'vs stock':>9s}")
    for name, rate, mean_steps, steps_rate in rows:
        print(f"{name:38s} {rate:13.2f} {mean_steps:11.1f} {rate / ref_rate:16.2f}x {rate / stock_rate:8.2f}x "
              f"{steps_rate:9.1f} {steps_rate / ref_steps:16.2f}x {steps_rate / stock_steps:8.2f}x")
    for name, worst, above, below, count, unconverged in agreement:
        print(f"batched {name}: largest (E - E_BFGS)/atoms {worst:.2e} eV; {above}/{count} above 1e-5 eV/atom "
              f"(another, higher minimum), {below}/{count} below -1e-5 (lower); "
              f"{unconverged} of {len(everything)} not converged in {args.steps} steps")


if __name__ == "__main__":
    main()
