"""Relax a ligand with ANI-2x and ASE's BFGS.

    python examples/optimize.py [molecule.xyz] [--fmax 0.01] [-o optimized.xyz]

Same as ``torchani-fast optimize molecule.xyz``, written out in Python.
"""
import argparse
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ.setdefault("TORCHANI_DATA_DIR", str(HERE.parent.parent / "shared" / "torchani-data"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHANI_NO_WARN_EXTENSIONS", "1")

import ase.io  # noqa: E402
import torch  # noqa: E402
from ase.optimize import BFGS  # noqa: E402

from torchani_fast.models import ANI2x  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("file", nargs="?", type=Path, default=HERE / "2iuz_ligand.xyz")
parser.add_argument("--fmax", type=float, default=0.01, help="eV/Å")
parser.add_argument("-o", "--output", type=Path, default=None, help="write the result (extended XYZ)")
args = parser.parse_args()

atoms = ase.io.read(args.file)
atoms.calc = ANI2x(dtype=torch.float64).ase()  # float64: smooth enough for tight fmax
e_start = atoms.get_potential_energy()
opt = BFGS(atoms, logfile="-")
converged = opt.run(fmax=args.fmax, steps=500)
e_end = atoms.get_potential_energy()
print(f"{args.file.name}: {'converged' if converged else 'NOT converged'} in {opt.nsteps} steps, "
      f"E {e_start:.4f} -> {e_end:.4f} eV ({e_end - e_start:+.4f} eV), "
      f"{atoms.calc.evaluations} model evaluations")
if args.output:
    ase.io.write(args.output, atoms, format="extxyz")
    print(f"wrote {args.output}")
