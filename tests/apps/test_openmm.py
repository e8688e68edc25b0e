"""OpenMM + openmm-ml: MLPotential("ani2x-fast") and the TorchForce export.

The references are TorchANI 2.9 run here on the same geometry (converted to
kJ/mol and kJ/mol/nm with TorchANI's own factor) and central finite
differences of OpenMM's own energy. Real weights (TORCHANI_DATA_DIR) are needed:
tests skip with the reason when they are absent.
"""
import copy
import math
from importlib.metadata import EntryPoint
from pathlib import Path

import numpy as np
import pytest
import torch
import torchani

openmm = pytest.importorskip("openmm", reason="openmm is not installed (pip install openmm)")
app = pytest.importorskip("openmm.app")
mlpotential = pytest.importorskip("openmmml.mlpotential",
                                  reason="openmm-ml is not installed (pip install openmmml)")
from openmm import unit  # noqa: E402

from torchani_fast.openmm import (  # noqa: E402
    HARTREE_TO_KJ_PER_MOL, ANIComputation, ANITorchForceModule, torch_force_module,
)
from torchani_fast import models  # noqa: E402
from torchani_fast.openmm.force import load_model  # noqa: E402
from torchani_fast.testing import random_molecule, water_box  # noqa: E402

MLPotential = mlpotential.MLPotential
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
ROOT = Path(__file__).resolve().parents[2]
NAMES = {"ani2x-fast": "ANI2x", "ani1x-fast": "ANI1x", "ani1ccx-fast": "ANI1ccx",
         "ani2xr-fast": "ANI2xr", "ani2dr-fast": "ANI2dr"}
KJ_NM = HARTREE_TO_KJ_PER_MOL * 10.0  # Hartree/Å -> kJ/mol/nm


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """OpenMM runs one evaluation at a time; spare threads only contend on this shared host."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _entry_points():
    """torchani_fast's openmm-ml entry points as installed (setup.py makes them from the registry)."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group="openmmml.potentials")
            if ep.value.startswith("torchani_fast.")}


@pytest.fixture(scope="module", autouse=True)
def registered():
    """Our names as pip would register them (an editable install elsewhere may predate them)."""
    for name, value in _entry_points().items():
        if name not in MLPotential._implFactories:
            MLPotential.registerImplFactory(name, EntryPoint(name, value, "openmmml.potentials").load()())


def _weights(name="ani2x-fast", dtype=torch.float64):
    try:
        return load_model(name, None, dtype, torch.device("cpu"))
    except Exception as exc:  # no weights under TORCHANI_DATA_DIR, offline
        pytest.skip(f"{name} weights are not available: {exc}")


_REFERENCES = {}


def _reference(name, dtype=torch.float64, model_index=None):
    """TorchANI's own model (built once per test module: loading weights takes seconds)."""
    _weights(name, dtype)  # skip first if the weights are missing
    key = (name, dtype, model_index)
    if key not in _REFERENCES:
        _REFERENCES[key] = getattr(torchani.models, NAMES[name])(model_index=model_index).to(dtype)
    return _REFERENCES[key]


def _topology(numbers, box_nm=None, per_residue=None):
    top = app.Topology()
    chain = top.addChain()
    res = None
    for i, z in enumerate(numbers):
        if res is None or (per_residue and i % per_residue == 0):
            res = top.addResidue("HOH" if per_residue == 3 else "LIG", chain)
        element = app.Element.getByAtomicNumber(int(z))
        top.addAtom(f"{element.symbol}{i}", element, res)
    if box_nm is not None:
        top.setPeriodicBoxVectors([openmm.Vec3(*row) for row in box_nm])
    return top


def _context(system, positions_nm, box_nm=None, integrator=None):
    integrator = integrator or openmm.VerletIntegrator(0.0005)
    ctx = openmm.Context(system, integrator, openmm.Platform.getPlatformByName("Reference"))
    if box_nm is not None:
        ctx.setPeriodicBoxVectors(*[openmm.Vec3(*row) for row in box_nm])
    ctx.setPositions(positions_nm)
    return ctx


def _energy_forces(ctx, groups=-1):
    st = ctx.getState(getEnergy=True, getForces=True, groups=groups)
    return (st.getPotentialEnergy().value_in_unit(unit.kilojoule_per_mole),
            st.getForces(asNumpy=True).value_in_unit(unit.kilojoule_per_mole / unit.nanometer))


def _torchani(model, numbers, pos_nm, box_nm=None):
    """TorchANI energy (kJ/mol) and forces (kJ/mol/nm) for OpenMM-style inputs."""
    dtype = next(model.parameters()).dtype
    x = torch.tensor(np.asarray(pos_nm) * 10.0, dtype=dtype).unsqueeze(0).requires_grad_(True)
    cell = pbc = None
    if box_nm is not None:
        cell, pbc = torch.tensor(np.asarray(box_nm) * 10.0, dtype=dtype), torch.ones(3, dtype=torch.bool)
    e = model((torch.tensor([list(numbers)]), x), cell=cell, pbc=pbc).energies
    (g,) = torch.autograd.grad(e.sum(), x)
    return float(e.detach()) * HARTREE_TO_KJ_PER_MOL, (-g[0] * KJ_NM).double().numpy()


def _central_difference(ctx, pos_nm, picks, h=1e-5):
    """-dE/dx (kJ/mol/nm) of OpenMM's own energy at the (atom, axis) picks."""
    out = []
    for i, k in picks:
        e = []
        for s in (1, -1):
            p = np.array(pos_nm, dtype=np.float64)
            p[i, k] += s * h
            ctx.setPositions(p)
            e.append(ctx.getState(getEnergy=True).getPotentialEnergy().value_in_unit(unit.kilojoule_per_mole))
        out.append(-(e[0] - e[1]) / (2 * h))
    ctx.setPositions(pos_nm)
    return np.array(out)


def _molecule(name, n=24, seed=3):
    z, x = random_molecule(n, seed=seed)
    if name != "ani2x-fast":
        z = torch.where(z > 8, torch.full_like(z, 6), z)  # H C N O only
    return z[0].tolist(), x[0].numpy() / 10.0


def _triclinic_water(n=20, seed=0):
    """A water box on a skewed (OpenMM reduced-form) cell, atoms left unwrapped: nm."""
    z, x, cell, _ = water_box(n, seed=seed)
    length = float(cell[0, 0])
    box = np.array([[length, 0, 0], [0.3 * length, 0.95 * length, 0],
                    [-0.2 * length, 0.25 * length, 1.05 * length]])
    frac = x[0].numpy() / length  # the cubic box's fractional coordinates, on the skewed cell
    shifts = np.random.default_rng(seed).integers(-2, 3, size=frac.shape)  # unwrapped images
    pos = (frac + shifts) @ box
    return z[0].tolist(), pos / 10.0, box / 10.0


# --------------------------------------------------------------------------- registration
def test_entry_points_name_our_factory_and_leave_openmmml_names_alone():
    from torchani_fast.openmm.mlpotential import ANIFastPotentialImplFactory

    points = _entry_points()
    assert sorted(points) == sorted(NAMES)
    for name, value in points.items():
        factory = EntryPoint(name, value, "openmmml.potentials").load()
        assert factory is ANIFastPotentialImplFactory
        assert isinstance(MLPotential._implFactories[name], ANIFastPotentialImplFactory)
    for stock in ("ani2x", "ani1ccx"):  # still openmm-ml's own
        assert not isinstance(MLPotential._implFactories[stock], ANIFastPotentialImplFactory)


# --------------------------------------------------------------------------- vacuum
@pytest.mark.parametrize("name", sorted(NAMES))
def test_vacuum_energy_and_forces_equal_torchani_and_finite_differences(name):
    numbers, pos = _molecule(name)
    ref = _reference(name)
    system = MLPotential(name).createSystem(_topology(numbers), dtype=torch.float64, device="cpu")
    ctx = _context(system, pos)
    energy, forces = _energy_forces(ctx)
    e_ref, f_ref = _torchani(ref, numbers, pos)
    assert energy == pytest.approx(e_ref, rel=1e-11)
    np.testing.assert_allclose(forces, f_ref, rtol=1e-8, atol=1e-6)
    picks = [(0, 0), (5, 1), (len(numbers) - 1, 2)]
    fd = _central_difference(ctx, pos, picks)
    np.testing.assert_allclose(fd, [forces[i, k] for i, k in picks], rtol=2e-5, atol=2e-2)


@pytest.mark.parametrize("name", ["ani2xr-fast", "ani2dr-fast"])
def test_repulsion_and_dispersion_models_vacuum_and_triclinic_box(name, monkeypatch):
    # Their published weights cannot be downloaded here: TorchANI's architecture with
    # seeded random weights, put where load_model keeps the models it built.
    import warnings

    import torchani_fast
    from torchani_fast.openmm import force as force_module
    from torchani_fast.testing import random_model

    ref = random_model(NAMES[name], seed=0).to(torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing kept as TorchANI's
        fast = torchani_fast.patch(copy.deepcopy(ref))
    monkeypatch.setitem(models._LOADED, models.cache_key(force_module.MODELS[name], dtype=torch.float64), fast)
    for numbers, pos, box in [_molecule(name) + (None,), _triclinic_water()]:
        top = _topology(numbers, box, per_residue=3 if box is not None else None)
        system = MLPotential(name).createSystem(top, dtype=torch.float64, device="cpu")
        ctx = _context(system, pos, box)
        energy, forces = _energy_forces(ctx)
        e_ref, f_ref = _torchani(ref, numbers, pos, box)
        assert energy == pytest.approx(e_ref, rel=1e-11)
        np.testing.assert_allclose(forces, f_ref, rtol=1e-8, atol=1e-6)
        picks = [(0, 0), (4, 2), (len(numbers) - 1, 1)]
        np.testing.assert_allclose(_central_difference(ctx, pos, picks),
                                   [forces[i, k] for i, k in picks], rtol=2e-5, atol=2e-2)
    # The TorchForce export of the same model (scripted, periodic box).
    module = torch_force_module(name, top, dtype=torch.float64)
    energy, forces = _as_torchforce(module, pos, box)
    assert energy == pytest.approx(e_ref, rel=1e-11)
    np.testing.assert_allclose(forces, f_ref, rtol=1e-8, atol=1e-6)


def test_float32_default_model_index_and_force_group():
    name = "ani2x-fast"
    numbers, pos = _molecule(name, n=30, seed=5)
    ref32 = _reference(name, torch.float32)
    top = _topology(numbers)
    ctx = _context(MLPotential(name).createSystem(top, device="cpu"), pos)
    energy, forces = _energy_forces(ctx)
    e_ref, f_ref = _torchani(ref32, numbers, pos)
    assert energy == pytest.approx(e_ref, rel=1e-6)
    np.testing.assert_allclose(forces, f_ref, rtol=1e-3, atol=0.5)

    # One ensemble member, in force group 5 of an otherwise empty system.
    member = _reference(name, model_index=3)
    system = openmm.System()
    for _ in numbers:
        system.addParticle(1.0)
    MLPotential(name)._impl.addForces(top, system, None, 5, modelIndex=3, dtype="float64", device="cpu")
    ctx = _context(system, pos)
    e_member, f_member = _torchani(member, numbers, pos)
    assert _energy_forces(ctx, groups={5})[0] == pytest.approx(e_member, rel=1e-11)
    assert _energy_forces(ctx, groups={0})[0] == 0.0
    np.testing.assert_allclose(_energy_forces(ctx, groups={5})[1], f_member, rtol=1e-8, atol=1e-6)


# --------------------------------------------------------------------------- periodic
def test_triclinic_box_with_barostat_steps_matches_torchani_each_time():
    name = "ani2x-fast"
    numbers, pos, box = _triclinic_water()
    ref = _reference(name)
    top = _topology(numbers, box, per_residue=3)
    compute = ANIComputation(name, numbers, True, dtype=torch.float64, device="cpu")
    system = openmm.System()
    system.setDefaultPeriodicBoxVectors(*[openmm.Vec3(*r) for r in box])
    for atom in top.atoms():
        system.addParticle(atom.element.mass)
    force = openmm.PythonForce(compute)
    force.setUsesPeriodicBoundaryConditions(True)
    system.addForce(force)
    system.addForce(openmm.MonteCarloBarostat(1.0 * unit.bar, 300 * unit.kelvin, 1))
    integrator = openmm.LangevinMiddleIntegrator(300 * unit.kelvin, 1 / unit.picosecond, 0.0005)
    integrator.setRandomNumberSeed(1)
    ctx = _context(system, pos, box, integrator)
    ctx.getPlatform()  # noqa: B018  (a Context of its own)

    energy, forces = _energy_forces(ctx)
    e_ref, f_ref = _torchani(ref, numbers, pos, box)
    assert energy == pytest.approx(e_ref, rel=1e-11)
    np.testing.assert_allclose(forces, f_ref, rtol=1e-8, atol=1e-6)
    picks = [(0, 0), (4, 2), (len(numbers) - 1, 1)]
    np.testing.assert_allclose(_central_difference(ctx, pos, picks), [forces[i, k] for i, k in picks],
                               rtol=2e-5, atol=2e-2)

    volumes = set()
    for _ in range(3):
        integrator.step(2)  # the barostat tries a new box at every step
        st = ctx.getState(getEnergy=True, getForces=True, getPositions=True)
        p = st.getPositions(asNumpy=True).value_in_unit(unit.nanometer)
        b = st.getPeriodicBoxVectors(asNumpy=True).value_in_unit(unit.nanometer)
        volumes.add(round(float(np.linalg.det(b)), 12))
        e_ref, f_ref = _torchani(ref, numbers, p, b)
        energy = st.getPotentialEnergy().value_in_unit(unit.kilojoule_per_mole)
        forces = st.getForces(asNumpy=True).value_in_unit(unit.kilojoule_per_mole / unit.nanometer)
        assert energy == pytest.approx(e_ref, rel=1e-11)
        np.testing.assert_allclose(forces, f_ref, rtol=1e-7, atol=1e-5)
    assert len(volumes) > 1, "the barostat never changed the box: the test would prove nothing"
    assert compute.rebuilds == 1  # box changes moved the cell in place; nothing was rebuilt


def test_neighbour_list_overflow_rebuilds_the_step_instead_of_dropping_pairs():
    name = "ani2x-fast"
    numbers, pos, box = _triclinic_water(n=27, seed=2)
    ref = _reference(name)
    compute = ANIComputation(name, numbers, True, dtype=torch.float64, device="cpu")

    class State:  # what a PythonForce passes, for a box compressed between calls
        def __init__(self, p, b):
            self.p, self.b = p, b

        def getPositions(self, asNumpy):
            return self.p * unit.nanometer

        def getPeriodicBoxVectors(self, asNumpy):
            return self.b * unit.nanometer

    compute(State(pos, box))
    small = 0.8  # 2x the density: about 2x the pairs of the sized list
    e, f = compute(State(pos * small, box * small))
    e_ref, f_ref = _torchani(ref, numbers, pos * small, box * small)
    assert e == pytest.approx(e_ref, rel=1e-11)
    np.testing.assert_allclose(f, f_ref, rtol=1e-8, atol=1e-6)
    assert compute.rebuilds == 2


# --------------------------------------------------------------------------- ML/MM
def _tip3p_box(size_nm=1.4):
    ff = app.ForceField("tip3p.xml")
    modeller = app.Modeller(app.Topology(), [])
    modeller.addSolvent(ff, boxSize=openmm.Vec3(size_nm, size_nm, size_nm) * unit.nanometer)
    system = ff.createSystem(modeller.topology, nonbondedMethod=app.PME, nonbondedCutoff=0.6 * unit.nanometer,
                             constraints=app.HBonds, rigidWater=True)
    return modeller, system


def test_mixed_system_ml_waters_in_tip3p_stay_bonded_for_200_steps():
    name = "ani2x-fast"
    _weights(name, torch.float32)
    modeller, mm_system = _tip3p_box()
    residues = list(modeller.topology.residues())
    ml_atoms = [a.index for r in residues[:3] for a in r.atoms()]
    system = MLPotential(name).createMixedSystem(modeller.topology, mm_system, ml_atoms, forceGroup=1,
                                                 device="cpu")
    integrator = openmm.LangevinMiddleIntegrator(300 * unit.kelvin, 1 / unit.picosecond, 0.0005)
    integrator.setRandomNumberSeed(7)
    cpu = openmm.Platform.getPlatformByName("CPU")  # PME on the Reference platform is slow
    ctx = openmm.Context(system, integrator, cpu, {"Threads": "1"})
    ctx.setPositions(modeller.positions)
    ctx.setVelocitiesToTemperature(300 * unit.kelvin, 7)

    # The ML group is the ANI energy of the three waters alone.
    pos = ctx.getState(getPositions=True).getPositions(asNumpy=True).value_in_unit(unit.nanometer)
    numbers = [a.element.atomic_number for a in modeller.topology.atoms() if a.index in set(ml_atoms)]
    e_ref, _ = _torchani(_reference(name, torch.float32), numbers, pos[ml_atoms])
    assert _energy_forces(ctx, groups={1})[0] == pytest.approx(e_ref, rel=1e-6)

    longest = 0.0
    for _ in range(10):
        integrator.step(20)
        p = ctx.getState(getPositions=True).getPositions(asNumpy=True).value_in_unit(unit.angstrom)
        for o in ml_atoms[::3]:
            longest = max([longest] + [float(np.linalg.norm(p[o + h] - p[o])) for h in (1, 2)])
    assert math.isfinite(longest) and longest < 1.3, f"an ML O-H bond reached {longest:.2f} Å"


def test_interpolated_mixed_system_serializes_the_force():
    # interpolate=True copies the ML force through XmlSerializer (pickle of the function).
    name = "ani2x-fast"
    _weights(name, torch.float64)
    modeller, mm_system = _tip3p_box()
    ml_atoms = [a.index for r in list(modeller.topology.residues())[:2] for a in r.atoms()]
    plain = MLPotential(name).createMixedSystem(modeller.topology, mm_system, ml_atoms, dtype=torch.float64,
                                                device="cpu")
    mixed = MLPotential(name).createMixedSystem(modeller.topology, mm_system, ml_atoms, interpolate=True,
                                                dtype=torch.float64, device="cpu")
    e_plain = _energy_forces(_context(plain, modeller.positions))[0]
    ctx = _context(mixed, modeller.positions)
    ctx.setParameter("lambda_interpolate", 1.0)
    assert _energy_forces(ctx)[0] == pytest.approx(e_plain, rel=1e-9)


# --------------------------------------------------------------------------- openmm-ml's own ANI
@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True:UserWarning")  # openmm-ml's
def test_stock_openmmml_ani2x_forces_are_ten_times_too_small():
    """openmm-ml 1.8 returns -dE/dx in kJ/mol/Å, which OpenMM reads as kJ/mol/nm."""
    _weights("ani2x-fast", torch.float32)
    numbers, pos = _molecule("ani2x-fast", n=12, seed=1)
    ctx = _context(MLPotential("ani2x").createSystem(_topology(numbers)), pos)
    forces = _energy_forces(ctx)[1]
    # The stock model is float32: a step large enough for its energy's rounding.
    picks = [(i, k) for i in range(2) for k in range(3)]
    fd = _central_difference(ctx, pos, picks, h=2e-4)
    ratio = np.array([forces[i, k] for i, k in picks]) / fd
    big = np.abs(fd) > 50.0  # components well above the float32 noise of the difference
    assert big.sum() >= 2
    if np.allclose(ratio[big], 1.0, rtol=0.05):
        pytest.skip("openmm-ml's ANI forces agree with finite differences: the unit bug is fixed")
    np.testing.assert_allclose(ratio[big], 0.1, rtol=0.05)


# --------------------------------------------------------------------------- bad input
def test_bad_inputs_name_the_atom_or_argument():
    _weights("ani1x-fast", torch.float32)
    top = _topology([8, 16, 1])
    with pytest.raises(ValueError, match=r"atom 1 \('S1', residue LIG 1, chain 1\) is S .*covers H, C, N, O"):
        MLPotential("ani1x-fast").createSystem(top, device="cpu")
    bare = app.Topology()
    res = bare.addResidue("UNK", bare.addChain())
    bare.addAtom("C0", app.Element.getBySymbol("C"), res)
    bare.addAtom("X1", None, res)
    with pytest.raises(ValueError, match=r"atom 1 \('X1', residue UNK 1, chain 1\) has no element"):
        MLPotential("ani2x-fast").createSystem(bare, device="cpu")
    good = _topology([8, 1, 1])
    with pytest.raises(ValueError, match="modelIndex must be an ensemble member 0-7 or None, got 8"):
        MLPotential("ani2x-fast").createSystem(good, modelIndex=8, device="cpu")
    with pytest.raises(ValueError, match="dtype must be .* got 'float16'"):
        MLPotential("ani2x-fast").createSystem(good, dtype="float16", device="cpu")
    with pytest.raises(ValueError, match="implementation must be one of"):
        MLPotential("ani2x-fast").createSystem(good, implementation="cuda-graph", device="cpu")
    with pytest.raises(ValueError, match="atom index 7 is outside the topology"):
        MLPotential("ani2x-fast")._impl.addForces(good, openmm.System(), [0, 7], 0, device="cpu")
    ctx = _context(MLPotential("ani2x-fast").createSystem(good, device="cpu"),
                   np.array([[0, 0, 0], [0.1, 0, 0], [np.nan, 0, 0]]))
    with pytest.raises(openmm.OpenMMException, match="ani2x-fast: .*coords must be finite"):
        ctx.getState(getEnergy=True)


def test_state_reader_reads_what_the_public_state_api_gives():
    """The force reads positions through OpenMM's own buffer fill (~0.4 us, not ~11): the
    same numbers as getPositions(asNumpy=True) in nm, for a subset force's State too."""
    from torchani_fast.openmm.force import _StateReader

    def system_with(compute, particles, subset=None, box=None):
        system = openmm.System()
        for _ in range(particles):
            system.addParticle(1.0)
        force = openmm.PythonForce(compute)
        if subset is not None:
            force.setParticles(subset)
        if box is not None:
            system.setDefaultPeriodicBoxVectors(*[openmm.Vec3(*r) for r in box])
            force.setUsesPeriodicBoundaryConditions(True)
        system.addForce(force)
        return system

    reader = _StateReader(4)
    assert reader.fast, "OpenMM 8.x has State._getVectorAsNumpy: the fast path must be taken"
    seen = []

    def compute(state):
        fast = reader.positions(state).copy()
        public = state.getPositions(asNumpy=True).value_in_unit(unit.nanometer)
        box = state.getPeriodicBoxVectors(asNumpy=True).value_in_unit(unit.nanometer)
        seen.append((fast, public, reader.box(state), box))
        return 0.0, np.zeros((4, 3))

    box = np.array([[2.0, 0, 0], [0.3, 2.1, 0], [-0.2, 0.4, 1.9]])
    pos = np.random.default_rng(5).uniform(-3, 3, (7, 3))
    _context(system_with(compute, 7, [6, 0, 3, 2], box), pos, box).getState(getEnergy=True)
    fast, public, box_read, box_public = seen[-1]
    assert fast.shape == (4, 3)
    np.testing.assert_array_equal(fast, public)
    np.testing.assert_array_equal(box_read, box_public)

    reader.fast = False  # the public path, as on an OpenMM without the method
    _context(system_with(compute, 7, [6, 0, 3, 2], box), pos, box).getState(getEnergy=True)
    np.testing.assert_array_equal(seen[-1][0], public)

    wrong = _StateReader(5)
    ctx = _context(system_with(lambda st: (wrong.positions(st), (0.0, np.zeros((4, 3))))[1], 4), pos[:4])
    with pytest.raises(openmm.OpenMMException, match="the State has 4 positions, the force 5 atoms"):
        ctx.getState(getEnergy=True)


# --------------------------------------------------------------------------- TorchForce export
def _as_torchforce(module, pos_nm, box_nm=None, dtype=torch.float64):
    """Call the module the way OpenMM-Torch's TorchForce does: energy, then -d/dpositions."""
    positions = torch.tensor(np.asarray(pos_nm), dtype=dtype).requires_grad_(True)
    args = [positions] if box_nm is None else [positions, torch.tensor(np.asarray(box_nm), dtype=dtype)]
    energy = module(*args)
    assert energy.dim() == 0
    energy.backward()
    return float(energy), (-positions.grad).double().numpy()


def test_torch_force_module_units_and_conventions(tmp_path):
    # One scripted module (scripting takes seconds): periodic, on an ML subset of the particles.
    name = "ani2x-fast"
    ref = _reference(name)
    numbers, pos, box = _triclinic_water(n=16, seed=4)
    full = np.concatenate([np.full((2, 3), 0.3), pos])  # two particles the module must ignore
    top = _topology([1, 1] + numbers, box)
    module = torch_force_module(name, top, atoms=list(range(2, 2 + len(numbers))), dtype=torch.float64)
    assert isinstance(module, torch.jit.ScriptModule) and module.periodic
    path = tmp_path / "ani2x.pt"
    module.save(str(path))  # TorchForce(file) loads it like this
    loaded = torch.jit.load(str(path))
    e_ref, f_ref = _torchani(ref, numbers, pos, box)
    for m in (module, loaded):
        energy, forces = _as_torchforce(m, full, box)
        assert energy == pytest.approx(e_ref, rel=1e-11)
        np.testing.assert_allclose(forces[2:], f_ref, rtol=1e-8, atol=1e-6)
        assert not forces[:2].any()
    # float32 positions (a single-precision platform) reach the float64 model.
    assert _as_torchforce(module, full, box, torch.float32)[0] == pytest.approx(e_ref, rel=1e-5)
    with pytest.raises(Exception, match="pass boxvectors"):
        module(torch.tensor(full))

    # Every particle, in vacuum: the same module class, eager (what torch.jit.script compiles).
    mol_numbers, mol_pos = _molecule(name, n=10, seed=2)
    eager = ANITorchForceModule(_weights(name, torch.float64), mol_numbers)
    energy, forces = _as_torchforce(eager, mol_pos)
    e_ref, f_ref = _torchani(ref, mol_numbers, mol_pos)
    assert energy == pytest.approx(e_ref, rel=1e-11)
    np.testing.assert_allclose(forces, f_ref, rtol=1e-8, atol=1e-6)
    with pytest.raises(ValueError, match="positions must hold the 10 atoms of the model, got 11"):
        eager(torch.zeros(11, 3, dtype=torch.float64))


def test_real_torch_force_in_openmm():
    try:
        import openmmtorch  # noqa: F401  (only whether it imports)
    except Exception as exc:  # no openmm-torch wheel loads with this torch (see docs/openmm.md)
        pytest.skip(f"openmmtorch does not import here: {exc}")
    name = "ani2x-fast"
    numbers, pos = _molecule(name, n=12, seed=6)
    top = _topology(numbers)
    ref = _reference(name)
    system = MLPotential(name).createSystem(copy.deepcopy(top), implementation="torchforce",
                                            dtype=torch.float64, device="cpu")
    ctx = _context(system, pos)
    energy, forces = _energy_forces(ctx)
    e_ref, f_ref = _torchani(ref, numbers, pos)
    assert energy == pytest.approx(e_ref, rel=1e-9)
    np.testing.assert_allclose(forces, f_ref, rtol=1e-6, atol=1e-4)
