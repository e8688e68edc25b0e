"""Host synchronisations of the GPU code paths, counted on the CPU.

``torchani_fast._device_paths.DEVICE_PATHS_ON_CPU`` makes CPU tensors take the
paths written for GPUs (no C++ shortcut that answers with a host value, grouping
through the host, the networks op by op), and :class:`HostReads` counts what
would wait for the device there: reads of a tensor's value into Python
(``_local_scalar_dense``: ``item``, ``int``, ``bool``), ops whose output size
depends on values (``nonzero`` and the like; the exact neighbour list), ops that
answer with a host value, and copies to the host (``cpu``, ``tolist``,
``numpy``). The custom ops' own CUDA kernels are documented not to synchronise
except ``neighbor_pairs`` (docs/cuda.md), which is counted as one.
"""
import contextlib

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torchani_fast
from torchani_fast import _device_paths
from torchani_fast.step import EnergyForcesStep
from torchani_fast.testing import random_model, random_molecule

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

aten = torch.ops.aten
# Ops whose output size depends on the values (on CUDA: the size is read back).
SIZE_FROM_VALUES = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
                    aten.unique_consecutive.default, aten.unique_dim.default,
                    aten.repeat_interleave.Tensor, torch.ops.torchani_fast.neighbor_pairs.default}
READS = {aten._local_scalar_dense.default, aten.equal.default}


class HostReads(TorchDispatchMode):
    """Counts host synchronisations by kind (``self.counts``, ``self.total``)."""

    def __init__(self):
        super().__init__()
        self.counts = {}
        self._host = {}  # id -> tensor, of the tensors in host memory (copied, or made from such)

    def _count(self, name):
        self.counts[name] = self.counts.get(name, 0) + 1

    @property
    def total(self):
        return sum(self.counts.values())

    def _on_host(self, t):
        return id(t) in self._host

    def _mark_host(self, t):
        self._host[id(t)] = t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        if tensors and all(self._on_host(t) for t in tensors):
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._mark_host(t)  # computed on the host from host data: no sync
            return out
        if func in READS or func in SIZE_FROM_VALUES:
            self._count(func._opname)
        elif func.namespace == "torchani_fast" and any(
                not isinstance(r.type, torch.TensorType) for r in func._schema.returns):
            self._count(func._opname)  # an op that answers with a host value
        elif func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self._count("index with a mask")
        return out

    @contextlib.contextmanager
    def copies(self):
        """Also count copies to the host (Tensor.cpu/tolist/numpy), once per tensor."""
        originals = {name: getattr(torch.Tensor, name) for name in ("cpu", "tolist", "numpy")}
        counter = self

        def wrap(name):
            def method(t, *args, **kwargs):
                out = originals[name](t, *args, **kwargs)
                if not counter._on_host(t):
                    counter._count("copy to host (" + name + ")")
                if isinstance(out, torch.Tensor):
                    counter._mark_host(out)
                return out
            return method

        for name in originals:
            setattr(torch.Tensor, name, wrap(name))
        try:
            yield self
        finally:
            for name, m in originals.items():
                setattr(torch.Tensor, name, m)


device_paths = _device_paths.on_cpu  # (CPU tensors down the GPU code paths)


def count(fn, *args):
    mode = HostReads()
    with mode, mode.copies():
        out = fn(*args)
    return mode, out


@pytest.fixture(scope="module")
def system():
    model = torchani_fast.patch(random_model("ANI2x", dtype=torch.float64))
    species, coords = random_molecule(46)
    return model, species, coords


def test_counter_counts():
    """The counter sees each kind of host read once (a counter that cannot count proves nothing)."""
    x = torch.arange(6.0)
    mode, _ = count(lambda: (x.sum().item(), bool((x > 2).any()), x.nonzero(), x[x > 2],
                             x.tolist(), x.cpu().tolist()))
    assert mode.counts == {"_local_scalar_dense": 2, "nonzero": 1, "index with a mask": 1,
                           "copy to host (tolist)": 1, "copy to host (cpu)": 1}


def test_energy_forces_step_has_no_host_sync(system):
    model, species, coords = system
    with device_paths():
        step = EnergyForcesStep(model, species, coords, check_every=0)
        x = coords + 0.01
        mode, (energies, forces) = count(step, x)
        assert mode.counts == {}, mode.counts
        # The step's own check, when asked for: one read of the pair count.
        mode, _ = count(step.check)
        assert mode.counts == {"_local_scalar_dense": 1}
    want = model.energies_forces(species, x)
    torch.testing.assert_close(energies, want.energies, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(forces, want.forces, rtol=1e-12, atol=1e-12)


# Host synchronisations of one model-API call (model.energies_forces) on the device
# paths, by kind: the bound the GPU path keeps. Molecules and periodic systems alike,
# one: every value check (coordinates, species, cell) is a status on the device,
# read back with the exact neighbour list's pair count (NeighborList.checked), the
# read that sizing the list needs anyway; forward then composes the energy without
# compute_from_neighbors' second check. (0 would need the list's length known
# without a read: a fixed capacity, EnergyForcesStep.)
MODEL_API_SYNCS = {"_local_scalar_dense": 1}
PERIODIC_MODEL_API_SYNCS = {"_local_scalar_dense": 1}
def test_model_api_host_syncs(system):
    model, species, coords = system
    with device_paths():
        model.energies_forces(species, coords)  # (packs the weights)
        mode, got = count(model.energies_forces, species, coords)
    print("model API host syncs:", mode.counts)
    want = model.energies_forces(species, coords)
    torch.testing.assert_close(got.energies, want.energies, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.forces, want.forces, rtol=1e-12, atol=1e-12)
    assert mode.counts == MODEL_API_SYNCS


def test_periodic_model_api_host_syncs(system):
    """The cell's checks cost one read on the device path (each check was a read before)."""
    model, species, coords = system
    cell, pbc = torch.eye(3, dtype=torch.float64) * 20.0, torch.ones(3, dtype=torch.bool)
    with device_paths():
        model.energies_forces(species, coords, cell, pbc)
        mode, got = count(model.energies_forces, species, coords, cell, pbc)
    print("periodic model API host syncs:", mode.counts)
    want = model.energies_forces(species, coords, cell, pbc)
    torch.testing.assert_close(got.energies, want.energies, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.forces, want.forces, rtol=1e-12, atol=1e-12)
    assert mode.counts == PERIODIC_MODEL_API_SYNCS


def test_forward_and_atomic_energies_read_the_device_once(system):
    """TorchANI's entry points (forward, atomic_energies) share the model API's one read."""
    model, species, coords = system
    with device_paths():
        mode, got = count(model, (species, coords))
        assert mode.counts == MODEL_API_SYNCS, mode.counts
        mode, atomic = count(model.atomic_energies, (species, coords))
        assert mode.counts == MODEL_API_SYNCS, mode.counts
    torch.testing.assert_close(got.energies, model((species, coords)).energies, rtol=1e-12, atol=0)
    torch.testing.assert_close(atomic.energies, model.atomic_energies((species, coords)).energies,
                               rtol=1e-12, atol=1e-12)


def test_overflowing_capacity_searches_again_without_a_second_read():
    """A list whose capacity is too small is searched again into its exact size, known
    from the one read (no second read), and the capacity grows for the next call."""
    from torchani_fast.testing import water_box

    model = torchani_fast.patch(random_model("ANI2x", dtype=torch.float64))
    numbers, coords, cell, pbc = water_box(20)
    want = model.energies_forces(numbers, coords, cell, pbc)
    nl = model.neighborlist
    nl.pairs_per_atom = 2  # (a water box has ~30 half pairs per atom within 5.2 Å)
    with device_paths():
        mode, got = count(model.energies_forces, numbers, coords, cell, pbc)
        assert mode.counts == PERIODIC_MODEL_API_SYNCS, mode.counts
        pairs = model.neighborlist(model.cutoff, model.species_converter(numbers), coords, cell, pbc).indices.shape[1]
    torch.testing.assert_close(got.energies, want.energies, rtol=1e-12, atol=0)
    torch.testing.assert_close(got.forces, want.forces, rtol=1e-12, atol=1e-12)
    assert nl.pairs_per_atom * numbers.numel() >= pairs > 2 * numbers.numel()


def test_batch_with_padding_reads_the_device_once(system):
    """A batch of molecules with padding rows and atoms: one read, the CPU path's results."""
    model, species, coords = system
    batch_species = torch.cat([species, species]).clone()
    batch_species[1, 30:] = -1
    batch_coords = torch.cat([coords, coords + 0.05])
    batch_coords[1, 40] = float("nan")  # (padding may carry any coordinates)
    with device_paths():
        mode, got = count(model.energies_forces, batch_species, batch_coords)
    assert mode.counts == MODEL_API_SYNCS, mode.counts
    want = model.energies_forces(batch_species, batch_coords)
    torch.testing.assert_close(got.energies, want.energies, rtol=1e-12, atol=0)
    torch.testing.assert_close(got.forces, want.forces, rtol=1e-12, atol=1e-12)


# The one read a host program makes anyway: the results, copied to the host.
RESULTS_READ = {"copy to host (cpu)": 1}


def test_ase_get_forces_reads_the_device_once(system):
    """A molecule's get_forces: the results come back in one copy, with the
    neighbour list's pair count inside it (nothing else is read)."""
    from torchani_fast.apps.ase import Calculator
    from support import read_molecule

    model = system[0]
    atoms = read_molecule("3lka_ligand.xyz")
    with device_paths():
        atoms.calc = Calculator(model)
        atoms.get_forces()
        for _ in range(2):
            atoms.positions[0, 0] += 1e-3
            mode, forces = count(atoms.get_forces)
            assert mode.counts == RESULTS_READ, mode.counts
    assert atoms.calc._steps.events == [("capture", "first use")]
    want = Calculator(model)
    np.testing.assert_allclose(forces, want.get_forces(atoms), rtol=0, atol=1e-10)


def test_openmm_call_reads_the_device_once(system):
    """An OpenMM force evaluation (vacuum and periodic): one copy of the results."""
    openmm = pytest.importorskip("openmm", reason="openmm is not installed")
    from torchani_fast.openmm import ANIComputation
    from torchani_fast.testing import water_box

    numbers, coords, cell, _ = water_box(8)
    for periodic in (False, True):
        with device_paths():
            try:
                compute = ANIComputation("ani2x-fast", numbers[0].tolist(), periodic, dtype=torch.float64)
            except Exception as exc:  # no weights under TORCHANI_DATA_DIR
                pytest.skip(f"ani2x-fast weights are not available: {exc}")
            system_ = openmm.System()
            system_.setDefaultPeriodicBoxVectors(*[openmm.Vec3(*r) for r in cell.numpy() / 10])
            for z in numbers[0].tolist():
                system_.addParticle(16.0 if z == 8 else 1.0)
            ctx = openmm.Context(system_, openmm.VerletIntegrator(0.0005),
                                 openmm.Platform.getPlatformByName("Reference"))
            ctx.setPositions(coords[0].numpy() / 10.0)
            state = ctx.getState(getPositions=True)
            compute(state)
            mode, (energy, forces) = count(compute, state)
        assert mode.counts == RESULTS_READ, (periodic, mode.counts)
        want = ANIComputation("ani2x-fast", numbers[0].tolist(), periodic, dtype=torch.float64)(state)
        assert energy == pytest.approx(want[0], rel=1e-12)
        np.testing.assert_allclose(forces, want[1], rtol=0, atol=1e-8)
