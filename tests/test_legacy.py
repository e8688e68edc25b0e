"""TorchANI 2.2.4 (the legacy API), patched, against 2.2.4 itself in the same process.

Runs only where TorchANI 2.2.4 is installed (.ci/run makes a venv for it); the
main venv skips the module. 2.2.4 reads NeuroChem files from its package folder
``torchani/resources/`` (the wheel ships ANI-1x's networks but empty ``.info``
files and empty ANI-2x/ANI-1ccx folders): the ``legacy_model`` fixture links
``$TORCHANI_DATA_DIR/Neurochem/<model>`` there and skips, saying so, a model
whose files are in neither place.
"""
import copy
import os
import warnings
from pathlib import Path

import pytest
import torch
import torchani

pytestmark = pytest.mark.skipif(
    getattr(torchani, "__version__", "") != "2.2.4",
    reason="needs TorchANI 2.2.4 (the legacy API), found {}; .ci/run runs this file in a venv "
           "with torchani==2.2.4".format(getattr(torchani, "__version__", "?")))

import torchani_fast  # noqa: E402
from support import read_molecule  # noqa: E402

INFO = {"ANI1x": "ani-1x_8x", "ANI2x": "ani-2x_8x", "ANI1ccx": "ani-1ccx_8x"}
ELEMENTS = {"ANI1x": "HCNO", "ANI2x": "HCNOSFCl", "ANI1ccx": "HCNO"}
RTOL = 1e-10  # float64, relative, energies; forces are compared to 1e-10 of their scale


def _resources() -> Path:
    return Path(torchani.__file__).resolve().parent / "resources"


def _empty(path: Path) -> bool:
    """Whether ``path`` is missing or only holds the wheel's empty placeholder files."""
    if not path.exists():
        return True
    if path.is_file():
        return path.stat().st_size == 0
    return all(f.stat().st_size == 0 for f in path.rglob("*") if f.is_file())


def _replace_with_link(target: Path, source: Path) -> None:
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.is_dir():
        import shutil

        shutil.rmtree(target)
    target.symlink_to(source, target_is_directory=source.is_dir())


def link_neurochem(name: str) -> bool:
    """Make ``torchani/resources/<name>.info`` usable; whether the model can be built.

    Where the package's file or folder is an empty placeholder and
    ``$TORCHANI_DATA_DIR/Neurochem`` has the real one, the placeholder is
    replaced by a symbolic link to it. Nothing is downloaded.
    """
    res = _resources()
    info = res / f"{name}.info"
    if _empty(info):
        data = os.environ.get("TORCHANI_DATA_DIR")
        source = Path(data) / "Neurochem" if data else None
        if source is None or not (source / f"{name}.info").is_file():
            return False
        _replace_with_link(info, source / f"{name}.info")
        if _empty(res / name) and (source / name).is_dir():
            _replace_with_link(res / name, source / name)
    return not _empty(info) and not _empty(res / name)


_MODELS = {}


def stock(name="ANI2x", dtype=torch.float64, **kwargs):
    """A fresh 2.2.4 model (built once per process, then deep-copied)."""
    key = (name, tuple(sorted(kwargs.items())))
    if key not in _MODELS:
        if not link_neurochem(INFO[name]):
            pytest.skip(f"TorchANI 2.2.4's {name} needs its NeuroChem files: set TORCHANI_DATA_DIR "
                        f"to a folder with Neurochem/{INFO[name]}.info and Neurochem/{INFO[name]}/")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _MODELS[key] = getattr(torchani.models, name)(periodic_table_index=True, **kwargs)
    return copy.deepcopy(_MODELS[key]).to(dtype)


def pair(name="ANI2x", dtype=torch.float64, **kwargs):
    ref = stock(name, dtype, **kwargs)
    return ref, torchani_fast.patch(copy.deepcopy(ref))


def molecule(name, elements):
    """A test molecule's (species (1, N), coords (1, N, 3)) with only ``elements``."""
    atoms = read_molecule(name)
    keep = [i for i, s in enumerate(atoms.get_chemical_symbols()) if s in elements]
    atoms = atoms[keep]
    return (torch.tensor(atoms.numbers).unsqueeze(0),
            torch.tensor(atoms.positions, dtype=torch.float64).unsqueeze(0))


def padded_batch(elements):
    """Two molecules of different sizes, the smaller padded with -1."""
    s1, x1 = molecule("3lka_ligand.xyz", elements)
    s2, x2 = molecule("2iuz_ligand.xyz", elements)
    n = max(s1.shape[1], s2.shape[1])
    species = torch.full((2, n), -1, dtype=torch.long)
    coords = torch.full((2, n, 3), float("nan"), dtype=torch.float64)
    for k, (s, x) in enumerate(((s1, x1), (s2, x2))):
        species[k, :s.shape[1]] = s[0]
        coords[k, :s.shape[1]] = x[0] - x[0].mean(0)
    coords[species < 0] = 0.0  # 2.2.4 needs finite padding coords for its forces
    return species, coords


def energy_forces(model, species, coords, cell=None, pbc=None):
    x = coords.detach().clone().requires_grad_(True)
    if cell is None:
        e = model((species, x)).energies
    else:
        e = model((species, x), cell=cell, pbc=pbc).energies
    (g,) = torch.autograd.grad(e.sum(), x)
    return e.detach(), -g


def assert_close(actual, expected, rtol=RTOL):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    err = float((actual - expected).abs().max()) if expected.numel() else 0.0
    assert err <= rtol * max(scale, 1e-3), f"max |diff| {err} vs scale {scale}"


def triclinic_box(elements):
    """A ligand in a triclinic cell (atoms wrapped into it, as 2.2.4 needs) that it overlaps."""
    species, coords = molecule("3lka_ligand.xyz", elements)
    cell = torch.tensor([[9.0, 0.0, 0.0], [2.0, 8.5, 0.0], [-1.5, 1.5, 8.0]], dtype=torch.float64)
    coords = torchani.utils.map2central(cell, coords - coords.mean(1, keepdim=True),
                                        torch.tensor([True, True, True]))
    return species, coords, cell


@pytest.mark.parametrize("name", ["ANI1x", "ANI2x", "ANI1ccx"])
def test_energies_forces_match_torchani_2_2_4(name):
    ref, fast = pair(name)
    assert torchani_fast.is_patched(fast) and not torchani_fast.is_patched(ref)
    species, coords = molecule("3hkw_ligand.xyz", ELEMENTS[name])
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert e.dtype == torch.float64  # 2.2.4's EnergyShifter
    assert_close(e, e_ref)
    assert_close(f, f_ref)


def test_padded_batch():
    ref, fast = pair("ANI2x")
    species, coords = padded_batch(ELEMENTS["ANI2x"])
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert_close(e, e_ref)
    assert_close(f, f_ref)
    assert float(f[species < 0].abs().max()) == 0.0
    # The padded molecule alone gives the same energy.
    k = int((species < 0).any(1).nonzero()[0, 0])
    n = int((species[k] >= 0).sum())
    alone = fast((species[k:k + 1, :n], coords[k:k + 1, :n])).energies.detach()
    assert_close(alone, e[k:k + 1])
    # Padding may carry NaN coordinates in the patched model.
    nan_coords = coords.clone()
    nan_coords[species < 0] = float("nan")
    assert_close(fast((species, nan_coords)).energies.detach(), e)


@pytest.mark.parametrize("pbc", [[True, True, True], [True, True, False], [False, True, True]])
def test_periodic_triclinic(pbc):
    ref, fast = pair("ANI2x")
    species, coords, cell = triclinic_box(ELEMENTS["ANI2x"])
    pbc = torch.tensor(pbc)
    e_ref, f_ref = energy_forces(ref, species, coords, cell, pbc)
    e, f = energy_forces(fast, species, coords, cell, pbc)
    assert_close(e, e_ref)
    assert_close(f, f_ref)
    # Periodic images matter here: the non-periodic energy differs.
    assert float((fast((species, coords)).energies - e).abs()) > 1e-6


def test_periodic_batch_and_small_cell():
    ref, fast = pair("ANI1x")
    # A cell smaller than the cutoff (5.2 Å): each atom sees several images of the others.
    species = torch.tensor([[8, 1, 1, -1], [6, 1, 1, 1]])
    coords = torch.tensor([[[0.5, 0.5, 0.5], [1.45, 0.6, 0.5], [0.3, 1.4, 0.6], [0.0, 0.0, 0.0]],
                           [[2.0, 2.0, 2.0], [3.0, 2.2, 2.1], [1.6, 3.0, 2.0], [1.8, 1.7, 3.0]]],
                          dtype=torch.float64)
    cell = torch.tensor([[4.2, 0.0, 0.0], [0.4, 4.0, 0.0], [0.3, -0.2, 4.4]], dtype=torch.float64)
    pbc = torch.tensor([True, True, True])
    e_ref, f_ref = energy_forces(ref, species, coords, cell, pbc)
    e, f = energy_forces(fast, species, coords, cell, pbc)
    assert_close(e, e_ref)
    assert_close(f, f_ref)
    # An all-False pbc is not periodic, as in 2.2.4.
    off = torch.tensor([False, False, False])
    assert_close(fast((species, coords), cell=cell, pbc=off).energies.detach(),
                 ref((species, coords), cell=cell, pbc=off).energies.detach())


def test_unwrapped_coordinates_give_the_wrapped_energy():
    # Independent of 2.2.4 (whose image search needs wrapped atoms): moving atoms
    # by lattice vectors changes nothing.
    _, fast = pair("ANI2x")
    species, coords, cell = triclinic_box(ELEMENTS["ANI2x"])
    pbc = torch.tensor([True, True, True])
    shifts = torch.randint(-2, 3, (1, coords.shape[1], 3), generator=torch.Generator().manual_seed(0))
    moved = coords + shifts.to(coords.dtype) @ cell
    assert_close(fast((species, moved), cell=cell, pbc=pbc).energies.detach(),
                 fast((species, coords), cell=cell, pbc=pbc).energies.detach())


def test_every_entry_point():
    ref, fast = pair("ANI2x")
    species, coords = padded_batch(ELEMENTS["ANI2x"])
    inp = (species, coords)
    assert_close(fast.members_energies(inp).energies.detach(), ref.members_energies(inp).energies.detach())
    for average in (True, False):
        assert_close(fast.atomic_energies(inp, average=average).energies.detach(),
                     ref.atomic_energies(inp, average=average).energies.detach())
    q, q_ref = fast.energies_qbcs(inp), ref.energies_qbcs(inp)
    assert_close(q.energies.detach(), q_ref.energies.detach())
    assert_close(q.qbcs.detach(), q_ref.qbcs.detach(), rtol=1e-8)
    assert len(fast) == len(ref) == 8
    assert torch.equal(fast.species_to_tensor(["H", "C", "Cl"]), ref.species_to_tensor(["H", "C", "Cl"]))
    assert isinstance(fast, torchani.models.BuiltinEnsemble)
    assert list(fast.state_dict()) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(fast.state_dict()[k], v), k
    # Element indices (periodic_table_index=False) go through as well.
    idx = ref.species_converter((species, coords)).species
    fast.periodic_table_index = ref.periodic_table_index = False
    assert_close(fast((idx, coords)).energies.detach(), ref((idx, coords)).energies.detach())


@pytest.mark.parametrize("index", [0, 5, -1])
def test_members(index):
    ref, fast = pair("ANI2x")
    species, coords = padded_batch(ELEMENTS["ANI2x"])
    member, member_ref = fast[index], ref[index]
    assert isinstance(member, torchani.models.BuiltinModel) and torchani_fast.is_patched(member)
    e_ref, f_ref = energy_forces(member_ref, species, coords)
    e, f = energy_forces(member, species, coords)
    assert_close(e, e_ref)
    assert_close(f, f_ref)
    assert_close(member.atomic_energies((species, coords)).energies.detach(),
                 member_ref.atomic_energies((species, coords)).energies.detach())


def test_model_index():
    ref, fast = pair("ANI1x", model_index=3)
    species, coords = molecule("2iuz_ligand.xyz", ELEMENTS["ANI1x"])
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert_close(e, e_ref)
    assert_close(f, f_ref)


def test_float32():
    ref, fast = pair("ANI2x", dtype=torch.float32)
    species, coords = padded_batch(ELEMENTS["ANI2x"])
    coords = coords.float()
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert e.dtype == e_ref.dtype
    assert float((e - e_ref).abs().max()) < 1e-4  # Ha, float32 rounding of ~1e3 Ha sums
    assert float((f - f_ref).abs().max()) < 2e-4


def test_torchscript_save_load(tmp_path):
    ref, fast = pair("ANI2x")
    scripted = torch.jit.script(fast)
    path = tmp_path / "legacy.pt"
    torch.jit.save(scripted, str(path))
    loaded = torch.jit.load(str(path))
    species, coords = padded_batch(ELEMENTS["ANI2x"])
    e_ref, f_ref = energy_forces(ref, species, coords)
    for model in (scripted, loaded):
        e, f = energy_forces(model, species, coords)
        assert_close(e, e_ref)
        assert_close(f, f_ref)
        assert_close(model.members_energies((species, coords)).energies.detach(),
                     ref.members_energies((species, coords)).energies.detach())
    species, coords, cell = triclinic_box(ELEMENTS["ANI2x"])
    pbc = torch.tensor([True, True, False])
    assert_close(energy_forces(loaded, species, coords, cell, pbc)[1],
                 energy_forces(ref, species, coords, cell, pbc)[1])


def test_ase_calculator():
    ref, fast = pair("ANI2x")
    atoms = read_molecule("3lka_ligand.xyz")
    atoms.cell = [[9.0, 0.0, 0.0], [2.0, 8.5, 0.0], [-1.5, 1.5, 8.0]]
    atoms.pbc = True
    atoms.positions -= atoms.positions.mean(0)
    results = []
    for model in (ref, fast):
        a = atoms.copy()
        a.calc = model.ase()
        results.append((a.get_potential_energy(), a.get_forces(), a.get_stress()))
    (e_ref, f_ref, s_ref), (e, f, s) = results
    assert abs(e - e_ref) <= RTOL * abs(e_ref)
    assert abs(f - f_ref).max() <= RTOL * abs(f_ref).max()
    assert abs(s - s_ref).max() <= 1e-9 * abs(s_ref).max()


def test_bad_input_is_an_assertion_error_as_in_2_2_4():
    _, fast = pair("ANI1x")
    species, coords = molecule("2iuz_ligand.xyz", ELEMENTS["ANI1x"])
    with pytest.raises(AssertionError, match="coords must have shape"):
        fast((species, coords[:, :-1]))
    with pytest.raises(AssertionError, match="species must have shape"):
        fast((species[0], coords[0]))
    cell = torch.eye(3, dtype=torch.float64) * 20
    with pytest.raises(AssertionError, match="cell and pbc go together"):
        fast((species, coords), cell=cell)
    bad = coords.clone()
    bad[0, 2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"coords must be finite.*molecule 0, atom 2"):
        fast((species, bad))
    with pytest.raises(ValueError, match="Unknown species"):
        fast((torch.full_like(species, 16), coords))  # S: not an ANI-1x element


def test_patch_refuses_what_it_cannot_reproduce():
    with pytest.raises(TypeError, match="TorchANI 2.2.4 model"):
        torchani_fast.patch(torch.nn.Linear(2, 2))
    _, fast = pair("ANI1x")
    assert torchani_fast.patch(fast) is fast  # twice is harmless
    with pytest.raises(TypeError, match="eager"):
        torchani_fast.patch(torch.jit.script(fast))


def test_modern_only_parts_say_so():
    with pytest.raises(AttributeError, match="needs TorchANI 2.7-2.9"):
        torchani_fast.EnergyForcesStep


def test_copies_and_full_model_pickles(tmp_path):
    ref, fast = pair("ANI1x")
    species, coords = molecule("2iuz_ligand.xyz", ELEMENTS["ANI1x"])
    e_ref = ref((species, coords)).energies.detach()
    torch.save(fast, tmp_path / "model.pt")
    for model in (copy.deepcopy(fast), torch.load(tmp_path / "model.pt", weights_only=False)):
        assert type(model) is type(fast) and torchani_fast.is_patched(model)
        assert_close(model((species, coords)).energies.detach(), e_ref)
