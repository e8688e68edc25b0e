"""The CUDA tests' systems and models (random ANI-2x weights, padded and periodic
systems), shared by test_cuda.py (on a GPU) and test_cuda_emulated.py (the CPU
emulator)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchani_fast.testing import random_ani2x, random_molecule, water_box

CUTOFF = 5.2

# ---------------------------------------------------------------------------
# Systems and models


def ani2x_random(seed=0):
    """The ANI-2x architecture with random weights, float64 (see torchani_fast.testing)."""
    return random_ani2x(seed).to(torch.float64)


_MODEL = {}


def random_model():
    if "m" not in _MODEL:
        _MODEL["m"] = ani2x_random()
    import copy

    return copy.deepcopy(_MODEL["m"])


molecule = random_molecule


def padded_batch():
    """Three molecules of 46, 30 and 12 atoms padded to 46 with -1."""
    zs, xs = [], []
    for n, seed in ((46, 1), (30, 2), (12, 3)):
        z, x = molecule(n, seed)
        zs.append(torch.nn.functional.pad(z, (0, 46 - n), value=-1))
        xs.append(torch.nn.functional.pad(x, (0, 0, 0, 46 - n)))
    return torch.cat(zs), torch.cat(xs)


def elem_idxs(numbers):
    return random_model().species_converter(numbers)


def systems():
    """name -> (elem_idxs, coords, cell, pbc) in float64 on the CPU."""
    out = {}
    z, x = molecule()
    out["molecule46"] = (elem_idxs(z), x, None, None)
    z, x = padded_batch()
    out["padded_batch"] = (elem_idxs(z), x, None, None)
    z, x, cell, pbc = water_box(64)
    out["water192"] = (elem_idxs(z), x, cell, pbc)
    # Triclinic, partly periodic, coordinates outside the cell.
    z, x, cell, pbc = water_box(40, seed=3)
    cell = cell.clone()
    cell[1, 0] = 0.3 * cell[0, 0]
    cell[2, 1] = -0.2 * cell[1, 1]
    out["triclinic_xy"] = (elem_idxs(z), x + 2.0, cell, torch.tensor([True, True, False]))
    # An atom a hair below a cell face (its wrapped coordinate rounds to 1).
    z, x, cell, pbc = water_box(8, seed=5)
    x = x.clone()
    x[0, 0, 0] = -1e-17
    out["hair_below_face"] = (elem_idxs(z), x, cell, pbc)
    # A flat molecule (1e-153 A thick) next to a padded one: bin arithmetic must not overflow.
    out["flat"] = (torch.tensor([[0, 0], [0, -1]]), torch.tensor(
        [[[0.0, 0.0, 0.0], [0.0, 1.0, 2.6477e-153]], [[0.0] * 3] * 2], dtype=torch.float64),
        None, None)
    # A cell smaller than the cutoff: several images of every atom.
    z, x, cell, pbc = water_box(2, seed=4)
    out["tiny_cell"] = (elem_idxs(z), x, cell, pbc)
    return out


SYSTEMS = systems()


def to(system, device, dtype):
    species, coords, cell, pbc = system
    return (species.to(device), coords.to(device, dtype),
            None if cell is None else cell.to(device, dtype),
            None if pbc is None else pbc.to(device))


def pair_set(pairs, images):
    """Canonical, order-free form of a pair list (each pair as i <= j)."""
    rows = []
    for (i, j), img in zip(pairs.t().tolist(), images.round().long().tolist()):
        if i < 0:
            continue
        rows.append((i, j, *img))
    return sorted(rows)


def diff_vectors(coords, cell, pairs, images):
    flat = coords.reshape(-1, 3)
    safe = pairs.clamp(min=0)
    d = flat[safe[0]] - flat[safe[1]]
    if cell is not None:
        d = d + images @ cell
    return d


# ---------------------------------------------------------------------------
# The CPU emulator of the CUDA kernels (tests/cuda_emulation)


def load_emulator():
    """torch.ops.torchani_fast_emu, built on first use (minutes)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_emulation"))
    import build

    return build.load()


class Emulated(TorchDispatchMode):
    """Inside the block, torchani_fast's ops that have emulated CUDA kernels run those."""

    def __init__(self, emu):
        super().__init__()
        self.emu = emu

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "torchani_fast" and hasattr(self.emu, func._opname):
            func = getattr(self.emu, func._opname).default
        return func(*args, **(kwargs or {}))


def small_batch():
    """Three small molecules padded with -1 (8, 6 and 4 atoms)."""
    species = torch.full((3, 8), -1)
    coords = torch.zeros(3, 8, 3, dtype=torch.float64)
    g = torch.Generator().manual_seed(9)
    for m, n in enumerate((8, 6, 4)):
        species[m, :n] = torch.randint(0, 7, (n,), generator=g)
        coords[m, :n] = torch.rand(n, 3, generator=g, dtype=torch.float64) * 3.0
    return species, coords, None, None
