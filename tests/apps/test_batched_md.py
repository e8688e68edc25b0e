"""torchani_fast.batched_md.run: MD of many replicas in one padded batch.

Velocity Verlet must follow ASE's VelocityVerlet on each replica alone (same
start, float64); Langevin must hold the bath's temperature.
"""

import numpy as np
import pytest

import torchani_fast
from torchani_fast import batched_md
from support import read_molecule as _read

pytestmark = pytest.mark.usefixtures("weights")


@pytest.fixture(scope="module")
def model():
    import torchani

    return torchani_fast.patch(torchani.models.ANI2x().double())


def test_velocity_verlet_follows_ase_per_replica(model):
    import ase.units
    from ase.md.verlet import VelocityVerlet

    replicas = [_read("3lka_ligand.xyz"), _read("CH4-5.xyz", 0), _read("CH4-5.xyz", 1)]
    rng = np.random.default_rng(0)
    for a in replicas:  # Maxwell-Boltzmann at 300 K
        m = a.get_masses()[:, None]
        a.set_momenta(rng.normal(size=(len(a), 3)) * np.sqrt(ase.units.kB * 300 * m))
    traj = batched_md.run(model, replicas, steps=20, dt=0.5, interval=5)
    assert [t.positions.shape for t in traj] == [(5, len(a), 3) for a in replicas]
    for a, t in zip(replicas, traj):
        ref = a.copy()
        ref.calc = model.ase()
        np.testing.assert_allclose(t.velocities[0], a.get_velocities() * ase.units.fs, rtol=1e-12)
        dyn = VelocityVerlet(ref, timestep=0.5 * ase.units.fs)
        dyn.run(20)
        np.testing.assert_allclose(t.positions[-1], ref.positions, rtol=0, atol=1e-9)
        np.testing.assert_allclose(t.velocities[-1], ref.get_velocities() * ase.units.fs, rtol=0, atol=1e-9)
        assert t.potential[-1] == pytest.approx(ref.get_potential_energy(), rel=1e-10)
        assert t.kinetic[-1] == pytest.approx(ref.get_kinetic_energy(), rel=1e-8)
        total = t.potential + t.kinetic
        assert np.ptp(total) < 5e-3
        assert list(t.steps) == [0, 5, 10, 15, 20]


def test_langevin_holds_the_temperature(model):
    """64 CH4 replicas at 500 K from rest: the mean kinetic temperature of the
    second half of the run is the bath's (equipartition, 3 degrees per atom)."""
    frames = _read("CH4-5.xyz", ":64")
    traj = batched_md.run(model, frames, steps=300, dt=0.5, temperature=500, friction=0.05, seed=1,
                          velocities=[np.zeros((5, 3))] * 64)
    temps = np.stack([t.temperature for t in traj])
    assert temps[:, 0].max() == 0.0
    assert temps[:, 150:].mean() == pytest.approx(500, rel=0.08)
    assert not np.allclose(traj[0].positions[-1], traj[1].positions[-1])


def test_arguments_are_checked(model):
    atoms = [_read("CH4-5.xyz", 0)]
    with pytest.raises(ValueError, match="needs a temperature"):
        batched_md.run(model, atoms, steps=1, friction=0.01)
    with pytest.raises(ValueError, match="dt must be > 0"):
        batched_md.run(model, atoms, steps=1, dt=0)
    with pytest.raises(ValueError, match="molecules in vacuum"):
        batched_md.run(model, [_read("water-0.8nm.xyz")], steps=1)
    with pytest.raises(ValueError, match="one array per replica"):
        batched_md.run(model, atoms, steps=1, velocities=[])
