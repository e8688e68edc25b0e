"""The CUDA networks op (ensemble_dense, csrc/ensemble/ensemble_cuda.cu) run in the
CPU emulator, against the CPU's C++ networks op and the ATen path, in the same process.

The fused module is called down its device path (``_device_paths.on_cpu``) with
torchani_fast's ops sent to their emulated kernels (``support_cuda.Emulated``);
the expected values come from the same module on the CPU's own path (the C++
ops) or with ``fused.CUDA_NETWORKS = "aten"`` (the groups op by op).
Tolerances: float64 1e-12 relative (1e-12 absolute for forces near 0),
float32 1e-5. Needs the emulator build: TORCHANI_FAST_EMULATE_CUDA=1 (minutes).
Inputs are a few atoms: the emulator runs one OS thread per CUDA thread.
"""
import os

import pytest
import torch

from torchani_fast import _device_paths, ops
from torchani_fast.nn import fuse_networks
from torchani_fast.nn import fused as fused_module
from torchani_fast.testing import random_model
from support_cuda import Emulated, load_emulator

pytestmark = pytest.mark.skipif(os.environ.get("TORCHANI_FAST_EMULATE_CUDA") != "1",
                                reason="set TORCHANI_FAST_EMULATE_CUDA=1 to run the CUDA kernels in the CPU emulator")

TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}
# ANI-2x (CELU, biases) and ANI-2xr (GELU, no biases); "-0": one member (no member split).
MODELS = [("ANI2x", {}), ("ANI2xr", {}), ("ANI2x", {"model_index": 0})]
IDS = ["ANI2x", "ANI2xr", "ANI2x-0"]


@pytest.fixture(scope="module")
def emu():
    return load_emulator()


_NETS = {}


def networks(name, kwargs, dtype):
    key = (name, tuple(sorted(kwargs.items())), dtype)
    if key not in _NETS:
        model = random_model(name, **kwargs).to(dtype)
        nnp = model.potentials["nnp"]
        _NETS[key] = (fuse_networks(nnp.neural_networks, nnp.aev_computer), nnp.aev_computer)
    return _NETS[key]


def inputs(dtype, elem_rows, seed=0):
    """elem_idxs (M, A) as given (-1: padding) and random coordinates."""
    elem = torch.tensor(elem_rows)
    coords = torch.rand(elem.shape + (3,), generator=torch.Generator().manual_seed(seed), dtype=dtype) * 3.0
    return elem, coords


# Two molecules of H, C, O (N, S, F, Cl absent) with padding; a single atom.
BATCH = [[1, 0, 0, 3, -1], [0, 1, 3, -1, -1]]
SINGLE = [[1]]


def energies_and_forces(nets, aev_computer, elem, coords, atomic=False):
    """Energies and forces (-dE/dcoords): the CPU op's AEV gradient is 0 in the columns
    of elements absent from a group, where the AEV's derivative is 0."""
    x = coords.clone().requires_grad_(True)
    out = nets(elem, aev_computer(elem, x), atomic=atomic)
    (grad,) = torch.autograd.grad(out.sum(), x)
    return out.detach(), -grad


def emulated(emu, *args, **kwargs):
    with _device_paths.on_cpu(), Emulated(emu):
        return energies_and_forces(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name,kwargs", MODELS, ids=IDS)
@pytest.mark.parametrize("rows", [BATCH, SINGLE], ids=["batch", "single"])
def test_matches_cpu_op_and_aten(emu, name, kwargs, dtype, rows):
    nets, aev_computer = networks(name, kwargs, dtype)
    elem, coords = inputs(dtype, rows)
    start = emu.launch_count()
    got = emulated(emu, nets, aev_computer, elem, coords)
    # group + networks, + the members' sum when they are split over blocks (the
    # emulator's build splits below 2 tiles of TA atoms: 8 in float32, 4 in float64)
    tiles = -(-elem.numel() // (8 if dtype == torch.float32 else 4))
    assert emu.launch_count() - start == 2 + (nets.is_ensemble and tiles < 2)
    want = energies_and_forces(nets, aev_computer, elem, coords)  # the CPU's C++ op
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL[dtype])
    fused_module.CUDA_NETWORKS = "aten"
    try:
        with _device_paths.on_cpu():
            aten = energies_and_forces(nets, aev_computer, elem, coords)
    finally:
        fused_module.CUDA_NETWORKS = "fused"
    for g, w in zip(got, aten):
        torch.testing.assert_close(g, w, **TOL[dtype])
    assert len(rows[0]) == 1 or got[1].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name,kwargs", MODELS[:2], ids=IDS[:2])
def test_op_matches_reference(emu, name, kwargs, dtype):
    # The op's own outputs, J on every column, against its ATen reference;
    # padding (0) and an element the model lacks (NaN, no synchronisation to raise).
    nets, aev_computer = networks(name, kwargs, dtype)
    elem, coords = inputs(dtype, [[1, 0, 0, 3, 2, 0, 0, 1, 0, 0, -1]], seed=4)
    with torch.no_grad():
        aev = aev_computer(elem, coords)[0]
    flat = elem[0].clone()
    flat[2] = 7
    weights, weights_t, biases = nets._dense_packs(nets._evaluated_members())
    got = emu.ensemble_dense(aev, flat, weights, weights_t, biases, nets.activation, True)
    want = ops._dense_reference(aev, flat, weights, biases, nets.activation, True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True, **TOL[dtype])
    assert got[0][2].isnan() and got[1][2].isnan().all() and got[0][-1] == 0 and (got[1][-1] == 0).all()
    keep = torch.arange(len(flat)) != 2
    assert got[0][keep].isfinite().all() and got[1][keep].isfinite().all()
    atomic, jac = emu.ensemble_dense(aev, flat, weights, weights_t, biases, nets.activation, False)
    assert torch.allclose(atomic, got[0], rtol=0, atol=0, equal_nan=True)  # (bitwise, NaN too)
    assert jac.shape == (0, aev.shape[1])


def test_atomic_values_and_padding(emu):
    nets, aev_computer = networks("ANI2xr", {}, torch.float64)
    elem, coords = inputs(torch.float64, BATCH, seed=1)
    got, forces = emulated(emu, nets, aev_computer, elem, coords, atomic=True)
    want, want_forces = energies_and_forces(nets, aev_computer, elem, coords, atomic=True)
    torch.testing.assert_close(got, want, **TOL[torch.float64])
    torch.testing.assert_close(forces, want_forces, **TOL[torch.float64])
    assert (got[elem == -1] == 0).all() and (forces[elem == -1] == 0).all()


def test_bitwise_repeatable(emu):
    nets, aev_computer = networks("ANI2x", {}, torch.float32)
    elem, coords = inputs(torch.float32, BATCH, seed=2)
    first = emulated(emu, nets, aev_computer, elem, coords)
    second = emulated(emu, nets, aev_computer, elem, coords)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_op_argument_errors(emu):
    nets, aev_computer = networks("ANI2x", {"model_index": 0}, torch.float64)
    weights, weights_t, biases = nets._dense_packs(nets._evaluated_members())
    aev = torch.zeros(2, weights[0].shape[2], dtype=torch.float64)
    elem = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match=r"weights_t\[1\] must be"):
        emu.ensemble_dense(aev, elem, weights, [weights_t[0], weights_t[2], weights_t[2], weights_t[3]],
                           biases, 0, True)
    with pytest.raises(RuntimeError, match="activation must be 0 .* got 5"):
        emu.ensemble_dense(aev, elem, weights, weights_t, biases, 5, True)
    with pytest.raises(RuntimeError, match="weights of layer 0 must have aev's dtype"):
        emu.ensemble_dense(aev.float(), elem, weights, weights_t, biases, 0, True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_member_split_gives_the_same_bits(emu, dtype):
    # One atom alone (a block per member, then the members' sum) and the same atom
    # among padding (one block adds the members): the same sums in the same order.
    nets, aev_computer = networks("ANI2xr", {}, dtype)
    weights, weights_t, biases = nets._dense_packs(nets._evaluated_members())
    aev = torch.rand(9, weights[0].shape[2], generator=torch.Generator().manual_seed(5), dtype=dtype)
    elem = torch.tensor([2] + [-1] * 8)
    alone = emu.ensemble_dense(aev[:1], elem[:1], weights, weights_t, biases, nets.activation, True)
    padded = emu.ensemble_dense(aev, elem, weights, weights_t, biases, nets.activation, True)
    assert torch.equal(alone[0], padded[0][:1]) and torch.equal(alone[1], padded[1][:1])
    assert (padded[0][1:] == 0).all() and (padded[1][1:] == 0).all()
