"""Molecular dynamics of a ligand with ANI-2x: NVE (default) or Langevin at 300 K.

    python examples/md.py [molecule.xyz] [--steps 200] [--langevin] [-o traj.xyz]

Same as ``torchani-fast md molecule.xyz``, written out in Python.
"""
import argparse
import os
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ.setdefault("TORCHANI_DATA_DIR", str(HERE.parent.parent / "shared" / "torchani-data"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHANI_NO_WARN_EXTENSIONS", "1")

import ase.io  # noqa: E402
import ase.units as units  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from ase.md.langevin import Langevin  # noqa: E402
from ase.md.velocitydistribution import Stationary, ZeroRotation  # noqa: E402
from ase.md.verlet import VelocityVerlet  # noqa: E402

from torchani_fast.models import ANI2x  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("file", nargs="?", type=Path, default=HERE / "2iuz_ligand.xyz")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--dt", type=float, default=0.5, help="fs")
parser.add_argument("--langevin", action="store_true", help="NVT Langevin instead of NVE")
parser.add_argument("-o", "--output", type=Path, default=None, help="trajectory (extended XYZ)")
args = parser.parse_args()

atoms = ase.io.read(args.file)
atoms.calc = ANI2x(dtype=torch.float64).ase()
rng = np.random.default_rng(0)
try:  # ASE >= 3.29 (MaxwellBoltzmannDistribution, deprecated there, makes the same draw)
    from ase.md.velocitydistribution import thermalize_momenta
except ImportError:
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution as _mb

    def thermalize_momenta(atoms, temperature_K, rng):
        _mb(atoms, temperature_K=temperature_K, rng=rng)
thermalize_momenta(atoms, 300, rng=rng)
Stationary(atoms)
ZeroRotation(atoms)

if args.langevin:
    dyn = Langevin(atoms, args.dt * units.fs, temperature_K=300, friction=0.01 / units.fs, rng=rng)
else:
    dyn = VelocityVerlet(atoms, args.dt * units.fs)


def report():
    print(f"step {dyn.nsteps:5d}  Epot {atoms.get_potential_energy():12.4f} eV  "
          f"Etot {atoms.get_total_energy():12.4f} eV  T {atoms.get_temperature():6.1f} K")


dyn.attach(report, interval=max(1, args.steps // 10))
if args.output:
    args.output.unlink(missing_ok=True)  # frames are appended below
    dyn.attach(lambda: ase.io.write(args.output, atoms, format="extxyz", append=True), interval=10)
start = time.perf_counter()
dyn.run(args.steps)
seconds = time.perf_counter() - start
print(f"{args.steps} steps in {seconds:.1f} s ({args.steps / seconds:.1f} steps/s, "
      f"{atoms.calc.evaluations} model evaluations)")
