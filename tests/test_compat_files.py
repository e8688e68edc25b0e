"""Files saved by torchani_fast 0.1.0 load with this version and give TorchANI's results.

tests/data/compat-0.1.0/make.py made them with 0.1.0 (before the library and the
applications were split into torchani_fast/ and torchani_fast/apps/): a patched
model pickled whole (``torch.save``: classes by their 0.1.0 paths), the same
model scripted (``torch.jit.save``), and an OpenMM force computation pickled as
OpenMM's XmlSerializer pickles it (``torchani_fast.openmm.force.ANIComputation``).
"""
import copy
import pickle
from pathlib import Path

import pytest
import torch

import torchani_fast
from support import energy_forces

FILES = Path(__file__).resolve().parent / "data" / "compat-0.1.0"


def _stock(model):
    """TorchANI's own model of make.py's architecture with the weights of ``model``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compat_make", FILES / "make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    stock = make.small_model()
    stock.load_state_dict(model.state_dict())
    return stock


def _inputs():
    species = torch.tensor([[8, 1, 1, 6, 1, 1, 1, 1], [6, 1, 1, 1, 1, -1, -1, -1]])
    g = torch.Generator().manual_seed(0)
    coords = torch.randn(2, 8, 3, generator=g) * 1.1
    return species, coords


def test_a_pickled_patched_model_loads_and_matches_torchani():
    model = torch.load(FILES / "model.pt", weights_only=False)
    assert torchani_fast.is_patched(model) and type(model).__name__ == "PatchedANI"
    assert type(model.potentials["nnp"].neural_networks).__name__ == "FusedEnsemble"
    species, coords = _inputs()
    e, f = energy_forces(model, species, coords)
    e_ref, f_ref = energy_forces(_stock(model), species, coords)
    torch.testing.assert_close(e, e_ref, rtol=0, atol=8 * torch.finfo(torch.float32).eps * float(e_ref.abs().max()))
    torch.testing.assert_close(f, f_ref, rtol=0, atol=5e-5)
    # The 0.1.0 object is a current one: its new entry points work too.
    e2, f2 = model.energies_forces(species, coords)
    assert torch.equal(e2, e) and torch.equal(f2, f)
    double = copy.deepcopy(model).double()
    e64, _ = double.energies_forces(species, coords.double())
    e64_ref, _ = energy_forces(_stock(model).double(), species, coords.double())
    torch.testing.assert_close(e64, e64_ref, rtol=1e-10, atol=0)
    # On a GPU its calls take the device path, whose neighbour list (0.1.0's object)
    # keeps a capacity that 0.1.0 did not have.
    from torchani_fast import _device_paths

    with _device_paths.on_cpu():
        e_dev, f_dev = double.energies_forces(species, coords.double())
    torch.testing.assert_close(e_dev, e64, rtol=1e-12, atol=0)


def test_a_scripted_0_1_0_model_loads_and_matches_torchani():
    loaded = torch.jit.load(str(FILES / "scripted.pt"))
    model = torch.load(FILES / "model.pt", weights_only=False)
    species, coords = _inputs()
    e, f = energy_forces(loaded, species, coords)
    e_ref, f_ref = energy_forces(_stock(model), species, coords)
    torch.testing.assert_close(e, e_ref, rtol=0, atol=8 * torch.finfo(torch.float32).eps * float(e_ref.abs().max()))
    torch.testing.assert_close(f, f_ref, rtol=0, atol=5e-5)


def test_an_openmm_computation_pickled_by_0_1_0_unpickles(monkeypatch):
    from torchani_fast import models
    from torchani_fast.apps.openmm.force import ANIComputation

    # The computation rebuilds its model by name when unpickled: serve one (no weights needed).
    served = torchani_fast.patch(torchani_fast.testing.random_model("ANI2x", model_index=0).double())
    monkeypatch.setitem(models._LOADED, models.cache_key("ANI2x", dtype=torch.float64), served)
    computation = pickle.loads((FILES / "openmm_computation.pkl").read_bytes())
    assert type(computation) is ANIComputation
    assert computation.name == "ani2x-fast" and computation.atomic_numbers == [8, 1, 1]
    assert computation.model is served


@pytest.mark.parametrize("old, new", [
    ("torchani_fast.ase", "torchani_fast.apps.ase"),
    ("torchani_fast.cli", "torchani_fast.apps.cli"),
    ("torchani_fast.screen", "torchani_fast.apps.screen"),
    ("torchani_fast.openmm.force", "torchani_fast.apps.openmm.force"),
    ("torchani_fast.openmm.torchforce", "torchani_fast.apps.openmm.torchforce"),
    ("torchani_fast.evaluate", "torchani_fast.core"),
])
def test_old_import_paths_are_the_moved_modules(old, new):
    import importlib

    assert importlib.import_module(old) is importlib.import_module(new)
    assert callable(torchani_fast.screen)  # the package's screen() is still the function
