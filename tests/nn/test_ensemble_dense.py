"""The networks op of the device path (ensemble_dense) on CPU tensors: its reference
CPU kernel through the fused module's device path (``_device_paths.on_cpu``)
against the CPU's C++ networks op, its autograd (the forward's jacobian, and
the ATen recomputation under ``create_graph=True``), its fake kernel and the
``TORCHANI_FAST_CUDA_NETWORKS`` switch. Its CUDA kernels: test_ensemble_cuda_emulated.py
(emulator) and tests/test_cuda.py (GPU).
"""
import subprocess
import sys

import pytest
import torch

from torchani_fast import _device_paths, ops
from torchani_fast.nn import fuse_networks
from torchani_fast.nn import fused as fused_module
from torchani_fast.testing import random_model


def networks_and_inputs(name, dtype, elem_rows, **kwargs):
    """(fused networks, AEV computer, elem_idxs (M, A), random coordinates (M, A, 3))."""
    model = random_model(name, **kwargs).to(dtype)
    nnp = model.potentials["nnp"]
    nets = fuse_networks(nnp.neural_networks, nnp.aev_computer)
    elem = torch.tensor(elem_rows)
    coords = torch.rand(elem.shape + (3,), generator=torch.Generator().manual_seed(0), dtype=dtype) * 3.0
    return nets, nnp.aev_computer, elem, coords


def energies_and_forces(nets, aev_computer, elem, coords, path=None):
    """Energies and -dE/dcoords through the networks' CPU op (path None) or the
    device path (``on_cpu``) with ``CUDA_NETWORKS = path``. (The CPU op's AEV
    gradient is 0 in the columns of elements absent from a group, where the AEV's
    derivative is 0: the forces are what both define.)"""
    fused_module.CUDA_NETWORKS = path or "fused"
    try:
        with _device_paths.on_cpu() if path else _no_context():
            x = coords.clone().requires_grad_(True)
            out = nets(elem, aev_computer(elem, x))
            (grad,) = torch.autograd.grad(out.sum(), x)
    finally:
        fused_module.CUDA_NETWORKS = "fused"
    return out.detach(), -grad


class _no_context:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("name", ["ANI2x", "ANI2xr"])
def test_device_path_op_matches_cpu_op(name):
    # ANI-2x's element networks differ in width (H 256-192-160, S 160-128-96, ...):
    # the packs pad them to the widest, which must change no value.
    nets, aev_computer, elem, coords = networks_and_inputs(name, torch.float64,
                                                           [[1, 0, 0, 3, -1], [0, 1, 5, -1, -1]])
    calls = []
    real = ops.ensemble_dense
    ops.ensemble_dense = lambda *a: calls.append(1) or real(*a)
    try:
        got = energies_and_forces(nets, aev_computer, elem, coords, "fused")
    finally:
        ops.ensemble_dense = real
    assert calls, "the device path did not take ensemble_dense"
    want = energies_and_forces(nets, aev_computer, elem, coords)
    aten = energies_and_forces(nets, aev_computer, elem, coords, "aten")
    for g, w, a in zip(got, want, aten):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g, a, rtol=1e-12, atol=1e-12)
    assert got[1].abs().sum() > 0


def test_double_backward_falls_back_to_aten():
    # create_graph=True: the backward recomputes J in ATen ops, so second
    # derivatives (a Hessian-vector product in the coordinates) are the ATen path's.
    nets, aev_computer, elem, coords = networks_and_inputs("ANI2x", torch.float64, [[0, 1, 3]], model_index=0)
    v = torch.randn(coords.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def hvp(path):
        fused_module.CUDA_NETWORKS = path
        try:
            with _device_paths.on_cpu():
                x = coords.clone().requires_grad_(True)
                (g,) = torch.autograd.grad(nets(elem, aev_computer(elem, x)).sum(), x, create_graph=True)
                (h,) = torch.autograd.grad((g * v).sum(), x)
        finally:
            fused_module.CUDA_NETWORKS = "fused"
        return g.detach(), h

    got, want = hvp("fused"), hvp("aten")
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-12)
    assert got[1].abs().sum() > 0


def test_fake_kernel_and_opcheck():
    nets, aev_computer, elem, coords = networks_and_inputs("ANI2x", torch.float64, [[0, 1, 3]], model_index=0)
    with torch.no_grad():
        aevs = aev_computer(elem, coords)
    weights, weights_t, biases = nets._dense_packs(nets._evaluated_members())
    x = aevs[0].clone().requires_grad_(True)
    torch.library.opcheck(torch.ops.torchani_fast.ensemble_dense.default,
                          (x, elem[0], weights, weights_t, biases, 0, True))
    a0, e0 = aevs[0], elem[0]
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        atomic, jac = torch.ops.torchani_fast.ensemble_dense(mode.from_tensor(a0), mode.from_tensor(e0),
                                                             [mode.from_tensor(w) for w in weights],
                                                             [mode.from_tensor(w) for w in weights_t],
                                                             [mode.from_tensor(b) for b in biases], 0, True)
    assert atomic.shape == (3,) and jac.shape == aevs[0].shape


def test_switch_rejects_unknown_values():
    code = "import torchani_fast.nn.fused"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "TORCHANI_FAST_CUDA_NETWORKS": "cublas"})
    assert run.returncode != 0
    assert "TORCHANI_FAST_CUDA_NETWORKS must be 'fused' or 'aten', got 'cublas'" in run.stderr


def test_local_atomic_and_energies_fixed_take_the_op():
    # The other entry points of the device path: ghost atoms (local_atomic) get 0,
    # fixed groups (energies_fixed, the step's) are not needed by the op.
    nets, aev_computer, elem, coords = networks_and_inputs("ANI2x", torch.float64, [[1, 0, 0, 3, 1, 0]])
    with torch.no_grad():
        aevs = aev_computer(elem, coords)
    out = {}
    for path in ("fused", "aten"):
        fused_module.CUDA_NETWORKS = path
        try:
            with _device_paths.on_cpu():
                out[path] = (nets.local_atomic(elem, aevs, 4),
                             nets.energies_fixed(elem, aevs, nets.fixed_groups(elem)))
        finally:
            fused_module.CUDA_NETWORKS = "fused"
    for got, want in zip(out["fused"], out["aten"]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert (out["fused"][0][:, 4:] == 0).all() and (out["fused"][0][:, :4] != 0).all()
