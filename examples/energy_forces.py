"""Energy and forces of a drug-like ligand with ANI-2x, three ways.

    python examples/energy_forces.py [molecule.xyz]

Uses the 46-atom ligand shipped next to this script by default. Weights are
read from $TORCHANI_DATA_DIR (default: ../shared/torchani-data next to the repo).
"""
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ.setdefault("TORCHANI_DATA_DIR", str(HERE.parent.parent / "shared" / "torchani-data"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHANI_NO_WARN_EXTENSIONS", "1")

import ase.io  # noqa: E402
import torch  # noqa: E402

from torchani_fast.models import ANI2x  # noqa: E402

path = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "2iuz_ligand.xyz"
atoms = ase.io.read(path)
model = ANI2x(dtype=torch.float64)  # a TorchANI model, patched by torchani_fast

# 1. Tensors in, tensors out (Hartree, Hartree/Å); the input tensors are left untouched.
species = torch.tensor(atoms.numbers).unsqueeze(0)  # (1, N) atomic numbers
coords = torch.tensor(atoms.positions).unsqueeze(0)  # (1, N, 3) Å
energies, forces = model.energies_forces(species, coords)
print(f"{path.name}: {len(atoms)} atoms, E = {energies.item():.6f} Ha, "
      f"max |F| = {forces.norm(dim=-1).max().item():.4f} Ha/Å")

# 2. The plain TorchANI call still works on the patched model.
print(f"model((species, coords)).energies = {model((species, coords)).energies.item():.6f} Ha")

# 3. ASE (eV, eV/Å): one model evaluation serves energy and forces.
atoms.calc = model.ase()
print(f"ASE: E = {atoms.get_potential_energy():.4f} eV, "
      f"max |F| = {(atoms.get_forces() ** 2).sum(1).max() ** 0.5:.4f} eV/Å "
      f"({atoms.calc.evaluations} model evaluation)")
