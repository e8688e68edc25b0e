"""Per-step cost of MD through the ASE calculator and the CLI, against a bare model call.

For one system (the 2iuz ligand, 46 atoms, by default) and one dtype, in one
process and in alternating rounds:

- ``bare``: ``torchani_fast.models.energies_forces(model, species, coords)`` on
  tensors built once, the positions copied in from the same trajectory the MD
  runs visit (so the neighbour list and caches see moving atoms too);
- ``EnergyForcesStep``: the same frames through a
  :class:`torchani_fast.step.GrowingStep` (what the calculator evaluates
  molecules with; built once, outside the timing);
- ``calculator``: ``atoms.get_forces()`` with torchani_fast's ASE calculator
  after the positions moved (ASE's state check, the tensors, the one copy of the
  results back);
- ``VelocityVerlet``: ms per step of ``ase.md.verlet.VelocityVerlet.run`` (what
  ``torchani-fast md --ensemble nve`` runs, without its trajectory writer);
- ``torchani-fast md``: the CLI itself (a subprocess per round, with
  ``OMP_NUM_THREADS`` set to the threads), the ms per step it reports for its
  MD loop, writing a frame and a log line every 100 steps.

The overhead columns are (calculator - bare) / bare and (MD step - bare) / bare.

    python benchmarks/benchmark_md.py --threads 2 --rounds 5
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import ase.io
from ase.md.verlet import VelocityVerlet
from ase import units

from torchani_fast.cli import _maxwell_boltzmann  # the CLI's draw (thermalize_momenta where ASE has it)

ROOT = Path(__file__).resolve().parents[1]


def _model(dtype):
    from torchani_fast.models import ANI2x

    try:
        return ANI2x(dtype=dtype), "ANI-2x"
    except Exception:  # no weights offline: the architecture with random weights
        import torchani_fast
        from torchani_fast.testing import random_ani2x

        return torchani_fast.patch(random_ani2x().to(dtype)), "ANI-2x (random weights)"


def _trajectory(atoms, calc, steps):
    """Positions of a short NVE run from 300 K, as visited by the MD rows."""
    atoms = atoms.copy()
    atoms.calc = calc
    _maxwell_boltzmann(atoms, 300, np.random.default_rng(0))
    frames = []
    dyn = VelocityVerlet(atoms, 0.5 * units.fs)
    dyn.attach(lambda: frames.append(atoms.positions.copy()), interval=1)
    dyn.run(steps)
    return frames


def _tensor_loop_ms(make, numbers, frames, dtype):
    """ms per call of ``make(species, coords)`` (built outside the timing) on each
    frame, the frames copied into one coords tensor."""
    species = torch.tensor(numbers, dtype=torch.long).unsqueeze(0)
    coords = torch.tensor(frames[0], dtype=dtype).unsqueeze(0)
    call = make(species, coords)
    t = time.perf_counter()
    for f in frames:
        coords.copy_(torch.from_numpy(f).unsqueeze(0))
        call(coords)
    return (time.perf_counter() - t) / len(frames) * 1e3


def bare_ms(model, numbers, frames, dtype):
    from torchani_fast.models import energies_forces

    return _tensor_loop_ms(lambda species, _: lambda x: energies_forces(model, species, x),
                           numbers, frames, dtype)


def step_ms(model, numbers, frames, dtype):
    """The same frames through an EnergyForcesStep (what the calculator runs for a molecule)."""
    from torchani_fast.step import GrowingStep

    return _tensor_loop_ms(lambda species, coords: GrowingStep(model, species, coords),
                           numbers, frames, dtype)


def calculator_ms(atoms, calc, frames):
    atoms.calc = calc
    t = time.perf_counter()
    for f in frames:
        atoms.positions = f
        atoms.get_forces()
    return (time.perf_counter() - t) / len(frames) * 1e3


def verlet_ms(atoms, calc, steps):
    atoms.calc = calc
    dyn = VelocityVerlet(atoms, 0.5 * units.fs)
    dyn.run(2)
    t = time.perf_counter()
    dyn.run(steps)
    return (time.perf_counter() - t) / steps * 1e3


def cli_ms(path, dtype, steps, threads):
    """ms/step of `torchani-fast md` as the CLI reports it (the MD loop's own
    wall time over its steps: start-up, model loading and the last report are
    outside it; the first frame and every writer and log call are inside)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "md.xyz"
        cmd = [sys.executable, "-m", "torchani_fast.cli", "md", str(path), "--steps", str(steps),
               "--dt", "0.5", "--dtype", dtype, "--interval", "100", "--seed", "0",
               "--no-progress", "-o", str(out)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        done = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    found = re.search(r"([0-9.]+) ms/step", done.stdout)
    if found is None:
        raise RuntimeError(f"no ms/step in the output of {' '.join(cmd)}:\n{done.stdout}")
    return float(found.group(1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", type=Path, default=ROOT / "examples" / "2iuz_ligand.xyz")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=200, help="steps (calls) per round and row")
    p.add_argument("--no-cli", action="store_true", help="skip the CLI row (two subprocess runs)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, label = _model(dtype)
    atoms = ase.io.read(args.system)
    calc = model.ase()
    frames = _trajectory(atoms, model.ase(), args.steps)

    rows = {"bare": [], "EnergyForcesStep": [], "calculator": [], "VelocityVerlet": []}
    if not args.no_cli:
        rows["torchani-fast md"] = []
    bare_ms(model, atoms.numbers, frames[:10], dtype)  # warm-up
    for _ in range(args.rounds):  # every row once per round, so drifts of the machine's load hit all
        rows["bare"].append(bare_ms(model, atoms.numbers, frames, dtype))
        rows["EnergyForcesStep"].append(step_ms(model, atoms.numbers, frames, dtype))
        rows["calculator"].append(calculator_ms(atoms.copy(), calc, frames))
        md_atoms = atoms.copy()
        _maxwell_boltzmann(md_atoms, 300, np.random.default_rng(0))
        rows["VelocityVerlet"].append(verlet_ms(md_atoms, calc, args.steps))
        if not args.no_cli:
            rows["torchani-fast md"].append(cli_ms(args.system, args.dtype, 5 * args.steps, args.threads))

    bare = statistics.median(rows["bare"])
    load = os.getloadavg()[0]
    print(f"# {label}, {args.system.name} ({len(atoms)} atoms), {args.dtype}, {args.threads} threads, "
          f"torch {torch.__version__}, {args.rounds} rounds, load average {load:.1f}")
    print(f"{'path':<20} {'ms/step':>9} {'overhead':>9}   rounds")
    for name, values in rows.items():
        med = statistics.median(values)
        over = "" if name == "bare" else f"{100 * (med - bare) / bare:8.1f}%"
        print(f"{name:<20} {med:9.3f} {over:>9}   {[round(v, 3) for v in values]}")


if __name__ == "__main__":
    main()
