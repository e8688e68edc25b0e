"""Reliability around the model call: inconsistent periodic input, bounded work,
objects shared by threads and the helpers' edge inputs (the CLI's outputs and
options are in apps/test_cli_failures.py).

Each case's comment says what goes wrong without the guarantee it tests, and
every test runs under a SIGALRM deadline (``deadline`` fixture), so a hang or a
runaway neighbour search fails instead of blocking the suite.
"""
import threading

import numpy as np
import pytest
import torch
from ase.build import molecule
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchani_fast.models import ANI2x, energies_forces, energies_forces_hessians
from torchani_fast.step import EnergyForcesStep
from support import DEADLINE_S, energy_forces, model_pair

def check_periodic_work(*args):
    from torchani_fast.validation import check_periodic_work as check

    return check(*args)


pytestmark = pytest.mark.usefixtures("deadline")  # (conftest.py: a SIGALRM per test)


@pytest.fixture(scope="module")
def pair():
    """Member 0 of ANI-2x, TorchANI's and patched, float64."""
    ref, fast = model_pair("ANI2x", torch.float64)
    return ref[0], fast[0]


def tensors(atoms, dtype=torch.float64):
    species = torch.tensor(atoms.numbers, dtype=torch.long).unsqueeze(0)
    coords = torch.tensor(atoms.positions, dtype=dtype).unsqueeze(0)
    return species, coords


# -- 1. inconsistent periodic input ------------------------------------------------------
def test_ase_pbc_true_with_default_zero_cell_is_refused(pair):
    # Before: -10 614 eV for water (ASE's complete() turned the zero cell into a 1 Å cube).
    water = molecule("H2O")
    water.pbc = True
    water.calc = pair[1].ase()
    with pytest.raises(ValueError, match=r"pbc is True along axis 0 but the cell's lattice vector 0 is zero"):
        water.get_potential_energy()
    with pytest.raises(ValueError, match="lattice vector"):
        water.get_stress()


@given(pbc=st.lists(st.booleans(), min_size=3, max_size=3).filter(any),
       zero=st.lists(st.booleans(), min_size=3, max_size=3))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_ase_zero_vector_on_a_periodic_axis_is_refused_else_matches_torchani(pair, pbc, zero):
    """Any pbc with any set of zero lattice vectors: refused exactly when a
    periodic axis has a zero vector; otherwise the energy is TorchANI's for the
    completed cell (non-periodic zero vectors completed, as ASE does)."""
    ref, fast = pair
    water = molecule("H2O")
    water.positions += 4.0
    water.cell = np.diag([0.0 if z else 8.0 for z in zero])
    water.pbc = pbc
    water.calc = fast.ase()
    if any(p and z for p, z in zip(pbc, zero)):
        with pytest.raises(ValueError, match=r"pbc is True along axis \d but the cell's lattice vector"):
            water.get_potential_energy()
        return
    species, coords = tensors(water)
    cell = torch.tensor(water.cell.complete().array)
    e_ref, _ = energy_forces(ref, species, coords, cell, torch.tensor(pbc))
    assert water.get_potential_energy() == pytest.approx(float(e_ref[0]) * 27.211386024367243, rel=1e-10)


def test_model_refuses_zero_periodic_vector_eager_and_scripted(pair):
    # Before: "cell is singular" at best; the message now names the axis.
    species, coords = tensors(molecule("H2O"))
    cell = torch.diag(torch.tensor([8.0, 0.0, 8.0], dtype=torch.float64))
    for model in (pair[1], torch.jit.script(pair[1])):
        with pytest.raises(Exception, match="axis 1 but the cell's lattice vector 1 is zero"):
            model((species, coords), cell=cell, pbc=torch.tensor([True, True, True]))


# -- 4. unbounded work: refused before the C++ search, naming the likely units ----------
def benzene_crystal_nm():
    """Four benzenes in an orthorhombic cell close to benzene's crystal, in nm."""
    b = molecule("C6H6")
    cell = np.diag([7.39, 9.42, 6.81])
    frames = [b.positions + offset for offset in ([0, 0, 0], [3.7, 4.7, 0], [0, 4.7, 3.4], [3.7, 0, 3.4])]
    positions = np.concatenate(frames) / 10.0
    numbers = np.tile(b.numbers, 4)
    return numbers, positions, cell / 10.0


@pytest.mark.parametrize("case", ["one atom in a 0.125 Å box", "benzene crystal in nm", "water in bohr"])
def test_absurd_cells_are_refused_quickly_with_a_units_hint(pair, case):
    # Before: minutes of search (0.125 Å box) or std::bad_alloc after growing to 10 GB (nm).
    if case.startswith("one atom"):
        numbers, positions, cell = np.array([1]), np.zeros((1, 3)), np.eye(3) * 0.125
    elif case.startswith("benzene"):
        numbers, positions, cell = benzene_crystal_nm()
    else:  # a 12 Å box of 64 waters scaled by 1/1.889 (positions in bohr read as Å), twice smaller still
        w = molecule("H2O")
        grid = np.array([[i, j, k] for i in range(4) for j in range(4) for k in range(4)]) * 3.0
        positions = (grid[:, None, :] + w.positions[None]).reshape(-1, 3) / 1.889 / 4
        numbers, cell = np.tile(w.numbers, 64), np.eye(3) * 12.0 / 1.889 / 4
    species = torch.tensor(numbers).unsqueeze(0)
    coords = torch.tensor(positions, dtype=torch.float64).unsqueeze(0)
    cell_t, pbc = torch.tensor(cell, dtype=torch.float64), torch.tensor([True, True, True])
    with pytest.raises(ValueError, match=r"cell is too small.*nm or bohr instead of Å"):
        pair[1]((species, coords), cell=cell_t, pbc=pbc)
    with pytest.raises(ValueError, match="nm or bohr"):
        EnergyForcesStep(pair[1], species, coords, cell_t, pbc)
    import ase

    atoms = ase.Atoms(numbers=numbers, positions=positions, cell=cell, pbc=True)
    atoms.calc = pair[1].ase()
    with pytest.raises(ValueError, match="nm or bohr"):
        atoms.get_potential_energy()


@given(scale=st.floats(0.02, 1.5), lengths=st.lists(st.floats(3.0, 9.0), min_size=3, max_size=3),
       pbc=st.lists(st.booleans(), min_size=3, max_size=3).filter(any))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_scaled_cells_are_refused_or_match_torchani(pair, scale, lengths, pbc):
    """A water box scaled by `scale` (a cell in nm is scale 0.1): the model
    either refuses it with the units hint or gives TorchANI's energy, and the
    refusal is exactly the documented rule of check_periodic_work."""
    ref, fast = pair
    w = molecule("H2O")
    positions = np.concatenate([w.positions + [1.5, 1.5, 1.5], w.positions + [1.5, 4.0, 3.0]]) * scale
    species = torch.tensor(np.tile(w.numbers, 2)).unsqueeze(0)
    coords = torch.tensor(positions).unsqueeze(0)
    cell = torch.diag(torch.tensor(lengths, dtype=torch.float64)) * scale
    pbc_t = torch.tensor(pbc)
    try:
        check_periodic_work(species, coords, cell, pbc_t, float(fast.cutoff))
        refused = None
    except ValueError as exc:
        refused = str(exc)
    if refused is not None:
        assert "nm or bohr" in refused
        with pytest.raises(ValueError, match="nm or bohr"):
            fast((species, coords), cell=cell, pbc=pbc_t)
        return
    e, _ = energy_forces(fast, species, coords, cell, pbc_t)
    e_ref, _ = energy_forces(ref, species, coords, cell, pbc_t)
    torch.testing.assert_close(e, e_ref, rtol=1e-9, atol=1e-9)


def test_real_dense_cells_are_accepted(pair):
    """The limits leave real matter alone: diamond's 2-atom primitive cell (the
    densest common solid) and a 1 Å hydrogen chain."""
    a = 3.567
    cell = torch.tensor([[0, a / 2, a / 2], [a / 2, 0, a / 2], [a / 2, a / 2, 0]], dtype=torch.float64)
    coords = torch.tensor([[[0.0, 0, 0], [a / 4, a / 4, a / 4]]], dtype=torch.float64)
    check_periodic_work(torch.tensor([[6, 6]]), coords, cell, torch.tensor([True] * 3), 5.2)
    chain = torch.diag(torch.tensor([1.0, 10.0, 10.0], dtype=torch.float64))
    check_periodic_work(torch.tensor([[1]]), torch.zeros(1, 1, 3, dtype=torch.float64), chain,
                        torch.tensor([True, False, False]), 5.2)


# -- 3. objects shared by threads ------------------------------------------------------
def hammer(work, threads=4):
    errors = []

    def run(k):
        try:
            work(k)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    pool = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=DEADLINE_S)
    assert not any(t.is_alive() for t in pool), "a thread hung"
    return errors


def test_ase_calculator_shared_by_threads_gives_each_molecule_its_energy(pair):
    # Before: another molecule's energy, shape errors or an infinite stress.
    fast = pair[1]
    calc = fast.ase()
    systems = []
    for name in ("CH4", "H2O", "NH3", "C6H6"):
        a = molecule(name)
        a.positions += 3.0
        systems.append(a)
    box = molecule("H2O")
    box.positions += 2.0
    box.cell, box.pbc = np.eye(3) * 6.0, True
    systems.append(box)
    expected = []
    for a in systems:
        b = a.copy()
        b.calc = fast.ase()
        expected.append((b.get_potential_energy(), b.get_forces(),
                         b.get_stress() if b.pbc.any() else None))
    wrong = []

    def work(k):
        rng = np.random.default_rng(k)
        for _ in range(25):
            i = int(rng.integers(len(systems)))
            a = systems[i].copy()
            a.calc = calc
            e, f = a.get_potential_energy(), a.get_forces()
            if abs(e - expected[i][0]) > 1e-8 or not np.allclose(f, expected[i][1], rtol=0, atol=1e-8):
                wrong.append((k, i, e))
            if a.pbc.any() and not np.allclose(a.get_stress(), expected[i][2], rtol=0, atol=1e-10):
                wrong.append((k, i, "stress"))

    errors = hammer(work, threads=5)
    assert not errors, errors[:3]
    assert not wrong, wrong[:5]


def test_step_shared_by_threads_never_returns_an_overflowed_result(pair):
    """One thread's geometry overflows the step's max_pairs (compressed), the
    others fit. Every call must return its own correct result or raise the
    overflow error; the overflowing thread must never get a number."""
    # Before: the pair count is read from the step after the call, so another
    # thread's count could hide the overflow (a truncated energy returned).
    fast = pair[1]
    w = molecule("H2O")
    species = torch.tensor(np.tile(w.numbers, 2)).unsqueeze(0)
    apart = torch.tensor(np.concatenate([w.positions, w.positions + [20.0, 0, 0]])).unsqueeze(0)
    close = torch.tensor(np.concatenate([w.positions, w.positions + [3.0, 0, 0]])).unsqueeze(0)
    step = EnergyForcesStep(fast, species, apart, max_pairs=8)  # apart: 6 pairs; close: 15
    geometries = [apart + 0.02 * k for k in range(3)] + [close]  # the last one overflows
    expected = [energies_forces(fast, species, x) for x in geometries[:3]]
    returned_overflow = []
    wrong = []

    def work(k):
        for _ in range(40):
            if k == 3:
                try:
                    step(geometries[3])
                    returned_overflow.append(k)
                except RuntimeError as exc:
                    assert "do not fit in max_pairs" in str(exc)
            else:
                try:
                    e, f = step(geometries[k])
                except RuntimeError:
                    wrong.append((k, "raised for a geometry that fits"))
                    continue
                if not (torch.allclose(e, expected[k][0], rtol=1e-10, atol=0)
                        and torch.allclose(f, expected[k][1], rtol=0, atol=1e-9)):
                    wrong.append((k, float(e[0])))

    errors = hammer(work)
    assert not errors, errors[:3]
    assert not returned_overflow, f"{len(returned_overflow)} overflowed calls returned a number"
    assert not wrong, wrong[:5]


# -- 6. edge inputs of the helpers ---------------------------------------------------------
@given(mols=st.integers(1, 3), atoms=st.integers(1, 5), real_rows=st.integers(0, 2),
       dtype=st.sampled_from([torch.float32, torch.float64]))
@settings(max_examples=15, deadline=None)
def test_padding_rows_give_zero_energy_forces_and_hessians(mols, atoms, real_rows, dtype):
    # Before: "element 0 of tensors does not require grad" for a batch of padding only.
    fast = _models()[dtype]
    species = torch.full((mols, atoms), -1, dtype=torch.long)
    coords = torch.rand(mols, atoms, 3, dtype=dtype) * 3
    real_rows = min(real_rows, mols - 1)  # at least one row of padding only
    species[:real_rows, 0] = 8
    e, f = energies_forces(fast, species, coords)
    assert e.shape == (mols,) and f.shape == (mols, atoms, 3)
    assert torch.all(e[real_rows:] == 0) and torch.all(f[real_rows:] == 0)
    e2, f2, h = energies_forces_hessians(fast, species, coords)
    assert torch.equal(e2, e) and torch.equal(f2, f)
    assert h.shape == (mols, 3 * atoms, 3 * atoms) and torch.all(h[real_rows:] == 0)
    step = EnergyForcesStep(fast, species, coords)
    e3, f3 = step(coords)
    assert torch.all(e3[real_rows:] == 0) and torch.all(f3[real_rows:] == 0)
    torch.testing.assert_close(e3, e, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=1e-6)


_MODEL_CACHE = {}


def _models():
    if not _MODEL_CACHE:
        for dtype in (torch.float32, torch.float64):
            _MODEL_CACHE[dtype] = ANI2x(model_index=0, dtype=dtype)
    return _MODEL_CACHE


@pytest.mark.parametrize("argument", ["species", "coords", "cell", "pbc"])
@pytest.mark.parametrize("kind", ["list", "numpy"])
def test_non_tensor_inputs_name_the_argument(pair, argument, kind):
    # Before: "'list' object has no attribute 'detach'" (or 'dim').
    species, coords = tensors(molecule("H2O"))
    values = {"species": species, "coords": coords,
              "cell": torch.eye(3, dtype=torch.float64) * 8, "pbc": torch.tensor([True] * 3)}
    value = values[argument].numpy()
    values[argument] = value.tolist() if kind == "list" else value
    message = rf"{argument} must be a torch.Tensor, got .*(list|ndarray).*torch.as_tensor"
    for helper in (energies_forces, energies_forces_hessians):
        with pytest.raises(TypeError, match=message):
            helper(pair[1], values["species"], values["coords"], values["cell"], values["pbc"])
    with pytest.raises(TypeError, match=message):
        EnergyForcesStep(pair[1], values["species"], values["coords"], values["cell"], values["pbc"])
