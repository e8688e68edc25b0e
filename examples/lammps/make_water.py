"""Write the inputs of in.water: water.data (a periodic water box) and ani2x.pt (the model).

    python make_water.py [--molecules-per-side 10] [--dtype float32]

10 molecules per side: 3 000 atoms in a 31 Å cube (≈1 g/cm³). Types: 1 = O, 2 = H,
so that ``pair_coeff * * O H``. The model is ANI-2x, patched by torchani_fast and
saved for pair_style torchani_fast (TorchANI's published weights, downloaded on
first use or read from $TORCHANI_DATA_DIR).
"""
import argparse

import torch
import torchani

import torchani_fast
import torchani_fast.lammps
from torchani_fast.lammps.data import density, water_box, write_data

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--molecules-per-side", type=int, default=10)
parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
args = parser.parse_args()

atoms = water_box(args.molecules_per_side, seed=0)
write_data(atoms, "water.data", ["O", "H"])
print(f"water.data: {len(atoms)} atoms, {density(atoms):.3f} g/cm³")
model = torchani_fast.patch(torchani.models.ANI2x().to(getattr(torch, args.dtype)))
torchani_fast.lammps.save(model, "ani2x.pt")
print(f"ani2x.pt: ANI-2x {args.dtype}")
