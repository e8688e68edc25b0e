"""Hessian benchmark: TorchANI 2.9 vs torchani_fast (ANI-2x, 8-member ensemble).

Energy, forces and the full 3N x 3N Hessian of 2iuz_ligand.xyz (46 atoms) in
float32 and float64, timed for

- ``torchani``: TorchANI 2.9 ``ANI2x()`` with
  ``torchani.grad.energies_forces_and_hessians`` (one double-backward pass per
  Cartesian component: 138 passes);
- ``patched``: ``torchani_fast.patch(ANI2x())`` through the same
  ``torchani.grad`` function (the AEV's second derivatives are torchani_fast's
  analytic kernels; the networks are whatever ``patch`` installs);
- ``one-pass``: the patched model through
  ``torchani_fast.grad.energies_forces_and_hessians`` (the Hessian assembled
  from per-atom AEV derivatives and the networks' exact curvature, no autograd
  pass per coordinate).

``--batched`` adds the Hessian computed with one ``torch.autograd.grad(...,
is_grads_batched=True)`` call (vmap over the 3N unit vectors) for TorchANI and
the patched model. Everything lives in one process and is timed interleaved
(one call of each per round), so a noisy machine slows them alike; the table
gives medians (wall and this process's CPU time) and speed-ups over TorchANI.
The largest difference from TorchANI's Hessian is printed as a check.

Never part of the tests or CI. Usage::

    python benchmarks/benchmark_hessian.py                    # float32 and float64
    python benchmarks/benchmark_hessian.py --threads 1 --repeats 7
    python benchmarks/benchmark_hessian.py --dtype float64 --molecule 3lka_ligand.xyz
    python benchmarks/benchmark_hessian.py --profile          # + torch.profiler table (fast)

Needs the offline ANI weights (TORCHANI_DATA_DIR, default ../shared/torchani-data).
Other jobs on the machine inflate every number; the load average is printed.
"""
import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("TORCHANI_FAST_SHARED", HERE.parent / ".." / "shared")).resolve()
os.environ.setdefault("TORCHANI_DATA_DIR", str(SHARED / "torchani-data"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHANI_NO_WARN_EXTENSIONS", "1")
warnings.filterwarnings("ignore", category=DeprecationWarning)

import torch  # noqa: E402

MOLECULES = SHARED / "molecules"


def load(name, dtype):
    import ase.io

    atoms = ase.io.read(MOLECULES / name)
    species = torch.tensor(atoms.numbers, dtype=torch.long).unsqueeze(0)
    coords = torch.tensor(atoms.positions, dtype=dtype).unsqueeze(0)
    return species, coords


def hessian_loop(model, species, coords):
    import torchani

    return torchani.grad.energies_forces_and_hessians(model, species, coords.clone()).hessians


def hessian_one_pass(model, species, coords):
    import torchani_fast.grad

    return torchani_fast.grad.energies_forces_and_hessians(model, species, coords).hessians


def hessian_batched(model, species, coords):
    x = coords.clone().requires_grad_(True)
    e = model((species, x)).energies
    (g,) = torch.autograd.grad(e.sum(), x, create_graph=True)
    n = x.shape[1] * 3
    eye = torch.eye(n, dtype=x.dtype).view(n, *x.shape)
    (h,) = torch.autograd.grad(-g, x, grad_outputs=eye, is_grads_batched=True)
    return -h.view(1, n, n)


def bench(fns, repeats):
    """Interleaved timing: one call of each function per round.

    Returns medians in ms of wall time and of this process's CPU time (the
    latter is less sensitive to other jobs when running on one thread)."""
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for r in range(repeats):
        order = list(fns)
        order = order[r % len(order):] + order[: r % len(order)]
        for k in order:
            t, c = time.perf_counter(), time.process_time()
            fns[k]()
            wall[k].append((time.perf_counter() - t) * 1e3)
            cpu[k].append((time.process_time() - c) * 1e3)
    med = lambda d: {k: statistics.median(v) for k, v in d.items()}  # noqa: E731
    return med(wall), med(cpu)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--molecule", default="2iuz_ligand.xyz")
    p.add_argument("--dtype", choices=["float32", "float64", "both"], default="both")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (after one warm-up)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--batched", action="store_true", help="also time is_grads_batched")
    p.add_argument("--profile", action="store_true", help="profile one one-pass Hessian")
    args = p.parse_args(argv)

    import torchani

    import torchani_fast

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtypes = ["float32", "float64"] if args.dtype == "both" else [args.dtype]
    base = torchani.models.ANI2x()
    nn_kind = None
    print(f"# Hessian of {args.molecule}, ANI-2x ensemble; torch {torch.__version__}, "
          f"torchani {torchani.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f}")
    rows = []
    for name in dtypes:
        dtype = getattr(torch, name)
        ref = copy.deepcopy(base).to(dtype)
        fast = torchani_fast.patch(copy.deepcopy(base)).to(dtype)
        nn_kind = type(fast.potentials["nnp"].neural_networks).__name__
        species, coords = load(args.molecule, dtype)
        fns = {
            "torchani": lambda m=ref: hessian_loop(m, species, coords),
            "patched": lambda m=fast: hessian_loop(m, species, coords),
            "one-pass": lambda m=fast: hessian_one_pass(m, species, coords),
        }
        if args.batched:
            fns["torchani batched"] = lambda m=ref: hessian_batched(m, species, coords)
            fns["patched batched"] = lambda m=fast: hessian_batched(m, species, coords)
        out = {k: f() for k, f in fns.items()}  # warm-up, and the check
        diffs = {k: (out[k] - out["torchani"]).abs().max().item() for k in out}
        wall, cpu = bench(fns, args.repeats)
        rows.append((name, wall, cpu))
        print(f"{name}: |H| max {out['torchani'].abs().max().item():.2f} Ha/Å²; max |H - H_torchani|: "
              + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items() if k != "torchani"), flush=True)
    print(f"\n(networks of the patched model: {nn_kind}; load average now "
          f"{os.getloadavg()[0]:.1f}; ms are medians of wall time, CPU ms in parentheses)\n")
    print("| dtype | variant | time ms (CPU ms) | speed-up vs TorchANI (CPU) |")
    print("|---|---|---:|---:|")
    for name, wall, cpu in rows:
        for k in wall:
            base_k = "torchani batched" if k.endswith("batched") else "torchani"
            print(f"| {name} | {k} | {wall[k]:.0f} ({cpu[k]:.0f}) | "
                  f"{wall[base_k] / wall[k]:.2f}x ({cpu[base_k] / cpu[k]:.2f}x) |")
    if args.profile:
        dtype = getattr(torch, dtypes[-1])
        fast = torchani_fast.patch(copy.deepcopy(base)).to(dtype)
        species, coords = load(args.molecule, dtype)
        hessian_one_pass(fast, species, coords)
        with torch.profiler.profile() as prof:
            hessian_one_pass(fast, species, coords)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return 0


if __name__ == "__main__":
    sys.exit(main())
