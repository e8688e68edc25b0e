"""torchani_fast.batched.optimize: batched BFGS, L-BFGS and FIRE with in-flight batching.

The oracle is ASE: its BFGS, LBFGS and FIRE on each structure alone through
torchani_fast's ASE calculator must take the same number of steps to the same
positions (float64). In a batch, each structure must follow the trajectory it
follows alone, whoever shares its calls, joins or leaves; failures are reported
per structure and leave the others untouched.
"""

import numpy as np
import pytest
import torch

import torchani_fast
from torchani_fast import batched
from support import read_molecule as _read

pytestmark = pytest.mark.usefixtures("weights")


@pytest.fixture(scope="module")
def model():
    import torchani

    return torchani_fast.patch(torchani.models.ANI2x().double())


def _perturbed(atoms, scale, seed):
    out = atoms.copy()
    out.positions += np.random.default_rng(seed).normal(scale=scale, size=out.positions.shape)
    return out


def _mixed():
    """Conformers of a 21-atom ligand, CH4 frames and a 46-atom ligand, interleaved."""
    small = _read("3lka_ligand.xyz")
    ch4 = _read("CH4-5.xyz", ":3")
    lig = _read("2iuz_ligand.xyz")
    return [_perturbed(small, 0.1, 0), ch4[0], _perturbed(lig, 0.05, 1), ch4[1],
            _perturbed(small, 0.15, 2), ch4[2], _perturbed(small, 0.1, 3)]


@pytest.mark.parametrize("name,hessian", [("BFGS", "lindh"), ("BFGS", "ase"), ("LBFGS", None), ("FIRE", None)])
def test_one_structure_follows_ase(model, name, hessian):
    """Step for step ASE's optimiser of the same name (same defaults); BFGS from
    ASE's own starting Hessian, and from Lindh's model Hessian set as ASE's ``H0``."""
    from torchani_fast.apps.structures import ase_optimizer

    atoms = _perturbed(_read("3lka_ligand.xyz"), 0.1, 7)
    optimizer = batched.BFGS(hessian=hessian) if hessian else name
    (mine,) = batched.optimize(model, [atoms], fmax=0.01, optimizer=optimizer)
    ref = atoms.copy()
    ref.calc = model.ase()
    opt = ase_optimizer(name, ref, hessian or "ase", logfile=None)
    assert opt.run(fmax=0.01, steps=1000)
    assert mine.converged and mine.error is None
    assert mine.steps == opt.nsteps
    np.testing.assert_allclose(mine.positions, ref.positions, rtol=0, atol=1e-8)
    assert mine.energy == pytest.approx(ref.get_potential_energy(), rel=1e-12)
    np.testing.assert_allclose(mine.forces, ref.get_forces(), rtol=0, atol=1e-8)
    assert mine.fmax == pytest.approx(np.sqrt((ref.get_forces() ** 2).sum(1).max()), rel=1e-6)
    assert mine.fmax < 0.01


def test_lindh_start_takes_fewer_steps_to_as_low_a_minimum(model):
    """Lindh's model Hessian against ASE's 70 eV/Å² x I on conformers of a
    46-atom ligand: fewer steps in all, and minima as low (1e-5 eV/atom)."""
    confs = [_perturbed(_read("2iuz_ligand.xyz"), 0.1, seed) for seed in (11, 12, 13)]
    lindh = batched.optimize(model, confs, fmax=0.01, optimizer=batched.BFGS(hessian="lindh"))
    plain = batched.optimize(model, confs, fmax=0.01, optimizer=batched.BFGS(hessian="ase"))
    assert all(r.converged for r in lindh + plain)
    assert sum(r.steps for r in lindh) < 0.8 * sum(r.steps for r in plain)
    for a, b, atoms in zip(lindh, plain, confs):
        assert (a.energy - b.energy) / len(atoms) < 1e-5


@pytest.mark.parametrize("name", ["BFGS", "LBFGS", "FIRE"])
def test_in_flight_batch_equals_each_alone(model, name):
    """With room for ~2 molecules per call, molecules join as others leave;
    each result equals the structure relaxed alone, and the small ones leave first."""
    structures = _mixed()
    alone = [batched.optimize(model, [a], fmax=0.05, optimizer=name)[0] for a in structures]
    finished = list(batched.iter_optimize(model, structures, fmax=0.05, optimizer=name, max_atoms=100))
    assert sorted(i for i, _ in finished) == list(range(len(structures)))
    order = [i for i, _ in finished]
    assert set(order[:3]) == {1, 3, 5}  # the CH4 frames converge first
    assert order[-1] == 2  # the 46-atom ligand is admitted last (sizes ascend)
    for i, result in finished:
        ref = alone[i]
        assert result.converged and result.error is None
        assert result.steps == ref.steps, i
        np.testing.assert_allclose(result.positions, ref.positions, rtol=0, atol=1e-9)
        assert result.energy == pytest.approx(ref.energy, rel=1e-12)
        assert result.energy_start == pytest.approx(ref.energy_start, rel=1e-12)
    # Everything in one call gives the same results too.
    together = batched.optimize(model, structures, fmax=0.05, optimizer=name)
    for ref, result in zip(alone, together):
        assert result.steps == ref.steps
        np.testing.assert_allclose(result.positions, ref.positions, rtol=0, atol=1e-9)


def test_step_limit(model):
    structures = _mixed()
    out = batched.optimize(model, structures, fmax=0.01, steps=3)
    for atoms, r in zip(structures, out):
        assert r.steps <= 3 and r.error is None
        assert r.converged == (r.fmax < 0.01)
        assert r.converged or r.steps == 3
        assert r.positions.shape == (len(atoms), 3)
    assert not out[2].converged  # the 46-atom conformer needs ~50 steps


class _PoisonedRows(torch.nn.Module):
    """The model, but NaN energies for 3-atom molecules whose first atom is
    oxygen, once that atom has moved (a structure that fails inside the batch)."""

    def __init__(self, model, start):
        super().__init__()
        self.model = model
        self.start = start

    @property
    def atomic_numbers(self):
        return self.model.atomic_numbers

    def forward(self, species_coords, cell=None, pbc=None):
        species, coords = species_coords
        out = self.model(species_coords, cell=cell, pbc=pbc)
        moved = (coords[:, :1].detach() - self.start).abs().sum((1, 2)) > 0
        poisoned = ((species >= 0).sum(1) == 3) & (species[:, 0] == 8) & moved
        return out._replace(energies=torch.where(poisoned, torch.nan, out.energies))


def test_failures_are_reported_and_the_rest_converge(model):
    water = _read("water-0.8nm.xyz")[:3]
    water.pbc = False
    water.cell = None
    assert water.numbers[0] == 8
    silicon = _read("CH4-5.xyz", 0)
    silicon.numbers[0] = 14
    holed = _read("CH4-5.xyz", 1)
    holed.positions[2, 1] = np.nan
    structures = _mixed()
    good = list(range(len(structures)))
    structures += [water, silicon, holed, _read("CH4-5.xyz", 2), _read("3lka_ligand.xyz")]
    good += [len(structures) - 2, len(structures) - 1]
    start = torch.tensor(water.positions[:1], dtype=torch.float64)
    poisoned = _PoisonedRows(model, start)
    out = batched.optimize(poisoned, structures, fmax=0.05, max_atoms=200)
    alone = batched.optimize(model, [structures[i] for i in good], fmax=0.05)
    for i, ref in zip(good, alone):
        assert out[i].converged and out[i].error is None, (i, out[i].error)
        assert out[i].steps == ref.steps
        np.testing.assert_allclose(out[i].positions, ref.positions, rtol=0, atol=1e-9)
    w, si, nan = out[len(_mixed()):len(_mixed()) + 3]
    assert w.error == "non-finite energy or forces after 1 steps" and not w.converged
    assert w.steps == 1 and np.isfinite(w.positions).all()
    assert si.error == "element Si (atomic number 14) is not supported by the model" and si.steps == 0
    assert nan.error == "non-finite positions" and not nan.converged


def test_exploding_forces_fail(model):
    """fail_fmax: a structure whose forces exceed it fails, at its first evaluation."""
    far = _perturbed(_read("3lka_ligand.xyz"), 0.3, 4)
    near = _read("CH4-5.xyz", 0)
    out = batched.optimize(model, [far, near], fmax=0.01, fail_fmax=5.0)
    assert out[0].fmax > 5.0
    assert out[0].error.startswith("forces exploded after 0 steps") and not out[0].converged
    assert out[1].converged and out[1].error is None


def test_periodic_structure_follows_ase(model):
    """A periodic box (cell fixed) next to a molecule in vacuum: each its own group."""
    import ase.optimize

    box = _perturbed(_read("water-0.8nm.xyz"), 0.05, 5)
    structures = [box, _read("CH4-5.xyz", 0)]
    out = batched.optimize(model, structures, fmax=0.05, optimizer="FIRE", steps=30)
    ref = box.copy()
    ref.calc = model.ase()
    opt = ase.optimize.FIRE(ref, logfile=None)
    opt.run(fmax=0.05, steps=30)
    assert out[0].steps == opt.nsteps
    np.testing.assert_allclose(out[0].positions, ref.positions, rtol=0, atol=1e-8)
    assert out[1].converged


def test_arguments_are_checked(model):
    atoms = [_read("CH4-5.xyz", 0)]
    with pytest.raises(ValueError, match="fmax must be a number > 0"):
        batched.optimize(model, atoms, fmax=0)
    with pytest.raises(ValueError, match="steps must be an int >= 0"):
        batched.optimize(model, atoms, steps=-1)
    with pytest.raises(ValueError, match="max_atoms must be an int >= 1"):
        batched.optimize(model, atoms, max_atoms=0)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        batched.optimize(model, atoms, optimizer="CG")
    with pytest.raises(TypeError, match="optimizer must be a name or a BFGS/LBFGS/FIRE instance"):
        batched.optimize(model, atoms, optimizer=object())
    with pytest.raises(ValueError, match="BFGS: alpha must be > 0"):
        batched.BFGS(alpha=0)
    with pytest.raises(ValueError, match="BFGS: hessian must be 'lindh' or 'ase', got 'unit'"):
        batched.BFGS(hessian="unit")
    with pytest.raises(ValueError, match="BFGS: shift must be > 0, got -1"):
        batched.BFGS(shift=-1)
    with pytest.raises(ValueError, match="LBFGS: memory must be an int >= 1"):
        batched.LBFGS(memory=0)
    with pytest.raises(ValueError, match="FIRE: dt must be > 0"):
        batched.FIRE(dt=-1)
