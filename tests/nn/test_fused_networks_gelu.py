"""Fused networks with GELU activations and no biases (TorchANI 2.9's ANI-2xr,
ANI-2dr, ANIr2s: ``torchani.arch.simple_ani``) against TorchANI's own modules.

The architectures come from ``torchani_fast.testing.random_model`` (TorchANI's
factories with seeded random weights); every expected value is TorchANI's (or
torch's / the C library's for erf and GELU), computed in this process.
"""
import io
import math

import pytest
import torch
import torchani

import torchani_fast
from torchani_fast.nn import FusedEnsemble, FusedNetworks, fuse_networks, unsupported_reason
from torchani_fast.nn.layout import ACTIVATION_CELU, ACTIVATION_GELU
from torchani_fast.testing import random_model
from support import assert_energies, assert_forces, energy_forces, padded_batch
from support_networks import make_groups, panels_of, reference

ops = torch.ops.torchani_fast
F32_EPS = torch.finfo(torch.float32).eps
ERF_ULPS = 1.5  # the polynomial erf: 1.14 measured (the C library: 0.83)
GELU_ULPS = 8  # float32 GELU against the exact value (6.1 measured, in the left tail near x = -1.9)

# H C N O S F Cl: every element network of the 2x models, padding and an empty row.
BATCH = ["3lka_ligand.xyz", "3hkw_ligand.xyz", "CH3Cl"]


def ulps(actual, expected64):
    """|actual - expected| in float32 ulps of the float32-rounded expected value."""
    e32 = expected64.float()
    spacing = (torch.nextafter(e32.abs(), torch.tensor(math.inf)) - e32.abs()).double()
    spacing = spacing.clamp_min(torch.finfo(torch.float32).smallest_normal)
    return ((actual.double() - expected64).abs() / spacing)


# -- erf and GELU themselves ---------------------------------------------------------


def _grid():
    x = torch.linspace(-12, 12, 600_001, dtype=torch.float64)
    tiny = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-7, -3e-5, 0.999999, 1.0, 1.000001, -1.0])
    return torch.cat([x, tiny.double(), torch.logspace(-8, 1, 2001, dtype=torch.float64)]).float()


def test_erf_polynomial_against_std_erf(isa):
    x = _grid()
    ours = ops.simd_erf(x)
    # math.erf is the C library's erf (std::erf); on a subsample, the rest via torch (float64)
    sub = x[::97]
    ref_sub = torch.tensor([math.erf(v) for v in sub.double().tolist()], dtype=torch.float64)
    assert ulps(ops.simd_erf(sub), ref_sub).max() <= ERF_ULPS
    ref = torch.special.erf(x.double())
    assert ulps(ours, ref).max() <= ERF_ULPS
    assert torch.equal(ops.simd_erf(torch.tensor([math.inf, -math.inf])), torch.tensor([1.0, -1.0]))
    assert ops.simd_erf(torch.tensor([math.nan] * 17)).isnan().all()
    assert torch.equal(ops.simd_erf(torch.tensor([0.0, -0.0])).signbit(), torch.tensor([False, True]))


def _gelu64(x):
    """torch's float64 GELU and its backward (what TorchANI's float64 networks compute)."""
    x = x.double().requires_grad_(True)
    y = torch.nn.functional.gelu(x)
    (d,) = torch.autograd.grad(y.sum(), x)
    return y.detach(), d


def _gelu_oracle(x):
    """GELU and its derivative in float64 through erfc: accurate in the left tail,
    where torch's 0.5 x (1 + erf(x / sqrt 2)) cancels (exactly 0 below x = -8.3
    in float64, while GELU(-8.3) = -4e-16)."""
    x = x.double()
    phi = 0.5 * torch.special.erfc(-x / math.sqrt(2))
    return x * phi, phi + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def test_gelu_oracle_is_torchs_gelu():
    x = _grid().double()
    y, d = _gelu_oracle(x)
    y_t, d_t = _gelu64(x)
    torch.testing.assert_close(y, y_t, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(d, d_t, rtol=1e-15, atol=1e-15)
    assert y_t[x < -8.5].eq(0).all() and y[x < -8.5].lt(0).all()  # where torch's cancels


def test_gelu_float32_against_torch(isa):
    # The kernels' GELU and its derivative (what J multiplies by) at float32
    # inputs against the float64 oracle, and against torch's float32 GELU.
    x = _grid()
    y, d = ops.simd_activation(x, ACTIVATION_GELU)
    y_ref, d_ref = _gelu_oracle(x)
    normal = y_ref.abs() > 1e-30  # (results below are flushed with the denormals)
    assert ulps(y[normal], y_ref[normal]).max() <= GELU_ULPS
    assert (y[~normal].abs() <= 1e-30).all()
    assert (d.double() - d_ref).abs().max() <= 2 * F32_EPS
    # at least as close to the exact values as torch's own float32 GELU
    # (which loses Phi's relative accuracy where 1 + erf cancels, x < 0)
    y_torch = torch.nn.functional.gelu(x)
    u, u_torch = ulps(y[normal], y_ref[normal]), ulps(y_torch[normal], y_ref[normal])
    assert u.max() <= u_torch.max() and u.mean() <= u_torch.mean() + 0.05
    special = torch.tensor([math.inf, -math.inf, math.nan, 0.0, 30.0, -30.0])
    ys, ds = ops.simd_activation(special, ACTIVATION_GELU)
    y_t, d_t = _gelu64(special)  # (torch's inf * 0 = NaN at -inf, and in the derivative at inf)
    torch.testing.assert_close(ys.double(), y_t, rtol=0, atol=1e-30, equal_nan=True)
    torch.testing.assert_close(ds.double(), d_t, rtol=0, atol=1e-30, equal_nan=True)


def test_gelu_float64_and_celu_unchanged():
    x = _grid().double()
    y, d = ops.simd_activation(x, ACTIVATION_GELU)
    y_ref, d_ref = _gelu64(x)
    # (torch's vectorised erf and std::erf differ by an ulp of 1 + erf where it cancels)
    torch.testing.assert_close(y, y_ref, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(d, d_ref, rtol=1e-14, atol=1e-15)
    # CELU(0.1) through the same entry: torch's values and (float32-alpha) backward
    xc = x.requires_grad_(True)
    yc = torch.nn.functional.celu(xc, 0.1)
    (dc,) = torch.autograd.grad(yc.sum(), xc)
    y2, d2 = ops.simd_activation(x.detach(), ACTIVATION_CELU)
    torch.testing.assert_close(y2, yc.detach(), rtol=1e-14, atol=1e-300)
    torch.testing.assert_close(d2, dc, rtol=1e-14, atol=1e-300)
    with pytest.raises(RuntimeError, match="activation = 2"):
        ops.simd_activation(x.detach(), 2)


# -- the op ----------------------------------------------------------------------------


OP_CASES = {
    "ani-like": ([32, 16, 16], [48, 32, 64], [70, 5, 130]),
    "one-atom": ([32, 16, 16], [16], [1]),
    "two-atoms": ([48, 32, 16], [32, 64], [2, 1]),
    "odd-widths": ([20, 12], [40, 17], [9, 33]),  # no panels: BLAS and the elementwise pass
}


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("case", list(OP_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_op_gelu_against_pytorch(dtype, case, bias, isa):
    widths, cols, sizes = OP_CASES[case]
    members = 3
    aev, atoms, sizes, columns, first, packs, layers, mlps = make_groups(
        dtype, members, widths, cols, sizes, activation="gelu", bias=bias)
    ref, jac_ref = reference(aev, atoms, sizes, columns, mlps, "gelu")
    panel_sets = [[]]
    if dtype == torch.float32 and all(w % 16 == 0 for w in widths) and all(c % 16 == 0 for c in cols):
        panel_sets.append(panels_of(first, packs, layers, members))
    for panels in panel_sets:
        values, jac = ops.ensemble_mlp(aev, atoms, sizes, columns, first, packs, panels, layers,
                                       members, True, False, ACTIVATION_GELU)
        if dtype == torch.float64:
            torch.testing.assert_close(values, ref, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(jac, jac_ref, rtol=1e-12, atol=1e-12)
        else:
            torch.testing.assert_close(values, ref, rtol=0, atol=2e-5)
            torch.testing.assert_close(jac, jac_ref, rtol=0, atol=2e-5)
        celu, _ = ops.ensemble_mlp(aev, atoms, sizes, columns, first, packs, panels, layers,
                                   members, True, False, ACTIVATION_CELU)
        assert not torch.allclose(celu, values)  # the argument is read


def test_op_refuses_an_unknown_activation():
    aev, atoms, sizes, columns, first, packs, layers, _ = make_groups(
        torch.float64, 2, [16], [16], [3], activation="gelu", bias=False)
    with pytest.raises(RuntimeError, match="activation = 5 must be 0"):
        ops.ensemble_mlp(aev, atoms, sizes, columns, first, packs, [], layers, 2, True, False, 5)


def test_gradcheck_gradgradcheck_gelu_op():
    aev, atoms, sizes, columns, first, packs, layers, _ = make_groups(
        torch.float64, 2, [8, 5], [12, 7], [4, 3], features=20, activation="gelu", bias=False)
    x = aev.clone().requires_grad_(True)

    def atomic(a):
        return ops.ensemble_atomic(a, atoms, sizes, columns, first, packs, [], layers, 2, False,
                                   ACTIVATION_GELU)

    def energies(a):
        return ops.ensemble_energies(a, atoms, sizes, columns, first, packs, [], layers, 2, 1, 2,
                                     False, ACTIVATION_GELU)

    for fn in (atomic, energies):
        assert torch.autograd.gradcheck(fn, (x,))
        assert torch.autograd.gradgradcheck(fn, (x,))


def test_opcheck_gelu():
    widths, cols, sizes = OP_CASES["ani-like"]
    aev, atoms, sizes, columns, first, packs, layers, _ = make_groups(
        torch.float32, 2, widths, cols, sizes, activation="gelu", bias=False)
    panels = panels_of(first, packs, layers, 2)
    utils = ("test_schema", "test_faketensor")
    for grad in (True, False):
        torch.library.opcheck(ops.ensemble_mlp.default,
                              (aev, atoms, sizes, columns, first, packs, panels, layers, 2, grad, False,
                               ACTIVATION_GELU), test_utils=utils)
    torch.library.opcheck(ops.ensemble_atomic.default,
                          (aev, atoms, sizes, columns, first, packs, panels, layers, 2, False,
                           ACTIVATION_GELU), test_utils=utils)
    torch.library.opcheck(ops.ensemble_energies.default,
                          (aev[:204], atoms[atoms < 204], [int((atoms[:70] < 204).sum()),
                                                           int((atoms[70:75] < 204).sum()),
                                                           int((atoms[75:] < 204).sum())],
                           columns, first, packs, panels, layers, 2, 2, 2, False, ACTIVATION_GELU),
                          test_utils=utils)
    torch.library.opcheck(ops.simd_activation.default, (aev, ACTIVATION_GELU), test_utils=utils)


# -- the modules against TorchANI's networks --------------------------------------------


def networks_and_inputs(name, dtype, **kwargs):
    """(TorchANI's networks, fused networks, elem_idxs, AEVs from TorchANI's AEV computer)."""
    model = random_model(name, **kwargs).to(dtype)
    nnp = model.potentials["nnp"]
    species, coords = padded_batch(BATCH, dtype)
    elem_idxs = model.species_converter(species)
    with torch.no_grad():
        aevs = nnp.aev_computer(elem_idxs, coords)
    return nnp.neural_networks, fuse_networks(nnp.neural_networks, nnp.aev_computer), elem_idxs, aevs


MODELS = [("ANI2xr", {}), ("ANI2dr", {}), ("ANIr2s", {}), ("ANI2xr", {"model_index": 0})]


@pytest.mark.filterwarnings("ignore:ANIr2s is experimental")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name,kwargs", MODELS, ids=["ANI2xr", "ANI2dr", "ANIr2s", "ANI2xr-0"])
def test_fused_gelu_networks_match_torchani(name, kwargs, dtype):
    ref, fused, elem_idxs, aevs = networks_and_inputs(name, dtype, **kwargs)
    assert unsupported_reason(ref) is None
    assert fused.activation == ACTIVATION_GELU
    assert isinstance(fused, FusedNetworks if kwargs else FusedEnsemble)
    assert set(elem_idxs.unique().tolist()) == set(range(-1, 7))  # every element and padding
    lin = ref.members[0].atomics["H"].final_layer if not kwargs else ref.atomics["H"].final_layer
    assert lin.bias is None and isinstance(ref_activation(ref), torch.nn.GELU)
    x_ref = aevs.clone().requires_grad_(True)
    x = aevs.clone().requires_grad_(True)
    e_ref = ref(elem_idxs, x_ref)
    e = fused(elem_idxs, x)
    assert_energies(e, e_ref.detach(), dtype)
    (g_ref,) = torch.autograd.grad(e_ref.sum(), x_ref)
    (g,) = torch.autograd.grad(e.sum(), x)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(g, g_ref, rtol=tol, atol=tol * g_ref.abs().max().item())
    with torch.no_grad():
        a_ref = ref(elem_idxs, aevs, atomic=True)
        a = fused(elem_idxs, aevs, atomic=True)
        torch.testing.assert_close(a, a_ref, rtol=0, atol=1e-10 if dtype == torch.float64 else 1e-5)
        v_ref = ref(elem_idxs, aevs, ensemble_values=True)
        v = fused(elem_idxs, aevs, ensemble_values=True)
        assert v.shape == v_ref.shape
        assert_energies(v, v_ref, dtype)
    # The ATen path (other devices, training) gives the same numbers.
    fused.native_cpu = False
    with torch.no_grad():
        assert_energies(fused(elem_idxs, aevs), e_ref.detach(), dtype)


def ref_activation(ref):
    member = ref.members[0] if hasattr(ref, "members") else ref
    return next(iter(member.atomics.values())).activation


def test_training_gradients_match_torchani():
    # Weights requiring grad take the differentiable packing (zero biases made on
    # the fly): the weight gradients are TorchANI's.
    ref, fused, elem_idxs, aevs = networks_and_inputs("ANI2xr", torch.float64, model_index=0)
    ref.requires_grad_(True)  # (random_model's parameters come frozen)
    e_ref = ref(elem_idxs, aevs).sum()
    grads_ref = torch.autograd.grad(e_ref, list(ref.parameters()))
    grads = torch.autograd.grad(fused(elem_idxs, aevs).sum(), list(ref.parameters()))
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)


def test_create_graph_and_per_member_gradients():
    # Backward passes the op's J does not cover (per-member values, double
    # backward) recompute with GELU's ATen backward. (The whole batch: every
    # element occurs, so that no AEV column is skipped as one of an absent
    # element, whose gradient the fused networks leave 0.)
    ref, fused, elem_idxs, aevs = networks_and_inputs("ANI2xr", torch.float64)
    assert not any(p.requires_grad for p in ref.parameters())  # the C++ op's path
    weights = torch.arange(1, 9, dtype=aevs.dtype).unsqueeze(1)
    for module in (ref, fused):
        x = aevs.clone().requires_grad_(True)
        v = module(elem_idxs, x, ensemble_values=True)
        (g,) = torch.autograd.grad((v * weights).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad((g * g).sum(), x)
        if module is ref:
            g_ref, gg_ref = g.detach(), gg
    torch.testing.assert_close(g.detach(), g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gg, gg_ref, rtol=1e-9, atol=1e-10)


def test_torchscript_save_load_gelu(tmp_path):
    ref, fused, elem_idxs, aevs = networks_and_inputs("ANI2xr", torch.float32)
    scripted = torch.jit.script(fused)
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    with torch.no_grad():
        expected = ref(elem_idxs, aevs)
        for module in (scripted, loaded):
            assert_energies(module(elem_idxs, aevs), expected, torch.float32)
    x = aevs.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loaded(elem_idxs, x).sum(), x)
    x_ref = aevs.clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(ref(elem_idxs, x_ref).sum(), x_ref)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=2e-5 * g_ref.abs().max().item())


def test_unsupported_activations_are_named():
    model = random_model("ANI2xr", model_index=0)
    nets = model.potentials["nnp"].neural_networks
    nets.atomics["H"].activation = torch.nn.GELU(approximate="tanh")
    assert "GELU(approximate='tanh')" in unsupported_reason(nets)
    nets.atomics["H"].activation = torch.nn.SiLU()
    assert "SiLU" in unsupported_reason(nets)
    for a in nets.atomics.values():
        a.activation = torchani.nn.TightCELU()
    assert unsupported_reason(nets) is None  # CELU without biases is fused too
    nets.atomics["C"].activation = torch.nn.GELU()
    assert unsupported_reason(nets) == "element networks use different activations"


# -- end to end: GELU networks behind torchani_fast's AEV (energies, forces, Hessians) --


def _gelu_on_cosine_model(dtype):
    """ANI-2x's architecture (cosine cutoff, patchable today) with ANI-2xr's GELU
    networks (same elements, same AEV length): a TorchANI model either way."""
    model = random_model("ANI2x").to(dtype)
    model.potentials["nnp"].neural_networks = random_model("ANI2xr").potentials["nnp"].neural_networks.to(dtype)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_patched_model_with_gelu_networks(dtype):
    ref = _gelu_on_cosine_model(dtype)
    import copy

    fast = torchani_fast.patch(copy.deepcopy(ref))
    assert isinstance(fast.potentials["nnp"].neural_networks, FusedEnsemble)
    species, coords = padded_batch(BATCH, dtype)
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert_energies(e, e_ref.detach(), dtype)
    assert_forces(f, f_ref, dtype)
    if dtype == torch.float64:
        s1 = species[2:3, :5]  # CH3Cl
        c1, c2 = coords[2:3, :5].clone(), coords[2:3, :5].clone()
        out = torchani_fast.grad.energies_forces_and_hessians(fast, s1, c1)
        ref_out = torchani.grad.energies_forces_and_hessians(ref, s1, c2)
        torch.testing.assert_close(out[2], ref_out[2], rtol=1e-8, atol=1e-9)


# -- ANImbis's charge networks ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_fused_charge_networks_match_torchani(dtype):
    from torchani_fast.nn import FusedChargeNetworks, charge_unsupported_reason, fuse_charge_networks

    model = random_model("ANImbis").to(dtype)
    nnp = model.potentials["nnp"]
    ref = nnp.charge_networks
    assert charge_unsupported_reason(ref) is None
    assert unsupported_reason(ref) is not None  # (two outputs: not energy networks)
    fused = fuse_charge_networks(ref, nnp.aev_computer)
    assert isinstance(fused, FusedChargeNetworks) and fuse_charge_networks(fused) is fused
    assert fused.state_dict().keys() == ref.state_dict().keys()
    species, coords = padded_batch(BATCH, dtype)
    elem_idxs = model.species_converter(species)
    with torch.no_grad():
        aevs = nnp.aev_computer(elem_idxs, coords)
    x_ref, x = aevs.clone().requires_grad_(True), aevs.clone().requires_grad_(True)
    q_ref = ref(elem_idxs, x_ref, atomic=True)
    q = fused(elem_idxs, x, atomic=True)
    assert q.shape == q_ref.shape
    torch.testing.assert_close(q, q_ref.detach(), rtol=0, atol=1e-10 if dtype == torch.float64 else 1e-5)
    w = torch.linspace(-1, 1, q.numel(), dtype=dtype).view_as(q)  # any incoming gradient
    (g_ref,) = torch.autograd.grad((q_ref * w).sum(), x_ref)
    (g,) = torch.autograd.grad((q * w).sum(), x)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(g, g_ref, rtol=tol, atol=tol * g_ref.abs().max().item())
    with torch.no_grad():
        assert_energies(fused(elem_idxs, aevs), ref(elem_idxs, aevs), dtype)
        scripted = torch.jit.script(fused)
        torch.testing.assert_close(scripted(elem_idxs, aevs, atomic=True), q.detach(), rtol=0, atol=0)


def test_charge_networks_refused_by_name():
    from torchani_fast.nn import fuse_charge_networks

    nets = random_model("ANI2xr", model_index=0).potentials["nnp"].neural_networks
    with pytest.raises(TypeError, match="ANINetworks is not TorchANI's _ANINetworksDiscardFirstScalar"):
        fuse_charge_networks(nets)
