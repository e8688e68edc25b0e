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
# paths, by kind: the bound the GPU path keeps (see the issue: the target is 0).
# (The networks' grouping read, "copy to host (cpu)", went with ensemble_dense.)
MODEL_API_SYNCS = {"_local_scalar_dense": 2, "neighbor_pairs": 1}


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
