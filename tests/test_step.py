"""EnergyForcesStep: a fixed system evaluated without host syncs, against TorchANI."""
import pytest
import torch

from torchani_fast.step import EnergyForcesStep
from support import atoms_to_tensors, energy_forces, model_pair, read_molecule

F32_EPS = torch.finfo(torch.float32).eps


def assert_matches(actual, expected, dtype):
    (e, f), (e_ref, f_ref) = actual, expected
    if dtype == torch.float64:
        torch.testing.assert_close(e, e_ref, rtol=1e-10, atol=0)
        torch.testing.assert_close(f, f_ref, rtol=0, atol=1e-9)
    else:
        torch.testing.assert_close(e, e_ref, rtol=0, atol=8 * F32_EPS * e_ref.abs().max().item())
        torch.testing.assert_close(f, f_ref, rtol=0, atol=5e-5)


def padded_pair(dtype):
    a, b = (atoms_to_tensors(read_molecule(n), dtype) for n in ("3lka_ligand.xyz", "CH4-5.xyz"))
    width = a[0].shape[1]
    species = torch.full((2, width), -1, dtype=torch.long)
    coords = torch.zeros((2, width, 3), dtype=dtype)
    for i, (s, x, _, _) in enumerate((a, b)):
        species[i, : s.shape[1]] = s[0]
        coords[i, : s.shape[1]] = x[0]
    return species, coords, None, None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", ["2iuz_ligand.xyz", "benzene.xyz", "water-0.8nm.xyz", "padded"])
def test_step_matches_torchani(name, dtype):
    ref, fast = model_pair("ANI2x", dtype)
    if name == "padded":
        system = padded_pair(dtype)
    else:
        system = atoms_to_tensors(read_molecule(name), dtype)
    species, coords, cell, pbc = system
    step = EnergyForcesStep(fast, species, coords, cell, pbc)
    assert step.max_pairs > step.check() > 0
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = coords + 0.05 * torch.randn(coords.shape, generator=g, dtype=dtype)
        x = torch.where(species.unsqueeze(-1) >= 0, x, coords)
        assert_matches(step(x), energy_forces(ref, species, x, cell, pbc), dtype)
    # The model itself is unchanged and still takes any input.
    other = atoms_to_tensors(read_molecule("CH4-5.xyz"), dtype)
    assert_matches(energy_forces(fast, *other), energy_forces(ref, *other), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_step_groups_atoms_like_a_model_call_on_the_cpu(dtype):
    # 1hz5: enough H/C/N/O atoms for a model call to split off those that see
    # the rare S and to order the rest by the neighbour blocks they lack; groups
    # fixed at construction give other tiles and member slices, so other bits.
    ref, fast = model_pair("ANI2x", dtype)
    species, coords, _, _ = atoms_to_tensors(read_molecule("1hz5.xyz"), dtype)
    step = EnergyForcesStep(fast, species, coords)
    g = torch.Generator().manual_seed(1)
    for x in (coords, coords + 0.1 * torch.randn(coords.shape, generator=g, dtype=dtype)):
        e, f = step(x)
        e_model, f_model = energy_forces(fast, species, x)
        assert torch.equal(e, e_model) and torch.equal(f, f_model)
        assert_matches((e, f), energy_forces(ref, species, x), dtype)


def test_step_ensemble_subset_and_single_member():
    ref, fast = model_pair("ANI2x", torch.float64)
    species, coords, _, _ = atoms_to_tensors(read_molecule("3o99_ligand.xyz"))
    for model in (ref, fast):
        model.set_active_members([2, 5, 7])
    assert_matches(EnergyForcesStep(fast, species, coords)(coords),
                   energy_forces(ref, species, coords), torch.float64)
    assert_matches(EnergyForcesStep(fast[3], species, coords)(coords),
                   energy_forces(ref[3], species, coords), torch.float64)


def test_step_overflow_and_bad_coordinates_raise():
    _, fast = model_pair("ANI2x", torch.float64)
    species, coords, cell, pbc = atoms_to_tensors(read_molecule("water-0.8nm.xyz"))
    with pytest.raises(RuntimeError, match="do not fit in max_pairs=10"):
        EnergyForcesStep(fast, species, coords, cell, pbc, max_pairs=10)
    step = EnergyForcesStep(fast, species, coords, cell, pbc)
    bad = coords.clone()
    bad[0, 1, 2] = float("nan")
    with pytest.raises(RuntimeError, match="finite"):
        step(bad)
    # A molecule squeezed to 60% has every pair within the cutoff (1 035 > 1.3 x 437):
    # an error at that call, never a silently truncated energy.
    species, coords, _, _ = atoms_to_tensors(read_molecule("2iuz_ligand.xyz"))
    step = EnergyForcesStep(fast, species, coords)
    with pytest.raises(RuntimeError, match="Raise max_pairs"):
        step(coords * 0.6)


def test_growing_step_makes_room_instead_of_raising():
    """The squeezed molecule above, through a GrowingStep: the overflowing call
    is recomputed by a step with room, TorchANI's numbers; the pair count of a
    non-finite geometry still raises; ``check_every`` is its own."""
    from torchani_fast.step import GrowingStep

    ref, fast = model_pair("ANI2x", torch.float64)
    species, coords, _, _ = atoms_to_tensors(read_molecule("2iuz_ligand.xyz"))
    step = GrowingStep(fast, species, coords)
    assert_matches(step(coords), energy_forces(ref, species, coords), torch.float64)
    small = step.step.max_pairs
    squeezed = coords * 0.6
    assert_matches(step(squeezed), energy_forces(ref, species, squeezed), torch.float64)
    assert step.builds == 2 and step.step.max_pairs > small
    assert_matches(step(coords), energy_forces(ref, species, coords), torch.float64)
    assert step.builds == 2  # room is kept
    bad = coords.clone()
    bad[0, 1, 2] = float("inf")
    with pytest.raises(RuntimeError, match="finite"):
        step(bad)
    with pytest.raises(TypeError, match="check_every"):
        GrowingStep(fast, species, coords, check_every=5)
    assert EnergyForcesStep.supports(fast) and not EnergyForcesStep.supports(ref)
    assert not EnergyForcesStep.supports(torch.jit.script(fast))


def test_step_argument_errors():
    ref, fast = model_pair("ANI2x", torch.float64)
    species, coords, _, _ = atoms_to_tensors(read_molecule("2iuz_ligand.xyz"))
    with pytest.raises(TypeError, match="patched"):
        EnergyForcesStep(ref, species, coords)
    fe = species.clone()
    fe[0, 3] = 26
    with pytest.raises(ValueError, match="unsupported element Fe"):
        EnergyForcesStep(fast, fe, coords)
    step = EnergyForcesStep(fast, species, coords)
    with pytest.raises(ValueError, match="shape"):
        step(coords[:, :10])
    with pytest.raises(ValueError, match="float64"):
        step(coords.float())


def test_step_and_calculator_reuse_their_memory_for_large_systems():
    """EnergyForcesStep and the ASE calculator own a Workspace: from the second
    call on, the AEV and its gradient reuse the first call's memory (two blocks
    held between calls). For a system whose AEV is below the workspace's 1 MB
    they skip it (it would do nothing). Results equal the model's."""
    import ase

    from torchani_fast.workspace import WORKSPACE_MIN_BYTES
    from torchani_fast.testing import water_box

    ref, fast = model_pair("ANI2x", torch.float64)
    species, coords, cell, pbc = water_box(200)  # 600 atoms: a 4.8 MB AEV in float64
    aev_bytes = species.numel() * fast.aev_computer.out_dim * 8
    assert aev_bytes > WORKSPACE_MIN_BYTES
    step = EnergyForcesStep(fast, species, coords, cell, pbc)
    for k in range(2):
        x = coords + 0.01 * k * torch.sin(torch.arange(coords.numel(), dtype=torch.float64)).view_as(coords)
        assert_matches(step(x), energy_forces(ref, species, x, cell, pbc), torch.float64)
    assert step._workspace.nbytes == 2 * aev_bytes
    small = EnergyForcesStep(fast, *atoms_to_tensors(read_molecule("2iuz_ligand.xyz"), torch.float64))
    assert small._workspace is None
    calc = fast.ase()
    atoms = ase.Atoms(species[0].numpy(), positions=coords[0].numpy(), cell=cell.numpy(), pbc=True)
    atoms.calc = calc
    e = atoms.get_potential_energy()
    assert calc._workspace.nbytes == 2 * aev_bytes
    assert abs(e / ase.units.Hartree - float(energy_forces(ref, species, coords, cell, pbc)[0])) < 1e-8
