"""EnergyForcesStep's chain rule by hand on the device path, against its autograd path.

On the device path a step of the ANI potential alone takes the networks op's
AEV gradient through the AEV's and the pair vectors' backward itself
(``EnergyForcesStep._energies_forces_by_hand``), with the members' mean and the
forces' sign folded into the last layer's weights, and the self energies of its
fixed species kept as one tensor. These tests run that path on CPU tensors
(``_device_paths.on_cpu``: the CPU kernels of the same ops) and compare it with
the autograd path (``_ani_only`` off), which it must equal to the bit.
"""
import pytest
import torch

import torchani_fast
from torchani_fast import _device_paths
from torchani_fast.step import EnergyForcesStep
from torchani_fast.testing import random_model, random_molecule

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def system():
    model = torchani_fast.patch(random_model("ANI2x", dtype=torch.float64))
    species, coords = random_molecule(30)
    # Padding in a second molecule: its self energies and forces are 0.
    species = torch.cat([species, species.masked_fill(torch.arange(30) >= 20, -1)])
    coords = torch.cat([coords, coords + 0.03])
    return model, species, coords


def both_paths(model, species, coords, x):
    """(by hand, autograd) results of a device-path step at ``x``, and whether it went by hand."""
    with _device_paths.on_cpu():
        step = EnergyForcesStep(model, species, coords, check_every=1)
        by_hand = step._chain_rule(x)
        got = step(x)
        step._ani_only = False  # (the autograd path, as for models with pair potentials)
        want = step(x)
    return got, want, by_hand


def test_chain_rule_by_hand_equals_autograd_to_the_bit(system):
    model, species, coords = system
    x = coords + 0.01
    (energies, forces), (e_ref, f_ref), by_hand = both_paths(model, species, coords, x)
    assert by_hand
    assert torch.equal(energies, e_ref) and torch.equal(forces, f_ref)
    assert not forces.requires_grad and not energies.requires_grad
    assert torch.all(forces[1, 20:] == 0)
    want = model.energies_forces(species, x)  # (the CPU path: other kernels, same values)
    torch.testing.assert_close(energies, want.energies, rtol=1e-12, atol=0)
    torch.testing.assert_close(forces, want.forces, rtol=0, atol=1e-12)


def test_members_not_a_power_of_two_take_autograd(system):
    # 1/3 is not exact in floating point: the mean stays a division (autograd).
    model, species, coords = system
    nets = model.potentials["nnp"].neural_networks
    nets.set_active_members([0, 2, 5])
    try:
        x = coords - 0.01
        (energies, forces), (e_ref, f_ref), by_hand = both_paths(model, species, coords, x)
        want = model.energies_forces(species, x)
    finally:
        nets.set_active_members(list(range(8)))
    assert not by_hand
    assert torch.equal(energies, e_ref) and torch.equal(forces, f_ref)
    torch.testing.assert_close(energies, want.energies, rtol=1e-12, atol=0)
    torch.testing.assert_close(forces, want.forces, rtol=0, atol=1e-12)


def test_self_energies_changed_in_place_are_seen(system):
    model, species, coords = system
    shifter = model.energy_shifter
    with _device_paths.on_cpu():
        step = EnergyForcesStep(model, species, coords)
        before, _ = step(coords)
        saved = shifter.self_energies.clone()
        try:
            with torch.no_grad():
                shifter.self_energies.add_(1.0)  # (one Hartree per real atom)
            after, _ = step(coords)
        finally:
            with torch.no_grad():
                shifter.self_energies.copy_(saved)
        restored, _ = step(coords)
    atoms = (species >= 0).sum(1).to(before.dtype)
    torch.testing.assert_close(after - before, atoms, rtol=0, atol=1e-9)
    assert torch.equal(restored, before)


@pytest.mark.parametrize("name", ["ANI2xr", "ANImbis"])
def test_other_compositions_take_autograd(name):
    # A pair potential (ANI-2xr's repulsion) or charges (ANImbis) besides the
    # networks: the step composes them as the model does, through autograd.
    model = torchani_fast.patch(random_model(name, dtype=torch.float64))
    species, coords = random_molecule(12)
    species = species.clamp(max=8)  # (H C N O: ANImbis' elements)
    x = coords + 0.01
    with _device_paths.on_cpu():
        step = EnergyForcesStep(model, species, coords)
        assert not step._chain_rule(x)
        energies, forces = step(x)
    want = model.energies_forces(species, x)
    torch.testing.assert_close(energies, want.energies, rtol=1e-12, atol=0)
    torch.testing.assert_close(forces, want.forces, rtol=0, atol=1e-12)
