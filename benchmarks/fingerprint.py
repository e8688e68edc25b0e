"""Bits of every entry point's results on fixed inputs, for a refactor's before/after.

    python benchmarks/fingerprint.py > before.txt    # (on the old build)
    python benchmarks/fingerprint.py > after.txt
    diff before.txt after.txt                          # no output: the same bits

Each line is an entry point and the SHA-256 of its results' bytes: the model's
forward (eager and scripted), ``energies_forces``, ``atomic_energies``,
``EnergyForcesStep``, the ASE calculator (molecule, and periodic with each
stress kind), OpenMM's force computation, Hessians, and screening's batch
evaluation, in float32 and float64, for ANI-2x (published weights when
``$TORCHANI_DATA_DIR`` has them, else seeded random ones) and ANI-2xr (seeded
random weights: repulsion). Not a test: it prints, and a developer compares.
"""
import hashlib
import os
import sys
from pathlib import Path

import numpy as np
import torch

import ase.io
import torchani_fast
from torchani_fast import testing

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


def digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        a = t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def model_of(name: str, dtype: torch.dtype):
    weights = os.environ.get("TORCHANI_DATA_DIR")
    if name == "ANI2x" and weights and (Path(weights) / "StateDicts" / "ani2x_state_dict.pt").is_file():
        from torchani_fast.models import ANI2x

        return ANI2x(dtype=dtype)
    return torchani_fast.patch(testing.random_model(name, seed=1).to(dtype))


def main() -> None:
    torch.set_num_threads(2)
    ligand = ase.io.read(DATA / "2iuz_ligand.xyz")
    small = ase.io.read(DATA / "3lka_ligand.xyz")
    water = ase.io.read(DATA / "water-0.8nm.xyz")
    lines = []
    for name in ("ANI2x", "ANI2xr"):
        for dtype in (torch.float32, torch.float64):
            tag = f"{name} {str(dtype)[6:]}"
            model = model_of(name, dtype)
            # A padded batch of two molecules.
            n = len(ligand)
            species = torch.full((2, n), -1, dtype=torch.long)
            coords = torch.zeros((2, n, 3), dtype=dtype)
            species[0] = torch.from_numpy(ligand.numbers)
            coords[0] = torch.from_numpy(ligand.positions)
            species[1, :len(small)] = torch.from_numpy(small.numbers)
            coords[1, :len(small)] = torch.from_numpy(small.positions)
            with torch.no_grad():
                lines.append((f"{tag} forward", digest(model((species, coords)).energies)))
                lines.append((f"{tag} atomic_energies", digest(model.atomic_energies((species, coords)).energies)))
            e, f = model.energies_forces(species, coords)
            lines.append((f"{tag} energies_forces", digest(e, f)))
            scripted = torch.jit.script(model)
            e, f = torchani_fast.models.energies_forces(scripted, species, coords)
            lines.append((f"{tag} scripted energies_forces", digest(e, f)))
            cell = torch.tensor(water.cell.array, dtype=dtype)
            pbc = torch.tensor([True, True, True])
            ws = torch.from_numpy(water.numbers).unsqueeze(0)
            wx = torch.tensor(water.positions, dtype=dtype).unsqueeze(0)
            e, f = model.energies_forces(ws, wx, cell, pbc)
            lines.append((f"{tag} periodic energies_forces", digest(e, f)))
            step = torchani_fast.EnergyForcesStep(model, species, coords)
            lines.append((f"{tag} EnergyForcesStep", digest(*step(coords))))
            step = torchani_fast.EnergyForcesStep(model, ws, wx, cell, pbc)
            lines.append((f"{tag} periodic EnergyForcesStep", digest(*step(wx))))
            for kind in ("scaling", "fdotr", "numerical"):
                atoms = water.copy()
                atoms.calc = model.ase(stress_kind=kind)
                lines.append((f"{tag} ASE periodic {kind}", digest(
                    [atoms.get_potential_energy()], atoms.get_forces(), atoms.get_stress())))
            atoms = ligand.copy()
            atoms.calc = model.ase()
            lines.append((f"{tag} ASE molecule", digest([atoms.get_potential_energy()], atoms.get_forces())))
            if name == "ANI2x":
                e, f, h = torchani_fast.models.energies_forces_hessians(model, species[1:, :len(small)],
                                                                       coords[1:, :len(small)])
                lines.append((f"{tag} hessians", digest(e, f, h)))
            try:
                from torchani_fast.apps.structures import evaluate_batch
            except ImportError:  # before the applications moved into torchani_fast.apps
                from torchani_fast.structures import evaluate_batch

            e, f, _ = evaluate_batch(model, [ligand, small], True, False)
            lines.append((f"{tag} screening batch", digest(e, f)))
    weights = os.environ.get("TORCHANI_DATA_DIR")
    if weights and (Path(weights) / "StateDicts" / "ani2x_state_dict.pt").is_file():
        from torchani_fast.openmm.force import ANIComputation

        class State:  # what ANIComputation reads of an OpenMM State
            def __init__(self, pos_nm):
                self.pos = pos_nm

            def getPositions(self, asNumpy=False):
                from openmm import unit

                return self.pos * unit.nanometer

        for dtype in ("float32", "float64"):
            comp = ANIComputation("ani2x-fast", ligand.numbers.tolist(), False, dtype=dtype, device="cpu")
            energy, forces = comp(State(ligand.positions / 10.0))
            lines.append((f"OpenMM ani2x-fast {dtype}", digest([energy], forces)))
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    sys.exit(main())
