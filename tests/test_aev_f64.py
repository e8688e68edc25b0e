"""The float64 AEV's vectorised kernels (AVX2: 4 lanes, AVX-512: 8) against
TorchANI float64 and the portable kernels (cpu_isa("none")), at every level
this CPU has; AVX2 and AVX-512 must give the same bits."""
import copy

import pytest
import torch

import torchani_fast
from torchani_fast import ops
from support import atoms_to_tensors, read_molecule, reference_model


def aev_and_grad(aevc, species, coords, cell, pbc, weights):
    x = coords.detach().clone().requires_grad_(True)
    a = aevc(species, x, cell, pbc)
    (g,) = torch.autograd.grad((a * weights).sum(), x)
    return a.detach(), g


def systems():
    g = torch.Generator().manual_seed(7)
    # every ANI-2x element, a padded second molecule, and a small triclinic cell
    species = torch.tensor([[1, 6, 7, 8, 16, 9, 17, 1, 6, 8] * 3, [1, 6, 8, 7] * 5 + [-1] * 10])
    coords = torch.rand(2, 30, 3, generator=g, dtype=torch.float64) * 5.0
    yield "cluster", species, coords, None, None
    cell = torch.tensor([[6.0, 0.0, 0.0], [1.0, 5.5, 0.0], [0.5, 0.7, 6.2]], dtype=torch.float64)
    yield "triclinic", species[:1], coords[:1] * 1.1, cell, torch.tensor([True, True, True])
    yield "small", *atoms_to_tensors(read_molecule("small.xyz"))


@pytest.mark.parametrize("model", ["ANI2x", "ANI1x"])
def test_f64_aev_and_gradient_every_level(levels, model):
    ref = reference_model(model, torch.float64)
    fast = torchani_fast.patch(copy.deepcopy(ref))
    aevc, raevc = fast.potentials["nnp"].aev_computer, ref.potentials["nnp"].aev_computer
    for name, species, coords, cell, pbc in systems():
        if model == "ANI1x":
            species = torch.where(species > 8, torch.ones_like(species), species)
        elem = ref.species_converter(species)
        w = torch.randn(*elem.shape, aevc.out_dim, generator=torch.Generator().manual_seed(1),
                        dtype=torch.float64)
        a_ref, g_ref = aev_and_grad(raevc, elem, coords, cell, pbc, w)
        out = {}
        for level in levels:
            torchani_fast.cpu_isa(level)
            out[level] = aev_and_grad(aevc, elem, coords, cell, pbc, w)
            a, g = out[level]
            torch.testing.assert_close(a, a_ref, rtol=1e-12, atol=1e-14 * a_ref.abs().max().item())
            torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12 * g_ref.abs().max().item())
        if "avx512" in out:
            assert torch.equal(out["avx2"][0], out["avx512"][0]), name
            assert torch.equal(out["avx2"][1], out["avx512"][1]), name


@pytest.mark.parametrize("smooth", [False, True], ids=["cosine", "smooth"])
def test_f64_near_cutoffs_and_gradcheck(levels, smooth):
    import numpy as np
    ref = reference_model("ANI2x", torch.float64)
    aevc = torchani_fast.patch(copy.deepcopy(ref)).potentials["nnp"].aev_computer
    raevc = ref.potentials["nnp"].aev_computer
    rc_r, rc_a = float(raevc.radial.cutoff), float(raevc.angular.cutoff)
    for delta in ([] if smooth else (1e-4, "ulp")):
        below = (lambda rc: float(np.nextafter(rc, 0.0))) if delta == "ulp" else (lambda rc: rc - delta)
        species = torch.tensor([[1, 3, 0, 2, 1]])
        coords = torch.tensor([[[0.0, 0.0, 0.0], [-below(rc_r), 0.0, 0.0], [below(rc_a), 0.0, 0.0],
                                [0.0, 1.1, 0.0], [0.3, 0.2, 0.9]]], dtype=torch.float64)
        w = torch.randn(1, 5, aevc.out_dim, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        a_ref, g_ref = aev_and_grad(raevc, species, coords, None, None, w)
        for level in levels:
            torchani_fast.cpu_isa(level)
            a, g = aev_and_grad(aevc, species, coords, None, None, w)
            torch.testing.assert_close(a, a_ref, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-12)
    species = torch.tensor([[0, 1, 2, 0, 3, -1]])
    coords = torch.rand(1, 6, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3.0
    pairs, _ = ops.neighbor_pairs(species, coords, None, None, rc_r, False)
    flat = coords.view(-1, 3)
    diff = (flat[pairs[0]] - flat[pairs[1]]).requires_grad_(True)
    r, a = raevc.radial, raevc.angular
    consts = [t.double() for t in (r.eta, r.shifts, a.eta, a.zeta, a.shifts, a.sections)]
    kw = {"cutoff_kind": 1, "cutoff_order": 2, "cutoff_eps": 1e-10} if smooth else {}
    for level in levels:
        torchani_fast.cpu_isa(level)
        f = lambda d: ops.aev(species, pairs, d, *consts, rc_r, rc_a, 7, **kw)  # noqa: E731
        assert torch.autograd.gradcheck(f, (diff,), fast_mode=True)
        assert torch.autograd.gradgradcheck(f, (diff,), fast_mode=True)


def test_f64_thread_count_bitwise(levels):
    ref = reference_model("ANI2x", torch.float64)
    aevc = torchani_fast.patch(copy.deepcopy(ref)).potentials["nnp"].aev_computer
    species, coords, cell, pbc = atoms_to_tensors(read_molecule("small.xyz"))
    elem = ref.species_converter(species)
    w = torch.randn(*elem.shape, aevc.out_dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    before = torch.get_num_threads()
    try:
        out = []
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            out.append(aev_and_grad(aevc, elem, coords, cell, pbc, w))
    finally:
        torch.set_num_threads(before)
    for a, g in out[1:]:
        assert torch.equal(a, out[0][0]) and torch.equal(g, out[0][1])
