"""OpenMM MD speed: openmm-ml's MLPotential('ani2x') against MLPotential('ani2x-fast').

For each system (the 2iuz ligand, 46 atoms; 1hz5, 973 atoms; a periodic water
box) both potentials run Verlet MD on one OpenMM platform (CPU by default) in
the same process, in alternating rounds, and the table gives ms/step (median of
the rounds), the speed-up, and the overhead of ani2x-fast's step over a bare
``EnergyForcesStep`` call on the same geometry (the OpenMM step, the State,
the unit conversions and the integrator). "OpenMM alone" is the same
platform's step with a PythonForce that returns zeros: what any Python force
pays there per step (the CPU platform's thread hand-offs), timed in the same
rounds; "ours" is the overhead less that.

    python benchmarks/benchmark_openmm.py [--threads 1] [--platform Reference]

Needs openmm and openmmml, the ANI-2x weights (TORCHANI_DATA_DIR) and, for
1hz5, the shared molecules (TORCHANI_FAST_SHARED, default ../shared).
"""
import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import openmm
import openmm.app as app
from openmmml import MLPotential
from openmmml.mlpotential import MLPotential as _Registry

import torchani_fast
from torchani_fast.openmm.force import load_model
from torchani_fast.openmm.mlpotential import register
from torchani_fast.testing import water_box

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TORCHANI_FAST_SHARED", ROOT / ".." / "shared")).resolve()


def _topology(symbols, box_nm=None):
    top = app.Topology()
    chain = top.addChain()
    res = top.addResidue("MOL", chain)
    for i, s in enumerate(symbols):
        top.addAtom(f"{s}{i}", app.Element.getBySymbol(s), res)
    if box_nm is not None:
        top.setPeriodicBoxVectors([openmm.Vec3(*r) for r in box_nm])
    return top


def systems(n_waters):
    import ase.io
    from ase.data import chemical_symbols

    out = []
    files = (("2iuz", ROOT / "examples" / "2iuz_ligand.xyz"), ("1hz5", SHARED / "molecules" / "1hz5.xyz"))
    for name, path in files:
        if not path.exists():
            print(f"# {name}: {path} not found, skipped")
            continue
        atoms = ase.io.read(path)
        out.append((name, _topology(atoms.get_chemical_symbols()), atoms.positions / 10.0, None))
    z, x, cell, _ = water_box(n_waters)
    box = cell.numpy() / 10.0
    symbols = [chemical_symbols[int(k)] for k in z[0]]
    out.append((f"water box {len(symbols)} (periodic)", _topology(symbols, box), x[0].numpy() / 10.0, box))
    return out


def _context(system, box, pos, threads, platform):
    integrator = openmm.VerletIntegrator(0.0005)
    properties = {"Threads": str(threads)} if platform == "CPU" else {}
    ctx = openmm.Context(system, integrator, openmm.Platform.getPlatformByName(platform), properties)
    if box is not None:
        ctx.setPeriodicBoxVectors(*[openmm.Vec3(*r) for r in box])
    ctx.setPositions(pos)
    integrator.step(3)  # warm-up (our step is built at the first evaluation)
    return ctx, integrator


def context(potential, top, pos, box, threads, platform="CPU"):
    system = MLPotential(potential).createSystem(top, removeCMMotion=False)
    return _context(system, box, pos, threads, platform)


def noop_context(top, pos, box, threads, platform="CPU"):
    """The same particles with one PythonForce that returns zeros."""
    system = openmm.System()
    for atom in top.atoms():
        system.addParticle(atom.element.mass)
    zeros = np.zeros((top.getNumAtoms(), 3))
    force = openmm.PythonForce(lambda state: (0.0, zeros))
    force.setUsesPeriodicBoundaryConditions(box is not None)
    system.addForce(force)
    if box is not None:
        system.setDefaultPeriodicBoxVectors(*[openmm.Vec3(*r) for r in box])
    return _context(system, box, pos, threads, platform)


def ms_per_step(integrator, steps):
    t = time.perf_counter()
    integrator.step(steps)
    return (time.perf_counter() - t) / steps * 1e3


def bare_step_ms(top, pos, box, calls):
    model = load_model("ani2x-fast", None, torch.float32, torch.device("cpu"))
    z = torch.tensor([[a.element.atomic_number for a in top.atoms()]])
    x = torch.tensor(pos * 10.0, dtype=torch.float32).unsqueeze(0)
    cell = pbc = None
    if box is not None:
        cell, pbc = torch.tensor(box * 10.0, dtype=torch.float32), torch.ones(3, dtype=torch.bool)
    step = torchani_fast.EnergyForcesStep(model, z, x, cell, pbc, check_every=0)
    for _ in range(3):
        step(x)
    t = time.perf_counter()
    for _ in range(calls):
        step(x)
        step.check()
    return (time.perf_counter() - t) / calls * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="torch's and the CPU platform's threads (default: torch's, the cores)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--waters", type=int, default=216)
    ap.add_argument("--seconds", type=float, default=1.5, help="per potential and round (about)")
    ap.add_argument("--platform", default="CPU", help="OpenMM platform (CPU, Reference)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if "ani2x-fast" not in _Registry._implFactories:  # run from a source tree: no entry points
        register()
    print(f"# torch {torch.__version__}, openmm {openmm.__version__}, {args.threads} thread(s), "
          f"{args.platform} platform, {args.rounds} alternating rounds; ms/step = median")
    print(f"{'system':28s} {'atoms':>6s} {'ani2x ms':>9s} {'fast ms':>8s} {'speed-up':>8s} "
          f"{'bare ms':>8s} {'overhead':>8s} {'OpenMM alone ms':>15s} {'ours':>6s}")
    for name, top, pos, box in systems(args.waters):
        runs = {p: context(p, top, pos, box, args.threads, args.platform) for p in ("ani2x", "ani2x-fast")}
        noop_ctx, noop = noop_context(top, pos, box, args.threads, args.platform)
        # Steps per round from one timed step each, so a round lasts about --seconds.
        steps = {p: max(3, int(args.seconds * 1e3 / ms_per_step(runs[p][1], 1))) for p in runs}
        times = {p: [] for p in runs}
        bare, alone = [], []
        for _ in range(args.rounds):
            for p, (ctx, integrator) in runs.items():
                times[p].append(ms_per_step(integrator, steps[p]))
            bare.append(bare_step_ms(top, pos, box, steps["ani2x-fast"]))
            alone.append(ms_per_step(noop, 2000))
        stock, fast, b, o = (statistics.median(v) for v in (times["ani2x"], times["ani2x-fast"], bare, alone))
        print(f"{name:28s} {top.getNumAtoms():6d} {stock:9.2f} {fast:8.2f} {stock / fast:7.1f}x "
              f"{b:8.2f} {100 * (fast / b - 1):7.1f}% {o:15.3f} {100 * ((fast - o) / b - 1):5.1f}%", flush=True)
        print(f"#   rounds: ani2x {np.round(times['ani2x'], 2).tolist()}, "
              f"fast {np.round(times['ani2x-fast'], 2).tolist()}, bare {np.round(bare, 2).tolist()}, "
              f"OpenMM alone {np.round(alone, 3).tolist()}")


if __name__ == "__main__":
    main()
