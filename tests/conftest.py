"""Shared test set-up: molecules, TorchANI reference models, weights.

TorchANI is the reference for every test and runs in the same process.
Molecules ship in tests/data. Published weights are read only from
``$TORCHANI_DATA_DIR`` (never downloaded, never copied): when they are there,
``reference_model`` loads them; when they are not, it builds the same
architecture with seeded random weights, so every exactness test (which only
compares against TorchANI) still runs. Tests that need the published values
themselves use the ``weights`` fixture and skip, saying how to enable them.
"""
import copy
import os
import signal
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHANI_NO_WARN_EXTENSIONS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torchani  # noqa: E402

import torchani_fast  # noqa: E402
from torchani_fast.testing import random_model  # noqa: E402

MOLECULES = Path(__file__).resolve().parent / "data"


def pytest_configure(config):
    # A test run started in the background by a script (`cmd &`, no job control)
    # ignores SIGINT, and the CLI processes the tests start would inherit that:
    # the tests that interrupt a run with SIGINT, as Ctrl-C does, need them to
    # start with the default disposition (a handled signal resets at exec).
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
WEIGHTS_HINT = ("needs TorchANI's published weights: set TORCHANI_DATA_DIR to a folder with "
                "StateDicts/ani2x_state_dict.pt (and ani1x, ani1ccx)")


def has_weights(name="ANI2x"):
    """Whether ``$TORCHANI_DATA_DIR`` holds the published weights of model ``name``."""
    root = os.environ.get("TORCHANI_DATA_DIR")
    return bool(root) and (Path(root) / "StateDicts" / f"{name.lower()}_state_dict.pt").is_file()


@pytest.fixture
def weights():
    """Skip the test unless the published ANI-2x/ANI-1x weights are available."""
    if not (has_weights("ANI2x") and has_weights("ANI1x")):
        pytest.skip(WEIGHTS_HINT)


torch.set_num_threads(2)


def read_molecule(name, index=None):
    import ase.io

    return ase.io.read(MOLECULES / name, index=index) if index is not None else ase.io.read(MOLECULES / name)


def atoms_to_tensors(atoms, dtype=torch.float64, device="cpu"):
    """(species (1, N) atomic numbers, coords (1, N, 3), cell or None, pbc or None)."""
    species = torch.tensor(atoms.numbers, dtype=torch.long, device=device).unsqueeze(0)
    coords = torch.tensor(atoms.positions, dtype=dtype, device=device).unsqueeze(0)
    if atoms.pbc.any():
        cell = torch.tensor(atoms.cell.array, dtype=dtype, device=device)
        pbc = torch.tensor(atoms.pbc, device=device)
    else:
        cell = pbc = None
    return species, coords, cell, pbc


_MODELS = {}


def reference_model(name="ANI2x", dtype=torch.float64):
    """A fresh TorchANI model (built once per process, then deep-copied).

    The published weights when ``$TORCHANI_DATA_DIR`` has them, else seeded
    random weights of the same architecture (see the module docstring).
    """
    if name not in _MODELS:
        if has_weights(name):
            _MODELS[name] = getattr(torchani.models, name)()
        else:
            _MODELS[name] = random_model(name)
    return copy.deepcopy(_MODELS[name]).to(dtype)


def model_pair(name="ANI2x", dtype=torch.float64):
    """(TorchANI reference, patched copy) with identical weights."""
    ref = reference_model(name, dtype)
    return ref, torchani_fast.patch(copy.deepcopy(ref))


def energy_forces(model, species, coords, cell=None, pbc=None):
    x = coords.detach().clone().requires_grad_(True)
    e = model((species, x), cell=cell, pbc=pbc).energies
    (g,) = torch.autograd.grad(e.sum(), x)
    return e.detach(), -g


devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=devices)
def device(request):
    return request.param


# -- instruction-set levels of the CPU kernels ------------------------------------------------
ISA_LEVELS = ("none", "avx2", "avx512")  # lowest first


@pytest.fixture(params=ISA_LEVELS[::-1])
def isa(request):
    """Each instruction-set level the kernels have (capped), restored afterwards."""
    before = torchani_fast.cpu_isa()
    if ISA_LEVELS.index(request.param) > ISA_LEVELS.index(before):
        pytest.skip(f"the CPU runs {before}")
    torchani_fast.cpu_isa(request.param)
    yield request.param
    torchani_fast.cpu_isa("avx512")
    assert torchani_fast.cpu_isa() == before


@pytest.fixture
def levels():
    """The levels this CPU runs, lowest first; the cap is restored afterwards."""
    before = torchani_fast.cpu_isa()
    best = torchani_fast.cpu_isa("avx512")
    try:
        yield ISA_LEVELS[: ISA_LEVELS.index(best) + 1]
    finally:
        torchani_fast.cpu_isa(before)
