"""torchani_fast.models: factories, energies_forces, and the patched model's front door."""
import copy

import pytest
import torch
import torchani

import torchani_fast.models as fm
from support import atoms_to_tensors, energy_forces, model_pair, read_molecule, reference_model


@pytest.fixture(scope="module")
def pair():
    return model_pair("ANI2x", torch.float64)


@pytest.fixture(scope="module")
def single_network():
    """One member of TorchANI's ANI-2x in float64 (cheap to copy and script)."""
    return reference_model("ANI2x", torch.float64)[0]


@pytest.fixture(scope="module")
def ligand():
    return atoms_to_tensors(read_molecule("3lka_ligand.xyz"))


def test_ani2x_factory_loads_patched_model_equal_to_torchani(weights):
    ref = reference_model("ANI2x", torch.float64)
    model = fm.ANI2x(dtype=torch.float64)
    from torchani_fast.patch import is_patched

    assert is_patched(model)
    assert isinstance(model, torchani.arch.ANI)
    assert next(model.parameters()).dtype == torch.float64
    species, coords, _, _ = atoms_to_tensors(read_molecule("CH4-5.xyz", index=0))
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = model.energies_forces(species, coords)
    torch.testing.assert_close(e, e_ref, rtol=0, atol=1e-9)
    torch.testing.assert_close(f, f_ref, rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", ["ANI1x", "ANI1ccx", "ANI2x"])
def test_factories_forward_torchani_arguments(monkeypatch, name, single_network):
    # The wrappers must pass every TorchANI argument through and patch the result;
    # TorchANI's own factory is replaced by one that records its arguments (and
    # returns an already-loaded model), so no weights are read again.
    seen = {}

    def fake(**kwargs):
        seen.update(kwargs)
        return copy.deepcopy(single_network)

    monkeypatch.setattr(torchani.models, name, fake)
    model = getattr(fm, name)(model_index=3, periodic_table_index=True, device="cpu",
                              dtype=torch.float64, neighborlist="cell_list", strategy="cuaev")
    assert seen["model_index"] == 3 and seen["device"] == "cpu" and seen["dtype"] == torch.float64
    assert seen["periodic_table_index"] is True
    assert model.potentials["nnp"].aev_computer.neighborlist.strategy == "cell_list"
    assert len(model) == 1
    with pytest.raises(ValueError, match="neighborlist"):
        getattr(fm, name)(neighborlist="verlet_cell_list")
    with pytest.raises(ValueError, match="strategy"):
        getattr(fm, name)(strategy="no-such-strategy")


def test_energies_forces_matches_torchani_and_leaves_inputs_untouched(pair, ligand):
    ref, fast = pair
    species, coords, _, _ = ligand
    e_ref, f_ref = energy_forces(ref, species, coords)

    plain = coords.clone()
    e, f = fm.energies_forces(fast, species, plain)
    assert not plain.requires_grad and plain.grad is None
    torch.testing.assert_close(plain, coords, rtol=0, atol=0)
    torch.testing.assert_close(e, e_ref, rtol=0, atol=1e-9)
    torch.testing.assert_close(f, f_ref, rtol=0, atol=1e-9)
    assert not e.requires_grad and not f.requires_grad

    # A caller's leaf that requires grad keeps its flag and gets no .grad.
    leaf = coords.clone().requires_grad_(True)
    e2, f2 = fast.energies_forces(species, leaf)
    assert leaf.requires_grad and leaf.grad is None
    torch.testing.assert_close(f2, f_ref, rtol=0, atol=1e-9)

    # float32 coordinates go to the model's dtype; no grad mode needed.
    with torch.no_grad():
        e3, _ = fm.energies_forces(fast, species, coords.float())
    assert e3.dtype == torch.float64
    torch.testing.assert_close(e3, e_ref, rtol=1e-6, atol=0)


def test_energies_forces_batch_periodic(pair):
    ref, fast = pair
    species, coords, cell, pbc = atoms_to_tensors(read_molecule("water-0.8nm.xyz"))
    e_ref, f_ref = energy_forces(ref, species, coords, cell, pbc)
    e, f = fm.energies_forces(fast, species, coords, cell, pbc)
    torch.testing.assert_close(e, e_ref, rtol=0, atol=1e-9)
    torch.testing.assert_close(f, f_ref, rtol=0, atol=1e-9)


def test_hessians_match_torchani(pair):
    ref, fast = pair[0][0], pair[1][0]  # one network: 15 double-backward passes each
    methane = read_molecule("CH4-5.xyz", index=0)
    species, coords, _, _ = atoms_to_tensors(methane)
    e, f, h = fm.energies_forces_hessians(fast, species, coords)
    expected = torchani.single_point(ref, species, coords.clone(), hessians=True)
    torch.testing.assert_close(e, expected["energies"], rtol=0, atol=1e-9)
    torch.testing.assert_close(f, expected["forces"], rtol=0, atol=1e-9)
    torch.testing.assert_close(h, expected["hessians"], rtol=1e-7, atol=1e-8)


def test_patched_ase_returns_fast_calculator(pair):
    _, fast = pair
    from torchani_fast.ase import Calculator

    calc = fast.ase(stress_kind="fdotr")
    assert isinstance(calc, Calculator) and calc.model is fast
    # Indexing an ensemble deep-copies the model: the copy keeps the front door.
    assert isinstance(fast[0].ase(), Calculator)


def test_front_door_does_not_change_torchscript(single_network):
    # The class swap must leave scripting exactly as it was: check it on an
    # unpatched TorchANI model too, so this test does not depend on the kernels.
    from torchani_fast._front_door import swap_class
    from torchani_fast.patch import _model_class

    ref = copy.deepcopy(single_network)
    plain = copy.deepcopy(ref)
    swap_class(ref, _model_class(type(ref)))
    assert type(ref).__name__ == "PatchedANI"
    species, coords, _, _ = atoms_to_tensors(read_molecule("CH4-5.xyz", index=0))
    scripted = torch.jit.script(ref)
    torch.testing.assert_close(scripted((species, coords)).energies,
                               plain((species, coords)).energies, rtol=0, atol=1e-12)


def test_patched_model_scripts_and_scripted_calculator_works(pair):
    ref, fast = pair
    atoms = read_molecule("water-0.8nm.xyz")
    a_ref, a_jit = atoms.copy(), atoms.copy()
    a_ref.calc = ref.ase()
    a_jit.calc = fast.ase(jit=True)
    assert a_jit.calc.model.__class__.__name__ == "RecursiveScriptModule"
    torch.testing.assert_close(torch.tensor(a_jit.get_forces()), torch.tensor(a_ref.get_forces()),
                               rtol=0, atol=1e-8)
    torch.testing.assert_close(torch.tensor(a_jit.get_stress()), torch.tensor(a_ref.get_stress()),
                               rtol=0, atol=1e-10)
    scripted = a_jit.calc.model
    species, coords, cell, pbc = atoms_to_tensors(atoms)
    torch.testing.assert_close(scripted((species, coords), cell, pbc).energies,
                               ref((species, coords), cell, pbc).energies, rtol=0, atol=1e-9)


def test_hessians_under_no_grad(pair):
    # An outer torch.no_grad() (e.g. an inference loop) must not break Hessians.
    fast = pair[1][0]
    species, coords, _, _ = atoms_to_tensors(read_molecule("CH4-5.xyz", index=0))
    e, f, h = fm.energies_forces_hessians(fast, species, coords)
    with torch.no_grad():
        e2, f2, h2 = fm.energies_forces_hessians(fast, species, coords)
    assert torch.equal(e, e2) and torch.equal(f, f2) and torch.equal(h, h2)
