"""TorchANI's smooth cutoff (``CutoffSmooth``) in every AEV op, against TorchANI.

TorchANI 2.9's newer models (ANI-2xr, ANI-2dr, ANI-r2s and its solvent
variants, SnnANI-2xr) build their AEV with ``CutoffSmooth(order=2, eps=1e-10)``
and, for ANI-r2s, other shift starts and a 5.1 A radial cutoff. Their published
weights cannot be downloaded here, and the AEV does not depend on them: each
factory's own AEV computer is built with ``torchani_fast.testing.random_model``
(the weight fetch replaced) and compared with torchani_fast's, in the same
process. The ops are also checked on their own with other orders and eps
(gradcheck, gradgradcheck, opcheck, finite differences).
"""
import copy
import warnings

import numpy as np
import pytest
import torch
import torchani
from torchani.cutoffs import CutoffBiweight, CutoffCosine, CutoffSmooth

import torchani_fast
from torchani_fast import ops
from torchani_fast.aev import AEVComputer, NeighborList, check_supported
from torchani_fast.testing import random_model

from support import atoms_to_tensors, read_molecule, tiny_consts, tiny_periodic_system

F64 = torch.float64
# The factories whose AEV uses the smooth cutoff (ANIr2s_water, _ch3cn, _chcl3
# build ANIr2s's AEV; ANI2dr ANI2xr's). test_every_factory_is_supported checks
# this list against torchani.models.
SMOOTH = ["ANI2xr", "ANIr2s", "SnnANI2xr"]
FACTORIES = ["ANI1x", "ANI1ccx", "ANI2x", "ANImbis", "ANI2xr", "ANI2dr", "ANIr2s", "ANIr2s_ch3cn",
             "ANIr2s_chcl3", "ANIr2s_water", "SnnANI2xr", "ANI1xnr"]

_MODELS = {}


def _model(name):
    if name not in _MODELS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ("ANIr2s is experimental")
            _MODELS[name] = random_model(name)
    return _MODELS[name]


def torchani_aev(name, dtype=F64):
    """The factory's own torchani.aev.AEVComputer (its networks' random weights are unused)."""
    return copy.deepcopy(_model(name).potentials["nnp"].aev_computer).to(dtype)


def converter(name):
    """Atomic numbers -> the factory's element indices."""
    return torchani.nn.SpeciesConverter(_model(name).symbols)


def aev_pair(name, dtype=F64):
    ref = torchani_aev(name, dtype)
    return ref, AEVComputer.from_torchani(copy.deepcopy(ref))


def tol(dtype):
    return dict(rtol=0, atol=1e-12) if dtype == F64 else dict(rtol=0, atol=2e-5)


def smooth_args(aevc, dtype=F64):
    r, a = aevc.radial, aevc.angular
    consts = [t.to(dtype) for t in (r.eta, r.shifts, a.eta, a.zeta, a.shifts, a.sections)]
    return consts + [float(r.cutoff), float(a.cutoff), aevc.num_species, ops.CUTOFF_SMOOTH,
                     int(r.cutoff_fn.order), float(r.cutoff_fn.eps)]


def both_aevs(ref, fast, elem, coords, cell=None, pbc=None, weights=None):
    """(ours, TorchANI's) AEV and gradient of sum(weights * AEV) w.r.t. coords.

    TorchANI's AEV is computed from our neighbour list (its compute_from_neighbors),
    so that per-axis pbc in triclinic cells, which TorchANI's own list gets wrong
    (test_properties.py), compares the cutoff function alone."""
    out = []
    for aevc in (fast, ref):
        x = coords.detach().clone().requires_grad_(True)
        neighbors = NeighborList()(float(ref.radial.cutoff), elem, x, cell, pbc)
        aev = aevc.compute_from_neighbors(elem, x, neighbors)
        w = weights if weights is not None else torch.sin(torch.arange(aev.numel(), dtype=aev.dtype)).view_as(aev)
        (g,) = torch.autograd.grad((aev * w).sum(), x)
        out.append((aev.detach(), g))
    return out


# --- the factories -----------------------------------------------------------------


@pytest.mark.parametrize("name", FACTORIES)
def test_every_factory_is_supported(name):
    ref = torchani_aev(name)
    check_supported(ref)
    fast = AEVComputer.from_torchani(ref)
    assert fast.radial is ref.radial and fast.angular is ref.angular  # shared, not copied
    fn = ref.radial.cutoff_fn
    if isinstance(fn, CutoffSmooth):
        assert name in SMOOTH or name in ("ANI2dr", "ANIr2s_ch3cn", "ANIr2s_chcl3", "ANIr2s_water")
        assert (fast.cutoff_kind, fast.cutoff_order, fast.cutoff_eps) == (ops.CUTOFF_SMOOTH, fn.order, fn.eps)
        assert fast.zero_block_exact is False
    else:
        assert isinstance(fn, CutoffCosine) and name not in SMOOTH
        assert fast.cutoff_kind == ops.CUTOFF_COSINE and fast.zero_block_exact is True


def test_unsupported_cutoffs_are_refused_by_name():
    ref = torchani_aev("ANI2xr")
    bad = copy.deepcopy(ref)
    bad.radial.cutoff_fn = CutoffBiweight()
    bad.angular.cutoff_fn = CutoffBiweight()
    with pytest.raises(TypeError, match="radial terms use CutoffBiweight"):
        check_supported(bad)
    mixed = copy.deepcopy(ref)
    mixed.angular.cutoff_fn = CutoffCosine()
    with pytest.raises(TypeError, match="same cutoff function for both terms"):
        AEVComputer.from_torchani(mixed)
    for order, eps, match in ((2.5, 1e-10, "order=2.5"), (0, 1e-10, "order=0"), (2, 0.0, "eps=0.0"),
                              (2, 1.5, "eps=1.5")):
        odd = copy.deepcopy(ref)
        odd.radial.cutoff_fn = odd.angular.cutoff_fn = CutoffSmooth(order=2, eps=1e-10)
        odd.radial.cutoff_fn.order = odd.angular.cutoff_fn.order = order
        odd.radial.cutoff_fn.eps = odd.angular.cutoff_fn.eps = eps
        with pytest.raises(TypeError, match=match):
            check_supported(odd)
    # The op names its argument and value.
    species, pairs, diff, consts = tiny_case()
    for kind, order, eps, match in ((2, 2, 1e-10, "cutoff_kind must be 0 .* got 2"),
                                    (1, 0, 1e-10, "cutoff_order .* got 0"),
                                    (1, 2, -1.0, "cutoff_eps .* got -1")):
        with pytest.raises(RuntimeError, match=match):
            ops.aev(species, pairs, diff, *consts[:9], kind, order, eps)


# --- AEV and its gradient against TorchANI ----------------------------------------------


NONPERIODIC = ["2iuz_ligand.xyz", "3hkw_ligand.xyz", "1hvj_ligand.xyz", "small.xyz"]
PERIODIC = ["benzene.xyz", "water-0.8nm.xyz"]


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("model", SMOOTH)
@pytest.mark.parametrize("name", NONPERIODIC + PERIODIC)
def test_aev_and_gradient_match_torchani(model, name, dtype):
    ref, fast = aev_pair(model, dtype)
    species, coords, cell, pbc = atoms_to_tensors(read_molecule(name), dtype)
    elem = converter(model)(species)
    (aev, g), (aev_ref, g_ref) = both_aevs(ref, fast, elem, coords, cell, pbc)
    # also through the model's own forward (its neighbour list)
    torch.testing.assert_close(fast(elem, coords, cell, pbc), aev, rtol=0, atol=0)
    assert aev.dtype == dtype
    if dtype == F64:
        torch.testing.assert_close(aev, aev_ref, **tol(dtype))
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10 * g_ref.abs().max().item())
    else:  # float32: within twice TorchANI's own float32 error (against float64)
        ref64, fast64 = aev_pair(model, F64)
        (aev64, g64), _ = both_aevs(ref64, fast64, elem, coords.double(), cell if cell is None else cell.double(), pbc)
        for got, want, exact in ((aev, aev_ref, aev64), (g, g_ref, g64)):
            err = (got.double() - exact).abs().max().item()
            err_ref = (want.double() - exact).abs().max().item()
            assert err <= 2 * err_ref + 1e-6 * exact.abs().max().item(), (err, err_ref)


def every_element_cluster(n=40, seed=3):
    from torchani_fast.testing import random_molecule

    numbers, coords = random_molecule(n, seed)
    numbers[0, :7] = torch.tensor([1, 6, 7, 8, 16, 9, 17])
    return numbers, coords


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("model", SMOOTH)
def test_padded_batch_periodic_small_triclinic_cell_every_element(model, dtype):
    ref, fast = aev_pair(model, dtype)
    conv = converter(model)
    numbers, coords = every_element_cluster()
    # A padded batch of two molecules (the second shorter, padding on top of atom 0).
    species = torch.full((2, 40), -1, dtype=torch.long)
    x = torch.zeros(2, 40, 3, dtype=F64)
    species[0], x[0] = numbers[0], coords[0]
    species[1, :25], x[1, :25] = numbers[0, 5:30], coords[0, 5:30] * 1.03
    x[1, 25:] = x[1, 0]
    elem = conv(species)
    assert set(elem[0].tolist()) == set(range(7))
    (aev, g), (aev_ref, g_ref) = both_aevs(ref, fast, elem, x.to(dtype))
    assert (aev[1, 25:] == 0).all()
    t = tol(dtype)
    torch.testing.assert_close(aev, aev_ref, **t)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=(1e-10 if dtype == F64 else 2e-4) * g_ref.abs().max().item())
    # A triclinic cell smaller than twice the cutoff (several images of every atom)
    # with every element, full and per-axis pbc.
    cell = torch.tensor([[6.5, 0.0, 0.0], [1.2, 6.0, 0.0], [-0.8, 0.9, 5.8]], dtype=F64)
    frac = torch.rand(1, 14, 3, generator=torch.Generator().manual_seed(2), dtype=F64)
    xs = (frac @ cell).to(dtype)
    sp = conv(torch.tensor([[1, 6, 7, 8, 16, 9, 17, 1, 6, 8, 1, 1, 7, 6]]))
    for pbc in ([True, True, True], [True, False, True], [False, True, False]):
        pbc = torch.tensor(pbc)
        (aev, g), (aev_ref, g_ref) = both_aevs(ref, fast, sp, xs, cell.to(dtype), pbc)
        torch.testing.assert_close(aev, aev_ref, **t)
        torch.testing.assert_close(g, g_ref, rtol=0,
                                   atol=(1e-10 if dtype == F64 else 2e-4) * g_ref.abs().max().item())
    # TorchANI's own neighbour list, full pbc (it handles that one right).
    x = xs.detach().clone()
    torch.testing.assert_close(fast(sp, x, cell.to(dtype), torch.tensor([True] * 3)),
                               ref(sp, x, cell.to(dtype), torch.tensor([True] * 3)), **t)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("model", ["ANI2xr", "ANIr2s"])
@pytest.mark.parametrize("delta", [1e-4, 1e-5, 1e-6, "ulp"])
def test_atoms_at_the_cutoffs(model, delta, dtype):
    # C at the origin; O within delta (A) of the radial cutoff, H within delta of
    # the angular one, N at 1.1 A (so that the C has an (H, N) triple); ulp: one
    # float32 step below. The smooth cutoff is exp(-1/u)-small there; TorchANI's
    # value and slope are the reference, both underflowing to 0 where it does.
    ref, fast = aev_pair(model, dtype)
    rc_r, rc_a = float(ref.radial.cutoff), float(ref.angular.cutoff)
    if delta == "ulp":
        below = lambda rc: float(np.nextafter(np.float32(rc), np.float32(0)))  # noqa: E731
        r_r, r_a = below(rc_r), below(rc_a)
    else:
        r_r, r_a = rc_r - delta, rc_a - delta
    elem = torch.tensor([[1, 3, 0, 2]])
    coords = torch.tensor([[[0.0, 0.0, 0.0], [-r_r, 0.0, 0.0], [r_a, 0.0, 0.0], [0.0, 1.1, 0.0]]], dtype=dtype)
    (aev, g), (aev_ref, g_ref) = both_aevs(ref, fast, elem, coords)
    torch.testing.assert_close(aev, aev_ref, **tol(dtype))
    torch.testing.assert_close(g, g_ref, rtol=1e-10 if dtype == F64 else 1e-4,
                               atol=1e-12 if dtype == F64 else 1e-6)
    # Also at 1e-3 A inside, where the smooth cutoff is not 0 in float64.
    coords2 = coords.clone()
    coords2[0, 1, 0] = -(rc_r - 1e-2)
    (aev, g), (aev_ref, g_ref) = both_aevs(ref, fast, elem, coords2)
    o_block = slice(3 * ref.radial.num_feats, 4 * ref.radial.num_feats)
    if dtype == F64:
        assert aev[0, 0, o_block].max() > 0
        torch.testing.assert_close(aev[0, 0, o_block], aev_ref[0, 0, o_block], rtol=1e-10, atol=0)
    torch.testing.assert_close(g, g_ref, rtol=1e-10 if dtype == F64 else 1e-4,
                               atol=1e-12 if dtype == F64 else 1e-6)


def test_zero_block_rule_does_not_hold_for_the_smooth_cutoff():
    # Why AEVComputer.zero_block_exact is False: in float32 the O's radial block
    # is exactly 0 with the O 0.02 A inside the cutoff (TorchANI's too).
    ref, fast = aev_pair("ANI2xr", torch.float32)
    rc = float(ref.radial.cutoff)
    elem = torch.tensor([[1, 3]])
    coords = torch.tensor([[[0.0, 0.0, 0.0], [rc - 0.02, 0.0, 0.0]]])
    o_block = slice(3 * ref.radial.num_feats, 4 * ref.radial.num_feats)
    assert (fast(elem, coords)[0, 0, o_block] == 0).all()
    assert (ref(elem, coords)[0, 0, o_block] == 0).all()
    assert fast.zero_block_exact is False


# --- second derivatives ------------------------------------------------------------------


@pytest.mark.parametrize("model", ["ANI2xr", "ANIr2s"])
def test_hessian_matches_torchani(model):
    # d2 (sum w * AEV) / dx2 through our double backward (aev_backward's
    # derivatives: aev_jvp, aev_double_backward) against TorchANI's autograd.
    ref, fast = aev_pair(model, F64)
    numbers, coords = every_element_cluster(n=9, seed=5)
    elem = converter(model)(numbers)
    w = torch.sin(torch.arange(9 * fast.out_dim, dtype=F64)).view(1, 9, -1)

    def energy(aevc):
        return lambda x: (aevc(elem, x.view(1, 9, 3)) * w).sum()

    h = torch.autograd.functional.hessian(energy(fast), coords.view(-1))
    h_ref = torch.autograd.functional.hessian(energy(ref), coords.view(-1))
    torch.testing.assert_close(h, h_ref, rtol=0, atol=1e-9 * h_ref.abs().max().item())
    # Force training: d/dx of |forces|^2.
    x = coords.clone().requires_grad_(True)
    out = []
    for aevc in (fast, ref):
        (f,) = torch.autograd.grad(energy(aevc)(x), x, create_graph=True)
        (gf,) = torch.autograd.grad((f ** 2).sum(), x)
        out.append(gf)
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=1e-9 * out[1].abs().max().item())


@pytest.mark.parametrize("model", ["ANI2xr", "ANIr2s"])
def test_local_derivatives_match_torchani(model):
    # aev_local_derivatives (the one-pass Hessian's op): its Jacobian and curvature
    # assembled densely equal TorchANI's autograd Jacobian and Hessian.
    ref, fast = aev_pair(model, F64)
    numbers, coords = every_element_cluster(n=7, seed=6)
    elem = converter(model)(numbers)
    n, F = 7, fast.out_dim
    pairs, _ = ops.neighbor_pairs(elem, coords, None, None, float(ref.radial.cutoff), False)
    flat = coords.view(-1, 3)
    diff = flat[pairs[0]] - flat[pairs[1]]
    args = smooth_args(ref)
    g = torch.randn(1, n, F, generator=torch.Generator().manual_seed(1), dtype=F64)
    local, jac, curv = ops.aev_local_derivatives(g, torch.arange(F), elem, pairs, diff, *args)
    dense_j = torch.zeros(n, n, 3, F, dtype=F64)  # [centre, atom, comp, feature]
    dense_h = torch.zeros(n * 3, n * 3, dtype=F64)
    for i in range(n):
        for a in range(local.shape[1]):
            if local[i, a] < 0:
                continue
            dense_j[i, local[i, a]] += jac[i, a]
            for b in range(local.shape[1]):
                if local[i, b] >= 0:
                    ia, ib = int(local[i, a]), int(local[i, b])
                    dense_h[3 * ia: 3 * ia + 3, 3 * ib: 3 * ib + 3] += curv[i, a, :, b]
    jac_ref = torch.autograd.functional.jacobian(lambda x: ref(elem, x.view(1, n, 3))[0], coords.view(-1))
    torch.testing.assert_close(dense_j.permute(0, 3, 1, 2).reshape(n, F, 3 * n), jac_ref,
                               rtol=0, atol=1e-10 * jac_ref.abs().max().item())
    h_ref = torch.autograd.functional.hessian(lambda x: (ref(elem, x.view(1, n, 3)) * g).sum(), coords.view(-1))
    torch.testing.assert_close(dense_h, h_ref, rtol=0, atol=1e-9 * h_ref.abs().max().item())


# --- the ops on a tiny system: other orders and eps -----------------------------------------


def tiny_case(dtype=F64, order=2, eps=1e-10, seed=0):
    species, pairs, diff = tiny_periodic_system(dtype, seed=seed)
    consts = [c.to(dtype) if torch.is_tensor(c) else c for c in tiny_consts()]
    return species, pairs, diff, consts + [ops.CUTOFF_SMOOTH, order, eps]


def torchani_style(species, pairs, diff, consts):
    """The AEV of the tiny case computed by TorchANI's own terms (ANIRadial,
    ANIAngular with CutoffSmooth) from the same pairs: an independent reference."""
    from torchani.aev._terms import ANIAngular, ANIRadial
    from torchani.aev import AEVComputer as TorchaniAEV
    from torchani.neighbors import Neighbors

    r_eta, r_shf, a_eta, a_zeta, a_shf, a_sec, rc_r, rc_a, S, _, order, eps = consts
    fn = CutoffSmooth(order=order, eps=eps)
    radial = ANIRadial(float(r_eta[0]), r_shf.tolist(), rc_r, fn)
    angular = ANIAngular(float(a_eta[0]), float(a_zeta[0]), a_shf.tolist(), a_sec.tolist(), rc_a, fn)
    # The constants in float64 (the constructors make float32 ones), per-shift etas.
    radial.eta, radial.shifts = r_eta.clone(), r_shf.clone()
    angular.eta, angular.zeta, angular.shifts, angular.sections = (
        a_eta.clone(), a_zeta.clone(), a_shf.clone(), a_sec.clone())
    aevc = TorchaniAEV(radial, angular, num_species=S).to(diff.dtype)
    dist = diff.norm(dim=-1)
    flat = species.view(-1)
    keep = (dist <= rc_r) & (flat[pairs[0]] >= 0) & (flat[pairs[1]] >= 0)  # (as its neighbour lists)
    coords = torch.zeros(*species.shape, 3, dtype=diff.dtype)  # (only the vectors are read)
    return aevc.compute_from_neighbors(species, coords, Neighbors(pairs[:, keep], dist[keep], diff[keep]))


@pytest.mark.parametrize("order,eps", [(2, 1e-10), (3, 1e-10), (1, 1e-10), (4, 0.02)])
def test_tiny_against_torchani_terms_and_gradchecks(order, eps):
    species, pairs, diff, args = tiny_case(order=order, eps=eps)
    d = diff.clone().requires_grad_(True)
    got = ops.aev(species, pairs, d, *args)
    expected = torchani_style(species, pairs, d, args)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-13)
    w = torch.sin(torch.arange(got.numel(), dtype=F64)).view_as(got)
    (g,) = torch.autograd.grad((got * w).sum(), d)
    (g_ref,) = torch.autograd.grad((expected * w).sum(), d)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-11 * g_ref.abs().max().item())
    f = lambda x: ops.aev(species, pairs, x, *args)  # noqa: E731
    assert torch.autograd.gradcheck(f, (d,))
    assert torch.autograd.gradgradcheck(f, (d,))
    # aev_double_backward against the central difference of aev_backward.
    gen = torch.Generator().manual_seed(2)
    t = torch.randn(diff.shape, generator=gen, dtype=F64)
    gr = torch.randn(got.shape, generator=gen, dtype=F64)
    h = 1e-6
    fd = (ops.aev_backward(gr, species, pairs, diff + h * t, *args)
          - ops.aev_backward(gr, species, pairs, diff - h * t, *args)) / (2 * h)
    hv = ops.aev_double_backward(gr, t, species, pairs, diff, *args)
    torch.testing.assert_close(hv, fd, rtol=0, atol=1e-7 * fd.abs().max().item())
    tt = t.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t_, d_: ops.aev_jvp(t_, species, pairs, d_, *args), (tt, d))


def test_opcheck_every_aev_op_with_the_smooth_cutoff():
    tf = torch.ops.torchani_fast
    for dt in (torch.float32, F64):
        species, pairs, diff, args = tiny_case(dt, order=3)
        F = ops.aev(species, pairs, diff, *args).shape[-1]
        grad_aev = torch.randn(*species.shape, F, dtype=dt).requires_grad_(True)
        tangent = torch.randn_like(diff).requires_grad_(True)
        d = diff.clone().requires_grad_(True)
        torch.library.opcheck(tf.aev.default, (species, pairs, d, *args))
        torch.library.opcheck(tf.aev_with_edges.default, (species, pairs, diff, *args))
        _, edges = tf.aev_with_edges(species, pairs, diff, *args)
        torch.library.opcheck(tf.aev_backward_edges.default,
                              (grad_aev.detach(), edges, species, pairs, diff, *args))
        torch.library.opcheck(tf.aev_jvp.default, (tangent, species, pairs, d, *args))
        torch.library.opcheck(tf.aev_double_backward.default,
                              (grad_aev.detach(), tangent, species, pairs, diff, *args))
        torch.library.opcheck(tf.aev_local_derivatives.default,
                              (grad_aev.detach(), torch.arange(1, F, 2), species, pairs, diff, *args))
        if dt == F64:
            torch.library.opcheck(tf.aev_backward.default, (grad_aev, species, pairs, d, *args))


def test_schema_defaults_are_the_cosine_cutoff():
    # Callers (and TorchScript files) from before the cutoff arguments existed
    # call the ops with 12 AEV arguments: the cosine cutoff, as before.
    species, pairs, diff, args = tiny_case()
    cos = args[:9]
    assert torch.equal(ops.aev(species, pairs, diff, *cos),
                       ops.aev(species, pairs, diff, *cos, ops.CUTOFF_COSINE, 5, 0.3))
    assert not torch.equal(ops.aev(species, pairs, diff, *cos), ops.aev(species, pairs, diff, *args))
    schema = str(torch.ops.torchani_fast.aev.default._schema)
    assert "int cutoff_kind=0, int cutoff_order=2, float cutoff_eps=1e-10" in schema


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_vector_and_portable_kernels_agree(dtype):
    # float32 on AVX2/AVX-512 takes the vectorised cutoff (simd::exp, the same
    # operations otherwise); "none" the portable kernels. ANI-2xr: 4 sections.
    ref, fast = aev_pair("ANI2xr", dtype)
    numbers, coords = every_element_cluster(n=40, seed=8)
    elem = converter("ANI2xr")(numbers)
    levels = ["none", "avx2", "avx512"]
    have = torchani_fast.cpu_isa()
    out = {}
    try:
        for level in levels[: levels.index(have) + 1]:
            torchani_fast.cpu_isa(level)
            out[level], _ = both_aevs(ref, fast, elem, coords.to(dtype))
    finally:
        torchani_fast.cpu_isa(have)
    if "avx512" in out:
        assert all(torch.equal(a, b) for a, b in zip(out["avx2"], out["avx512"]))
    for level, (aev, g) in out.items():
        a0, g0 = out["none"]
        torch.testing.assert_close(aev, a0, **tol(dtype))
        torch.testing.assert_close(g, g0, rtol=0, atol=(1e-12 if dtype == F64 else 1e-4) * g0.abs().max().item())


def test_torchscript_save_load(tmp_path):
    ref, fast = aev_pair("ANIr2s", F64)
    numbers, coords = every_element_cluster(n=20, seed=9)
    elem = converter("ANIr2s")(numbers)
    scripted = torch.jit.script(fast)
    path = tmp_path / "aev.pt"
    torch.jit.save(scripted, str(path))
    loaded = torch.jit.load(str(path))
    assert loaded.cutoff_kind == ops.CUTOFF_SMOOTH and loaded.zero_block_exact is False
    x = coords.clone().requires_grad_(True)
    a = loaded(elem, x)
    (g,) = torch.autograd.grad(a.sum(), x)
    torch.testing.assert_close(a, ref(elem, coords), rtol=0, atol=1e-12)
    y = coords.clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(ref(elem, y).sum(), y)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-10)


# --- through a patched model ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("model", ["ANI2xr", "SnnANI2xr"])
def test_patched_model_energies_and_forces(model, dtype):
    # patch() swaps the AEV computer of the smooth-cutoff models too (the rest
    # of the model, here TorchANI's repulsion and networks, is not this test's
    # subject); energies and forces equal TorchANI's.
    from support import energy_forces

    ref = random_model(model, dtype=dtype)
    fast = torchani_fast.patch(copy.deepcopy(ref))
    assert isinstance(fast.potentials["nnp"].aev_computer, AEVComputer)
    for name in ("3hkw_ligand.xyz", "benzene.xyz"):
        species, coords, cell, pbc = atoms_to_tensors(read_molecule(name), dtype)
        e_ref, f_ref = energy_forces(ref, species, coords, cell, pbc)
        e, f = energy_forces(fast, species, coords, cell, pbc)
        if dtype == F64:
            torch.testing.assert_close(e, e_ref, rtol=1e-12, atol=0)
            torch.testing.assert_close(f, f_ref, rtol=0, atol=1e-10)
        else:
            torch.testing.assert_close(e, e_ref, rtol=1e-6, atol=0)
            torch.testing.assert_close(f, f_ref, rtol=0, atol=5e-5)
