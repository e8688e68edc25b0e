"""The model API down the GPU paths with the CUDA kernels run in the CPU emulator.

``model.energies_forces`` on the device paths searches with the emulated
``neighbor_pairs_padded`` (``NeighborList.checked``: the checks' status read with
the pair count, the list cut to it). Against the CPU path: energies and forces
(float64, 1e-12), for a periodic box and for a capacity that overflows (searched
again at the exact size), and bad inputs named as on the CPU. Runs only when
TORCHANI_FAST_EMULATE_CUDA=1 (see tests/cuda_emulation).
"""
import os

import pytest
import torch

import torchani_fast
from torchani_fast import _device_paths
from torchani_fast.testing import random_model, water_box
from support_cuda import Emulated, load_emulator

pytestmark = [
    pytest.mark.skipif(os.environ.get("TORCHANI_FAST_EMULATE_CUDA") != "1",
                       reason="set TORCHANI_FAST_EMULATE_CUDA=1 to run the CUDA kernels in the CPU emulator"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture(scope="module")
def emu():
    return load_emulator()


@pytest.fixture(scope="module")
def box():
    model = torchani_fast.patch(random_model("ANI2x", dtype=torch.float64))
    return model, water_box(8)


@pytest.mark.parametrize("pairs_per_atom", [64, 2], ids=["fits", "overflows"])
def test_periodic_energies_forces_equal_the_cpu_path(emu, box, pairs_per_atom):
    model, (numbers, coords, cell, pbc) = box
    want = model.energies_forces(numbers, coords, cell, pbc)
    model.neighborlist.pairs_per_atom = pairs_per_atom
    with _device_paths.on_cpu(), Emulated(emu):
        got = model.energies_forces(numbers, coords, cell, pbc)
    torch.testing.assert_close(got.energies, want.energies, rtol=1e-12, atol=0)
    torch.testing.assert_close(got.forces, want.forces, rtol=1e-12, atol=1e-12)
    assert model.neighborlist.pairs_per_atom >= pairs_per_atom  # (grown on an overflow)
    if pairs_per_atom == 2:
        assert model.neighborlist.pairs_per_atom > 2


def test_bad_input_is_named(emu, box):
    """The emulated search reports bad input in its count (no raise): the worded checks run."""
    model, (numbers, coords, cell, pbc) = box
    nan = coords.clone()
    nan[0, 3, 1] = float("nan")
    singular = torch.tensor([[5.0, 0, 0], [10.0, 0, 0], [0, 0, 5.0]], dtype=torch.float64)
    with _device_paths.on_cpu(), Emulated(emu):
        with pytest.raises(ValueError, match=r"coords must be finite, got \[.*nan.*\] at molecule 0, atom 3"):
            model.energies_forces(numbers, nan, cell, pbc)
        with pytest.raises(ValueError, match=r"cell is singular"):
            model.energies_forces(numbers, coords, singular, pbc)
        with pytest.raises(ValueError, match=r"unsupported element Fe \(atomic number 26\) at molecule 0, atom 0"):
            model.energies_forces(torch.cat([torch.tensor([[26]]), numbers[:, 1:]], 1), coords, cell, pbc)
