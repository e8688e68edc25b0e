"""The evaluation core (torchani_fast.core): one composition of the energy, served
to every front end; energies of a subset of atoms; groups pinned without a sync."""
import threading

import pytest
import torch

import torchani_fast
from torchani_fast import core
from support import model_pair, read_molecule
from support_models import molecule, pair


def _cluster(model, n=36, seed=3):
    species, coords = molecule(model, n, seed=seed)
    return species, coords


@pytest.mark.parametrize("local_elements", ["all", "H O only"])
@pytest.mark.parametrize("name", ["ANI2x", "ANI2xr", "ANI2dr"])
def test_local_energies_are_the_local_atoms_atomic_energies(name, local_elements, monkeypatch):
    # A domain's local atoms among ghosts (LAMMPS): with every neighbour present,
    # their atomic energies are the whole system's (TorchANI's atomic_energies,
    # pair potentials shared half and half), and only their networks run. With
    # "H O only" the ghosts hold every other element: the local atoms' AEV columns
    # of those elements must still be read.
    if name == "ANI2x":
        ref, fast = model_pair("ANI2x", torch.float64)
        ref, fast = ref[0], fast[0]
    else:
        ref, fast = pair(name)
    species, coords = _cluster(ref)
    num_local = 14
    if local_elements != "all":
        ghost = torch.tensor([int(z) not in (1, 8) for z in species[0]])
        order = torch.argsort(ghost.to(torch.long), stable=True)
        species, coords = species[:, order], coords[:, order]
        num_local = int((~ghost).sum())
        assert set(species[0, num_local:].tolist()) - {1, 8}
    nets = fast.potentials["nnp"].neural_networks
    evaluated = []
    grouped = nets._grouped_atomic

    def spy(num_atoms, aev, atoms, *args):
        evaluated.append(atoms.clone())
        return grouped(num_atoms, aev, atoms, *args)

    monkeypatch.setattr(nets, "_grouped_atomic", spy)
    elem = fast.species_converter(species)
    local = core.local_energies(fast, elem, coords, num_local)
    monkeypatch.undo()
    expected = ref.atomic_energies((species, coords)).energies[:, :num_local]
    torch.testing.assert_close(local, expected, rtol=0, atol=1e-10)
    assert len(evaluated) == 1 and sorted(evaluated[0].tolist()) == list(range(num_local))
    # Two domains that split the atoms (each sees all the others as ghosts): their
    # local energies add up to the total energy.
    n = species.shape[1]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    a = core.local_energies(fast, elem[:, order], coords[:, order], num_local)
    rest = order.roll(-num_local)
    b = core.local_energies(fast, elem[:, rest], coords[:, rest], n - num_local)
    torch.testing.assert_close(a.sum() + b.sum(), ref((species, coords)).energies[0], rtol=1e-12, atol=0)


def test_local_energies_scripted_equal_eager():
    ref, fast = model_pair("ANI2x", torch.float64)
    fast = fast[0]
    species, coords = _cluster(ref[0])
    elem = fast.species_converter(species)
    scripted = torch.jit.script(fast)
    found, _ = core.neighbors(fast, elem, coords, None, None)
    assert torch.equal(scripted.local_atomic_energies(elem, coords, found, 9)[:, :9],
                       core.local_energies(fast, elem, coords, 9))


def test_pinned_groups_give_a_model_calls_bits_and_stay_in_their_thread():
    ref, fast = model_pair("ANI2x", torch.float32)
    atoms = read_molecule("2iuz_ligand.xyz")
    species = torch.tensor(atoms.numbers).unsqueeze(0)
    coords = torch.tensor(atoms.positions, dtype=torch.float32).unsqueeze(0)
    nets = fast.potentials["nnp"].neural_networks
    elem = fast.species_converter(species)
    e, f = fast.energies_forces(species, coords)
    with nets.pinned(nets.fixed_groups(elem)):
        e_pinned, f_pinned = fast.energies_forces(species, coords)
        # Another thread evaluating another molecule meanwhile finds its own groups.
        other = {}
        water = read_molecule("water-0.8nm.xyz")[:6]
        ws = torch.tensor(water.numbers).unsqueeze(0)
        wx = torch.tensor(water.positions, dtype=torch.float32).unsqueeze(0)
        thread = threading.Thread(target=lambda: other.update(ef=fast.energies_forces(ws, wx)))
        thread.start()
        thread.join()
    torch.testing.assert_close(e_pinned, e, rtol=0, atol=8 * torch.finfo(torch.float32).eps * float(e.abs().max()))
    torch.testing.assert_close(f_pinned, f, rtol=0, atol=5e-5)
    e_ref, _ = torchani_fast.models.energies_forces(ref, ws, wx)
    torch.testing.assert_close(other["ef"][0], e_ref, rtol=0, atol=1e-4)
    assert nets._pinned_groups() is None  # (left the context: nothing pinned)


def test_the_step_and_the_model_share_one_composition():
    # EnergyForcesStep, the model's forward and core.energies_forces_virial (ASE) give
    # the same bits for a model with repulsion: one sum in one order.
    ref, fast = pair("ANI2xr")
    species, coords = molecule(ref, 20)
    step = torchani_fast.EnergyForcesStep(fast, species, coords)
    e_step, f_step = step(coords)
    e_model, f_model = fast.energies_forces(species, coords)
    assert torch.equal(e_step, e_model) and torch.equal(f_step, f_model)
    elem = fast.species_converter(species)
    e_ase, f_ase, _ = core.energies_forces_virial(fast, species, elem, coords.clone(), None, None)
    assert torch.equal(e_ase, e_model) and torch.equal(f_ase, f_model[0])



@pytest.mark.filterwarnings("ignore:molecule_idxs is experimental")
def test_forward_keeps_torchanis_molecule_idxs():
    """The patched forward (which is not TorchANI's) keeps TorchANI's experimental
    ``_molecule_idxs``: only pairs within a molecule count, on the CPU and the device paths."""
    from torchani_fast import _device_paths

    ref, fast = pair("ANI2x")
    species, coords = molecule(ref, 20)
    idxs = torch.arange(20) // 7  # three "molecules" of the cluster
    want = ref((species, coords), _molecule_idxs=idxs).energies
    assert not torch.allclose(want, ref((species, coords)).energies)  # (the pairs between them count)
    torch.testing.assert_close(fast((species, coords), _molecule_idxs=idxs).energies, want, rtol=1e-10, atol=0)
    with _device_paths.on_cpu():
        got = fast((species, coords), _molecule_idxs=idxs).energies
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    with pytest.raises(ValueError, match=r"_molecule_idxs must have shape \(20,\), one index per atom, got \[19\]"):
        fast((species, coords), _molecule_idxs=idxs[:19])
