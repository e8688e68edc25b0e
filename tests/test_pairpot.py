"""The pair-potential ops (csrc/pairpot): xTB repulsion and D3(BJ) dispersion.

``FastRepulsionXTB`` and ``FastDispersionD3`` run ``ops.repulsion_xtb`` and
``ops.dispersion_d3`` on the CPU. They are compared with TorchANI's own
``RepulsionXTB``/``TwoBodyDispersionD3`` (same buffers, same neighbour list, in
the same process), with the ATen code they keep for other devices, with
gradcheck/gradgradcheck and opcheck; the models using them (ANI-2xr, ANI-2dr,
ANIr2s) against stock TorchANI; and the ops' results for 1, 2 and 4 threads.
"""
import copy
import io
import warnings

import pytest
import torch
import torchani
import torchani.grad
from torchani.cutoffs import CutoffBiweight, CutoffCosine
from torchani.neighbors import Neighbors, discard_outside_cutoff

import torchani_fast
import torchani_fast.models
from torchani_fast import ops
from torchani_fast.potentials import FastDispersionD3, FastRepulsionXTB
from torchani_fast.testing import random_model, water_box

from support import energy_forces

_STOCK = {}


def stock(name, dtype=torch.float64):
    if name not in _STOCK:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "ANIr2s is experimental"
            _STOCK[name] = random_model(name, seed=0)
    return copy.deepcopy(_STOCK[name]).to(dtype)


def pair(name, dtype=torch.float64):
    ref = stock(name, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = torchani_fast.patch(copy.deepcopy(ref))
    return ref, fast


def cluster(model, n, seed=0, dtype=torch.float64, spacing=1.5):
    """A jittered grid of n atoms of every element of ``model``: (numbers (1, n), coords (1, n, 3))."""
    g = torch.Generator().manual_seed(seed)
    k = 6
    r = torch.arange(k, dtype=torch.float64) * spacing
    grid = torch.stack(torch.meshgrid(r, r, r, indexing="ij"), -1).view(-1, 3)
    grid = grid - grid.mean(0)
    pos = grid[grid.norm(dim=1).argsort()[:n]]
    pos = pos + 0.15 * torch.randn(pos.shape, generator=g, dtype=torch.float64)
    zs = [int(z) for z in model.atomic_numbers]
    z = torch.tensor([zs[i % len(zs)] for i in range(n)])[torch.randperm(n, generator=g)]
    return z.unsqueeze(0), pos.unsqueeze(0).to(dtype)


def padded_batch(model, dtype=torch.float64):
    s1, x1 = cluster(model, 24, seed=1, dtype=dtype)
    s2, x2 = cluster(model, 11, seed=2, dtype=dtype)
    species = torch.full((2, 24), -1, dtype=torch.long)
    coords = torch.zeros(2, 24, 3, dtype=dtype)
    species[0], coords[0] = s1[0], x1[0]
    species[1, :11], coords[1, :11] = s2[0], x2[0]
    coords[1, 11:] = 50.0
    return species, coords


def potentials(fast, ref):
    return [(ref.potentials[k], fast.potentials[k]) for k in ("repulsion_xtb", "dispersion_d3")
            if k in ref.potentials]


def neighbors_of(fast, species, coords, cutoff, cell=None, pbc=None):
    elem = fast.species_converter(species)
    return elem, discard_outside_cutoff(fast.neighborlist(fast.cutoff, elem, coords, cell, pbc), cutoff)


def with_distances(nb, d):
    return Neighbors(nb.indices, d, nb.diff_vectors)


def tolerance(dtype):
    return dict(rtol=1e-12, atol=1e-15) if dtype == torch.float64 else dict(rtol=2e-6, atol=1e-8)


# -- the potentials on one neighbour list, against TorchANI's modules -----------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("atomic", [False, True])
@pytest.mark.parametrize("name", ["ANI2dr", "ANIr2s"])
def test_energies_and_gradients_match_torchani(name, atomic, dtype):
    ref, fast = pair(name, dtype)
    species, coords = padded_batch(ref, dtype)
    ghosts = torch.zeros_like(species, dtype=torch.bool)
    ghosts[0, :5] = True
    for slow, quick in potentials(fast, ref):
        assert type(quick) in (FastRepulsionXTB, FastDispersionD3)
        assert quick.fast_cutoff_kind >= 0  # the op runs
        elem, nb = neighbors_of(fast, species, coords, slow.cutoff)
        for flags in (None, ghosts):
            results = []
            for pot in (slow, quick):
                d = nb.distances.detach().requires_grad_(True)
                e = pot.compute_from_neighbors(elem, coords, with_distances(nb, d), atomic=atomic,
                                               ghost_flags=flags).energies
                w = torch.linspace(0.5, 1.5, e.numel(), dtype=dtype).view(e.shape)
                (g,) = torch.autograd.grad((w * e).sum(), d)
                results.append((e.detach(), g))
            (e_ref, g_ref), (e, g) = results
            assert e.shape == e_ref.shape and e.dtype == dtype
            torch.testing.assert_close(e, e_ref, **tolerance(dtype))
            scale = float(g_ref.abs().max())
            torch.testing.assert_close(g, g_ref, rtol=0, atol=scale * tolerance(dtype)["rtol"] * 10)


def test_the_aten_code_matches_the_op():
    """The ATen code (other devices; envelopes the op lacks) is the op's twin."""
    ref, fast = pair("ANI2dr")
    species, coords = padded_batch(ref)
    for _, quick in potentials(fast, ref):
        elem, nb = neighbors_of(fast, species, coords, quick.cutoff)
        got = quick.compute_from_neighbors(elem, coords, nb, atomic=True).energies
        kind = quick.fast_cutoff_kind
        quick.fast_cutoff_kind = -1
        try:
            aten = quick.compute_from_neighbors(elem, coords, nb, atomic=True).energies
        finally:
            quick.fast_cutoff_kind = kind
        torch.testing.assert_close(got, aten, rtol=1e-12, atol=1e-16)


def test_an_envelope_the_op_lacks_keeps_the_aten_code():
    ref, fast = pair("ANI2xr")
    for model in (ref, fast):
        model.potentials["repulsion_xtb"].cutoff_fn = CutoffBiweight()
    torchani_fast.patch(fast)  # re-reads the envelope
    assert fast.potentials["repulsion_xtb"].fast_cutoff_kind == -1
    species, coords = cluster(ref, 20)
    torch.testing.assert_close(energy_forces(fast, species, coords)[0],
                               energy_forces(ref, species, coords)[0], rtol=1e-10, atol=0)


def test_cosine_envelope():
    ref, fast = pair("ANI2xr")
    for model in (ref, fast):
        model.potentials["repulsion_xtb"].cutoff_fn = CutoffCosine()
    torchani_fast.patch(fast)
    assert fast.potentials["repulsion_xtb"].fast_cutoff_kind == ops.PAIR_CUTOFF_COSINE
    species, coords = cluster(ref, 20)
    slow, quick = ref.potentials["repulsion_xtb"], fast.potentials["repulsion_xtb"]
    elem, nb = neighbors_of(fast, species, coords, slow.cutoff)
    torch.testing.assert_close(quick.compute_from_neighbors(elem, coords, nb).energies,
                               slow.compute_from_neighbors(elem, coords, nb).energies,
                               rtol=1e-12, atol=0)


def test_unused_slots_padding_atoms_and_far_pairs_are_ignored():
    ref, fast = pair("ANI2dr")
    species, coords = padded_batch(ref)
    elem = fast.species_converter(species)
    wide = fast.neighborlist(fast.cutoff, elem, coords)
    for _, quick in potentials(fast, ref):
        nb = discard_outside_cutoff(wide, quick.cutoff)
        expected = quick.compute_from_neighbors(elem, coords, nb, atomic=True).energies
        # The 8 Å list as it is (pairs beyond the repulsion's 5.2 Å), plus unused slots.
        idx = torch.cat([wide.indices, torch.full((2, 3), -1)], 1)
        dist = torch.cat([wide.distances, torch.zeros(3, dtype=torch.float64)])
        e, _ = call_op(quick, elem, idx, dist, None, True)
        torch.testing.assert_close(e, expected, rtol=1e-12, atol=1e-16)


# -- the ops themselves ------------------------------------------------------------------------


def call_op(pot, elem, idx, dist, ghosts, atomic, derivatives=False):
    if isinstance(pot, FastRepulsionXTB):
        return ops.repulsion_xtb(elem, idx, dist, ghosts, atomic, pot.y_ab, pot.sqrt_alpha_ab,
                                 pot.k_rep_ab, pot.ANGSTROM_TO_BOHR, pot.cutoff,
                                 pot.fast_cutoff_kind, pot.fast_cutoff_order, pot.fast_cutoff_eps,
                                 derivatives)
    return ops.dispersion_d3(*d3_args(pot, elem, idx, dist, ghosts, atomic, derivatives))


def d3_args(pot, elem, idx, dist, ghosts, atomic, derivatives=False):
    damp = pot._damp_fn
    return (elem, idx, dist, ghosts, atomic, pot.precalc_coeff6, pot.precalc_coordnums_a,
            pot.precalc_coordnums_b, pot.covalent_radii, pot.sqrt_charge_ab, damp.cutoff_radii,
            pot._s6, pot._s8, damp._a1, damp._a2, float(pot._k1), pot._k2, float(pot._k3), pot._eps,
            pot.ANGSTROM_TO_BOHR, pot.cutoff, pot.fast_cutoff_kind, pot.fast_cutoff_order,
            pot.fast_cutoff_eps, derivatives)


def small_case(name="ANI2dr", n=7, seed=3):
    ref, fast = pair(name)
    species, coords = cluster(ref, n, seed=seed, spacing=1.3)
    elem = fast.species_converter(species)
    nb = fast.neighborlist(fast.cutoff, elem, coords)
    ghosts = torch.zeros_like(species, dtype=torch.bool)
    ghosts[0, 1] = True
    return fast, ref, elem, nb, ghosts


@pytest.mark.parametrize("atomic", [False, True])
def test_gradcheck_gradgradcheck(atomic):
    fast, ref, elem, nb, ghosts = small_case()
    for _, quick in potentials(fast, ref):
        for flags in (None, ghosts):
            def f(d):
                return call_op(quick, elem, nb.indices, d, flags, atomic)[0]

            d = nb.distances.detach().clone().requires_grad_(True)
            assert torch.autograd.gradcheck(f, (d,))
            assert torch.autograd.gradgradcheck(f, (d,))


def test_create_graph_gradient_equals_the_fast_one():
    """Under create_graph=True the backward is the ATen form: the same gradient."""
    fast, ref, elem, nb, ghosts = small_case(n=20, seed=4)
    for _, quick in potentials(fast, ref):
        for atomic in (False, True):
            grads = []
            for create_graph in (False, True):
                d = nb.distances.detach().clone().requires_grad_(True)
                e = call_op(quick, elem, nb.indices, d, ghosts, atomic)[0]
                w = torch.linspace(-1.0, 2.0, e.numel(), dtype=e.dtype).view(e.shape)
                (g,) = torch.autograd.grad((w * e).sum(), d, create_graph=create_graph)
                assert g.requires_grad == create_graph
                grads.append(g.detach())
            scale = float(grads[0].abs().max())
            torch.testing.assert_close(grads[1], grads[0], rtol=1e-11, atol=1e-13 * scale)


def test_returned_derivatives_are_the_callers_own():
    # The per-pair factors returned with derivatives=True are a copy: editing them
    # leaves the gradient (computed from the ones the op kept) as it was.
    fast, ref, elem, nb, ghosts = small_case(n=20, seed=4)
    for _, quick in potentials(fast, ref):
        grads = []
        for edit in (False, True):
            d = nb.distances.detach().clone().requires_grad_(True)
            e, derivs = call_op(quick, elem, nb.indices, d, ghosts, False, derivatives=True)
            assert derivs.shape[0] == d.shape[0] and derivs.abs().sum() > 0
            if edit:
                derivs.fill_(1e6)
            (g,) = torch.autograd.grad(e.sum(), d)
            grads.append(g)
        assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(dtype):
    fast, ref, elem, nb, ghosts = small_case(n=9)
    for _, quick in potentials(fast.to(dtype), ref):
        for atomic in (False, True):
            for flags in (None, ghosts):
                for derivatives in (False, True):
                    d = nb.distances.to(dtype).detach().requires_grad_(True)
                    if isinstance(quick, FastRepulsionXTB):
                        args = (elem, nb.indices, d, flags, atomic, quick.y_ab, quick.sqrt_alpha_ab,
                                quick.k_rep_ab, quick.ANGSTROM_TO_BOHR, quick.cutoff,
                                quick.fast_cutoff_kind, quick.fast_cutoff_order,
                                quick.fast_cutoff_eps, derivatives)
                        op = torch.ops.torchani_fast.repulsion_xtb.default
                    else:
                        args = d3_args(quick, elem, nb.indices, d, flags, atomic, derivatives)
                        op = torch.ops.torchani_fast.dispersion_d3.default
                    torch.library.opcheck(op, args)
                    torch.library.opcheck(op, tuple(a.detach() if isinstance(a, torch.Tensor) else a
                                                    for a in args))
                    e, derivs = op(*tuple(a.detach() if isinstance(a, torch.Tensor) else a
                                          for a in args[:-1]), True)
                    torch.library.opcheck(torch.ops.torchani_fast.pair_energies_backward.default,
                                          (torch.ones_like(e), derivs, nb.indices, elem, atomic))


def test_thread_count_does_not_change_a_bit():
    numbers, coords, cell, pbc = water_box(96)
    model = pair("ANI2dr", torch.float32)[1]
    elem = model.species_converter(numbers)
    x = coords.to(torch.float32)
    wide = model.neighborlist(model.cutoff, elem, x, cell.to(torch.float32), pbc)
    assert wide.indices.shape[1] > 20000  # several parallel chunks
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 4, 3):
            torch.set_num_threads(n)
            out = []
            for key in ("repulsion_xtb", "dispersion_d3"):
                pot = model.potentials[key]
                d = wide.distances.detach().requires_grad_(True)
                for atomic in (False, True):
                    e = call_op(pot, elem, wide.indices, d, None, atomic)[0]
                    (g,) = torch.autograd.grad(e.sum(), d)
                    out += [e, g]
            runs.append(out)
    finally:
        torch.set_num_threads(threads)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


def test_bad_arguments_name_the_argument():
    fast, ref, elem, nb, ghosts = small_case()
    rep = fast.potentials["repulsion_xtb"]
    d3 = fast.potentials["dispersion_d3"]
    with pytest.raises(RuntimeError, match=r"repulsion_xtb: distances must be a float32 or float64 \("):
        call_op(rep, elem, nb.indices, nb.distances[:-1], None, False)
    with pytest.raises(RuntimeError, match="repulsion_xtb: pairs must be an int64"):
        call_op(rep, elem, nb.indices.int(), nb.distances, None, False)
    with pytest.raises(RuntimeError, match=r"pairs must index the 7 atoms, got \(\d+, 99\)"):
        idx = nb.indices.clone()
        idx[1, 0] = 99
        call_op(rep, elem, idx, nb.distances, None, False)
    with pytest.raises(RuntimeError, match="ghost_flags must have one entry per atom"):
        call_op(d3, elem, nb.indices, nb.distances, ghosts[:, :3], False)
    with pytest.raises(RuntimeError, match="cutoff_kind must be 0 .* got 7"):
        ops.repulsion_xtb(elem, nb.indices, nb.distances, None, False, rep.y_ab, rep.sqrt_alpha_ab,
                          rep.k_rep_ab, rep.ANGSTROM_TO_BOHR, rep.cutoff, 7)
    with pytest.raises(RuntimeError, match="an infinite cutoff needs cutoff_kind 2"):
        ops.repulsion_xtb(elem, nb.indices, nb.distances, None, False, rep.y_ab, rep.sqrt_alpha_ab,
                          rep.k_rep_ab, rep.ANGSTROM_TO_BOHR, float("inf"), ops.PAIR_CUTOFF_SMOOTH)
    with pytest.raises(RuntimeError, match=r"k_rep_ab must be a float \[7, 7\] tensor"):
        ops.repulsion_xtb(elem, nb.indices, nb.distances, None, False, rep.y_ab, rep.sqrt_alpha_ab,
                          rep.k_rep_ab[:3], rep.ANGSTROM_TO_BOHR, rep.cutoff, 1)
    with pytest.raises(RuntimeError, match="elem_idxs must be below the tables' 7 elements, got 9"):
        bad = elem.clone()
        bad[0, 0] = 9
        call_op(d3, bad, nb.indices, nb.distances, None, False)
    with pytest.raises(RuntimeError, match=r"covalent_radii must be a float \[7\] tensor"):
        args = list(d3_args(d3, elem, nb.indices, nb.distances, None, False))
        args[8] = args[8][:2]
        ops.dispersion_d3(*args)
    with pytest.raises(RuntimeError, match=r"cutoff_order must be in \[1, 64\].*got 65"):
        ops.repulsion_xtb(elem, nb.indices, nb.distances, None, False, rep.y_ab, rep.sqrt_alpha_ab,
                          rep.k_rep_ab, rep.ANGSTROM_TO_BOHR, rep.cutoff, ops.PAIR_CUTOFF_SMOOTH, 65)
    with pytest.raises(RuntimeError, match=r"must be a product grid .*not at \(1, 2, 0, 0\)"):
        args = list(d3_args(d3, elem, nb.indices, nb.distances, None, False))
        args[6] = args[6].clone()
        args[6][1, 2, 0, 0] += 0.5  # coordnums_a off the grid where C6 is defined
        assert args[5][1, 2, 0, 0] > 0
        ops.dispersion_d3(*args)
    with pytest.raises(ValueError, match="ghost_flags and species should have the same number"):
        d3.compute_from_neighbors(elem, None, nb, ghost_flags=ghosts[:, :3])
    with pytest.raises(RuntimeError, match=r"derivs must be a float \(\d+, 1\) or"):
        ops.pair_energies_backward(torch.ones(1, dtype=torch.float64),
                                   torch.zeros(nb.indices.shape[1], 2, dtype=torch.float64),
                                   nb.indices, elem, False)


# -- the models using them, against stock TorchANI --------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["ANI2xr", "ANI2dr", "ANIr2s"])
def test_models_energies_forces_atomic_energies(name, dtype):
    ref, fast = pair(name, dtype)
    species, coords = padded_batch(ref, dtype)
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(e, e_ref, rtol=8 * eps, atol=8 * eps)
    torch.testing.assert_close(f, f_ref, rtol=0, atol=1e-9 if dtype == torch.float64 else 5e-5)
    a_ref = ref.atomic_energies((species, coords)).energies
    a = fast.atomic_energies((species, coords)).energies
    torch.testing.assert_close(a, a_ref, rtol=0, atol=1e-10 if dtype == torch.float64 else 2e-5)


@pytest.mark.parametrize("pbc", [[True, True, True], [True, False, True]])
@pytest.mark.parametrize("name", ["ANI2xr", "ANI2dr"])
def test_models_small_triclinic_cell_and_partial_pbc(name, pbc):
    ref, fast = pair(name)
    species, coords = cluster(ref, 30, seed=7, spacing=1.6)
    cell = torch.tensor([[7.5, 0.0, 0.0], [1.5, 7.2, 0.0], [-1.1, 0.8, 7.4]], dtype=torch.float64)
    pbc = torch.tensor(pbc)
    frac = torch.linalg.solve(cell.t(), coords[0].t()).t() % 1.0
    coords = (frac @ cell).unsqueeze(0)
    if not bool(pbc.all()):
        # TorchANI wraps aperiodic axes of a triclinic cell wrongly: the reference
        # is our list through TorchANI's potentials (compute_from_neighbors).
        elem = fast.species_converter(species)
        nb = fast.neighborlist(fast.cutoff, elem, coords, cell, pbc)
        e_ref = ref.compute_from_neighbors(elem, coords, nb).energies
        e = fast.compute_from_neighbors(elem, coords, nb).energies
        torch.testing.assert_close(e, e_ref, rtol=1e-12, atol=0)
        return
    e_ref, f_ref = energy_forces(ref, species, coords, cell, pbc)
    e, f = energy_forces(fast, species, coords, cell, pbc)
    torch.testing.assert_close(e, e_ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(f, f_ref, rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", ["ANI2xr", "ANI2dr", "ANIr2s"])
def test_models_hessians(name):
    ref, fast = pair(name)
    species, coords = cluster(ref, 6, seed=5)
    expected = torchani.grad.energies_forces_and_hessians(ref, species, coords.clone())
    got = torchani_fast.models.energies_forces_hessians(fast, species, coords)
    torch.testing.assert_close(got.hessians, expected.hessians.detach(), rtol=0, atol=1e-8)


@pytest.mark.parametrize("name", ["ANI2xr", "ANI2dr", "ANIr2s"])
def test_models_torchscript_save_load(name):
    ref, fast = pair(name)
    species, coords = cluster(ref, 15, seed=6)
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(fast), buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(loaded, species, coords)
    torch.testing.assert_close(e, e_ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(f, f_ref, rtol=0, atol=1e-9)
