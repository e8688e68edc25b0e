"""Second derivatives through the AEV op: Hessians, vibrational analysis, force training.

TorchANI (same process, same weights) is the reference for every value; the
ops themselves are checked with gradcheck/gradgradcheck in float64. Hessians
against TorchANI use one network of the ensemble where the molecule is large
(the network part is TorchANI's own code either way; the AEV part is ours).
"""
import copy

import pytest
import torch
import torchani
from torchani.grad import energies_and_forces, energies_forces_and_hessians, hessians

import torchani_fast
from torchani_fast import ops
from torchani_fast.grad import energies_forces_and_hessians as one_pass_hessians
from torchani_fast.grad import hessians_supported

from support import (TINY_LEN, atoms_to_tensors, read_molecule, reference_model, tiny_consts,
                      tiny_periodic_system)

F64 = torch.float64


# --- the ops on tiny random systems ------------------------------------------------


def test_gradgradcheck_aev_op_with_periodic_images():
    species, pairs, diff = tiny_periodic_system()
    consts = tiny_consts()
    diff.requires_grad_(True)
    f = lambda d: ops.aev(species, pairs, d, *consts)  # noqa: E731
    assert torch.autograd.gradcheck(f, (diff,))
    # Random grad_outputs that require grad: checks both halves of aev_backward's
    # backward (w.r.t. diff and w.r.t. grad_aev).
    assert torch.autograd.gradgradcheck(f, (diff,))


def test_gradcheck_second_derivative_ops():
    species, pairs, diff = tiny_periodic_system(seed=1)
    consts = tiny_consts()
    g = torch.Generator().manual_seed(2)
    tangent = torch.randn(diff.shape, generator=g, dtype=F64).requires_grad_(True)
    grad_aev = torch.randn(*species.shape, TINY_LEN, generator=g, dtype=F64).requires_grad_(True)
    diff = diff.requires_grad_(True)
    # aev_jvp is differentiable in its tangent and in diff_vectors.
    assert torch.autograd.gradcheck(lambda t, d: ops.aev_jvp(t, species, pairs, d, *consts),
                                    (tangent, diff))
    # aev_double_backward(g, t) = d/d diff <t, aev_backward(g, diff)> = H t: the
    # central difference of aev_backward along t.
    t, d, gr = tangent.detach(), diff.detach(), grad_aev.detach()
    eps = 1e-6
    expected = (ops.aev_backward(gr, species, pairs, d + eps * t, *consts)
                - ops.aev_backward(gr, species, pairs, d - eps * t, *consts)) / (2 * eps)
    got = ops.aev_double_backward(gr, t, species, pairs, d, *consts)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-7 * expected.abs().max().item())
    assert torch.autograd.gradcheck(
        lambda t: ops.aev_double_backward(grad_aev.detach(), t, species, pairs, diff.detach(),
                                          *consts), (tangent,))
    # Hessian symmetry: <s, H t> == <t, H s>.
    s = torch.randn(diff.shape, generator=g, dtype=F64)
    h = lambda v: ops.aev_double_backward(grad_aev.detach(), v, species, pairs,  # noqa: E731
                                          diff.detach(), *consts)
    torch.testing.assert_close((s * h(tangent.detach())).sum(), (tangent.detach() * h(s)).sum(),
                               rtol=1e-12, atol=0)


def test_float32_second_derivatives_close_to_float64():
    species, pairs, diff = tiny_periodic_system(seed=3)
    g = torch.Generator().manual_seed(4)
    tangent = torch.randn(diff.shape, generator=g, dtype=F64)
    grad_aev = torch.randn(*species.shape, TINY_LEN, generator=g, dtype=F64)
    out = {}
    for dt in (torch.float32, F64):
        c = tiny_consts(dt)
        jvp = ops.aev_jvp(tangent.to(dt), species, pairs, diff.to(dt), *c)
        hvp = ops.aev_double_backward(grad_aev.to(dt), tangent.to(dt), species, pairs,
                                      diff.to(dt), *c)
        assert jvp.dtype == hvp.dtype == dt
        out[dt] = (jvp, hvp)
    for a, b in zip(out[torch.float32], out[F64]):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


def second_derivative_case(like, cutoff):
    """A padded batch of 2iuz (46 atoms, every radial and angular term of
    ANI-1x or ANI-2x in use) with the cosine (0) or the smooth (1) cutoff and
    a zeta below 2 (the other branch of the second derivative): the inputs of
    aev_jvp and aev_double_backward, float64."""
    aevc = getattr(torchani.aev.AEVComputer, like)()
    atoms = read_molecule("2iuz_ligand.xyz")
    z = torch.tensor(atoms.numbers)
    elem = torch.full((2, len(z) + 1), -1)
    elem[:, :-1] = (z == 6) * 1 + (z == 7) * 2 + (z == 8) * 3  # H 0, C 1, N 2, O 3
    xyz = torch.zeros(2, len(z) + 1, 3, dtype=F64)
    xyz[0, :-1] = torch.tensor(atoms.positions)
    xyz[1, :-1] = xyz[0, :-1] + 0.05 * torch.sin(7 * xyz[0, :-1])
    pairs, _ = ops.neighbor_pairs(elem, xyz, None, None, float(aevc.radial.cutoff), False)
    flat = xyz.view(-1, 3)
    diff = flat[pairs[0]] - flat[pairs[1]]
    r, a = aevc.radial, aevc.angular
    zeta = a.zeta.double().expand(len(a.sections)).clone()
    zeta[0] = 1.5
    consts = [r.eta.double(), r.shifts.double(), a.eta.double(), zeta, a.shifts.double(),
              a.sections.double(), float(r.cutoff), float(a.cutoff), aevc.num_species, cutoff]
    features = len(r.shifts) * aevc.num_species + len(a.shifts) * len(a.sections) * (
        aevc.num_species * (aevc.num_species + 1) // 2)
    tangent = torch.cos(torch.arange(diff.numel(), dtype=F64)).view_as(diff)
    grad_aev = torch.sin(torch.arange(elem.numel() * features, dtype=F64)).view(1, -1, features)

    def run(dt):
        c = [x.to(dt) if torch.is_tensor(x) else x for x in consts]
        return (ops.aev_jvp(tangent.to(dt), elem, pairs, diff.to(dt), *c),
                ops.aev_double_backward(grad_aev.to(dt), tangent.to(dt), elem, pairs, diff.to(dt),
                                        *c))
    return run


CASES = pytest.mark.parametrize("like,cutoff", [("like_1x", 0), ("like_2x", 0), ("like_2x", 1)],
                                ids=["1x", "2x", "2x-smooth"])


@CASES
def test_float32_second_derivatives_on_every_isa_level(like, cutoff, levels):
    """With AVX2 aev_jvp and aev_double_backward run on lanes
    (csrc/aev/second_lanes.h: every radial shift of a neighbour, the angular
    terms of several triples at once, the exps and logs of simd::), without
    AVX2 one value at a time (libm). In float32 both stay as close to float64
    as float32 allows. (Clamped triples, computed by the scalar functions on
    every level: test_coincident_atoms_give_no_nan.)"""
    run = second_derivative_case(like, cutoff)
    with torch.no_grad():
        torchani_fast.cpu_isa("none")
        ref = run(F64)  # float64 one value at a time
    assert all(torch.isfinite(x).all() and x.abs().max() > 0 for x in ref)
    for level in levels:
        torchani_fast.cpu_isa(level)
        for got, want in zip(run(torch.float32), ref):
            scale = want.abs().max().item()
            torch.testing.assert_close(got.double(), want, rtol=0, atol=3e-6 * scale,
                                       msg=lambda m: f"{level}: {m}")


@CASES
def test_float64_second_derivatives_on_every_isa_level(like, cutoff, levels):
    """float64 on lanes (4 with AVX2, 8 with AVX-512) against float64 one value
    at a time: the same formulas, exps and logs within 2 ulp, other orders of
    summation: 1e-13 of the largest entry (measured: 4e-16 to 2e-15)."""
    run = second_derivative_case(like, cutoff)
    torchani_fast.cpu_isa("none")
    ref = run(F64)
    for level in levels[1:]:
        torchani_fast.cpu_isa(level)
        for got, want in zip(run(F64), ref):
            scale = want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=0, atol=1e-13 * scale,
                                       msg=lambda m: f"{level}: {m}")
            assert not torch.equal(got, want)  # (the lanes ran)


def test_opcheck_second_derivative_ops():
    consts64 = tiny_consts()
    for dt in (torch.float32, F64):
        species, pairs, diff = tiny_periodic_system(dt)
        consts = [c.to(dt) if torch.is_tensor(c) else c for c in consts64]
        tangent = torch.randn_like(diff).requires_grad_(True)
        grad_aev = torch.randn(*species.shape, TINY_LEN, dtype=dt).requires_grad_(True)
        diff.requires_grad_(True)
        # aev_jvp: differentiable in tangent and diff_vectors.
        torch.library.opcheck(torch.ops.torchani_fast.aev_jvp.default,
                              (tangent, species, pairs, diff, *consts))
        # aev_double_backward: in its tangent only (the rest are third derivatives).
        torch.library.opcheck(torch.ops.torchani_fast.aev_double_backward.default,
                              (grad_aev.detach(), tangent, species, pairs, diff.detach(), *consts))
        if dt == F64:  # aev_backward is now differentiable in grad_aev and diff_vectors
            torch.library.opcheck(torch.ops.torchani_fast.aev_backward.default,
                                  (grad_aev, species, pairs, diff, *consts))


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_coincident_atoms_give_no_nan(dtype, levels):
    # Atoms 0 and 1 coincide (r = 0, and r1 r2 < 1e-10 in every triple with that pair).
    species = torch.tensor([[0, 1, 0, 1]])
    x = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.1, 0.2, 0.0], [0.1, 1.3, 0.4]],
                     dtype=dtype)
    i, j = torch.triu_indices(4, 4, 1)
    diff = x[i] - x[j]
    consts = [c.to(dtype) if torch.is_tensor(c) else c for c in tiny_consts()]
    tangent = torch.ones_like(diff)
    grad_aev = torch.ones(1, 4, TINY_LEN, dtype=dtype)
    for level in levels:  # float32: the clamped triples among vectorised ones (AVX2 and up)
        torchani_fast.cpu_isa(level)
        for out in (ops.aev_jvp(tangent, species, torch.stack([i, j]), diff, *consts),
                    ops.aev_double_backward(grad_aev, tangent, species, torch.stack([i, j]),
                                            diff, *consts)):
            assert torch.isfinite(out).all(), level


def test_third_derivative_is_refused_with_a_clear_message():
    species, pairs, diff = tiny_periodic_system()
    consts = tiny_consts()
    diff.requires_grad_(True)
    s = (ops.aev(species, pairs, diff, *consts) ** 2).sum()
    (g,) = torch.autograd.grad(s, diff, create_graph=True)
    (h,) = torch.autograd.grad(g[0, 0], diff, create_graph=True)
    with pytest.raises(RuntimeError, match="third derivatives"):
        torch.autograd.grad(h.sum(), diff)


# --- through the neighbour list and the model ----------------------------------------


def test_gradgradcheck_through_small_periodic_cell():
    ref = reference_model("ANI2x", F64)
    fast = torchani_fast.patch(copy.deepcopy(ref))
    aevc = fast.potentials["nnp"].aev_computer
    g = torch.Generator().manual_seed(5)
    species = torch.tensor([[0, 1, 3, 0]])
    coords = (torch.rand(1, 4, 3, generator=g, dtype=F64) * 3.0).requires_grad_(True)
    # Cell edges well below the 5.1 Å cutoff: many images of every atom.
    cell = (torch.eye(3, dtype=F64) * 3.3 + 0.3 * torch.rand(3, 3, generator=g, dtype=F64))
    cell.requires_grad_(True)
    pbc = torch.tensor([True, True, True])
    w = torch.randn(aevc.out_dim, 3, generator=g, dtype=F64) * 0.1

    def energy(x, c):  # a smooth nonlinear read-out, like a network
        return torch.tanh(aevc(species, x, c, pbc) @ w).sum()

    assert torch.autograd.gradgradcheck(energy, (coords, cell))


def hessian_of(model, species, coords, cell=None, pbc=None):
    x = coords.clone()
    if cell is None:
        return energies_forces_and_hessians(model, species, x)
    # energies_forces_and_hessians takes no cell: the same two steps with one.
    x.requires_grad_(True)
    e, f = energies_and_forces(model, species, x, cell, pbc, retain_graph=True, create_graph=True)
    return e, f, hessians(f, x)


CASES = [
    # (file, frames, one network (index) or the whole ensemble (None))
    ("3lka_ligand.xyz", None, 0),
    ("water-0.8nm.xyz", None, 0),
    ("CH4-5.xyz", "0:3", None),  # a batch of conformers, 8-member ensemble
]


@pytest.mark.parametrize("name,frames,member", CASES)
def test_hessians_match_torchani_float64(name, frames, member):
    ref = reference_model("ANI2x", F64)
    if member is not None:
        ref = ref[member]
    fast = torchani_fast.patch(copy.deepcopy(ref))
    if frames is None:
        species, coords, cell, pbc = atoms_to_tensors(read_molecule(name))
    else:
        mols = read_molecule(name, index=frames)
        parts = [atoms_to_tensors(m) for m in mols]
        species = torch.cat([p[0] for p in parts])
        coords = torch.cat([p[1] for p in parts])
        cell = pbc = None
    e_ref, f_ref, h_ref = hessian_of(ref, species, coords, cell, pbc)
    # The patched model through torchani.grad (3N double-backward passes) and
    # through torchani_fast.grad (one pass, no autograd for the Hessian).
    assert hessians_supported(fast) is None
    for e, f, h in (hessian_of(fast, species, coords, cell, pbc),
                    one_pass_hessians(fast, species, coords, cell, pbc)):
        torch.testing.assert_close(e, e_ref, rtol=0, atol=1e-10)
        torch.testing.assert_close(f, f_ref, rtol=0, atol=1e-10)
        torch.testing.assert_close(h, h_ref, rtol=0, atol=1e-8)
        torch.testing.assert_close(h, h.transpose(1, 2), rtol=0, atol=1e-10)


def test_hessian_float32_close_to_torchani():
    ref = reference_model("ANI2x", torch.float32)[0]
    fast = torchani_fast.patch(copy.deepcopy(ref))
    species, coords, _, _ = atoms_to_tensors(read_molecule("CH4-5.xyz", index=0), torch.float32)
    _, _, h_ref = hessian_of(ref, species, coords)
    _, _, h64 = hessian_of(reference_model("ANI2x", F64)[0], species, coords.double())
    scale = h64.abs().max().item()
    err_ref = (h_ref.double() - h64).abs().max().item()
    for _, _, h in (hessian_of(fast, species, coords), one_pass_hessians(fast, species, coords)):
        # Within float32 round-off of the float64 Hessian, like TorchANI's.
        assert h.dtype == torch.float32
        err = (h.double() - h64).abs().max().item()
        assert err <= max(3 * err_ref, 1e-5 * scale), (err, err_ref, scale)


def test_water_vibrational_frequencies_match_torchani():
    from ase.build import molecule

    ref = reference_model("ANI2x", F64)
    fast = torchani_fast.patch(copy.deepcopy(ref))
    species, coords, _, _ = atoms_to_tensors(molecule("H2O"))
    masses = torchani.utils.atomic_numbers_to_masses(species)
    out = []
    for model in (ref, fast):
        _, _, h = hessian_of(model, species, coords)
        out.append(torchani.grad.vibrational_analysis(masses, h, mode_kind="mdn"))
    vib_ref, vib = out
    # The 3 vibrations (the largest wavenumbers), then every mode up to round-off
    # (the 6 near-zero translations/rotations are square roots of round-off).
    torch.testing.assert_close(vib.freqs[-3:], vib_ref.freqs[-3:], rtol=1e-9, atol=0)
    torch.testing.assert_close(vib.freqs, vib_ref.freqs, rtol=0, atol=1e-2)
    torch.testing.assert_close(vib.fconstants[-3:], vib_ref.fconstants[-3:], rtol=1e-8, atol=0)
    torch.testing.assert_close(vib.rmasses[-3:], vib_ref.rmasses[-3:], rtol=1e-8, atol=0)
    sign = torch.sign((vib.modes[-3:] * vib_ref.modes[-3:]).sum(dim=(1, 2))).view(-1, 1, 1)
    torch.testing.assert_close(vib.modes[-3:] * sign, vib_ref.modes[-3:], rtol=0, atol=1e-7)


@pytest.mark.parametrize("name", ["3lka_ligand.xyz", "water-0.8nm.xyz"])
def test_force_training_weight_gradients_match_torchani(name):
    ref = reference_model("ANI2x", F64)[0]
    fast = torchani_fast.patch(copy.deepcopy(ref))
    species, coords, cell, pbc = atoms_to_tensors(read_molecule(name))
    target = torch.randn(coords.shape, generator=torch.Generator().manual_seed(6), dtype=F64)
    grads = []
    for model in (ref, fast):
        params = list(model.potentials["nnp"].neural_networks.parameters())
        for p in params:
            p.requires_grad_(True)  # shipped weights are frozen
        x = coords.clone().requires_grad_(True)
        e = model((species, x), cell=cell, pbc=pbc).energies
        (g,) = torch.autograd.grad(e.sum(), x, create_graph=True)
        loss = ((-g - target) ** 2).sum() + 0.1 * e.sum()  # force matching + energy term
        grads.append(torch.autograd.grad(loss, params, allow_unused=True))
    assert len(grads[0]) == len(grads[1]) > 0
    used = 0
    for a, b in zip(grads[1], grads[0]):
        assert (a is None) == (b is None)  # networks of absent elements
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
            used += 1
    assert used > 0


def test_scripted_model_differentiates_twice(tmp_path):
    ref = reference_model("ANI2x", F64)[0]
    fast = torchani_fast.patch(copy.deepcopy(ref))
    path = tmp_path / "model.pt"
    torch.jit.save(torch.jit.script(fast), str(path))
    loaded = torch.jit.load(str(path))
    species, coords, _, _ = atoms_to_tensors(read_molecule("CH4-5.xyz", index=0))
    _, _, h_ref = hessian_of(ref, species, coords)
    _, _, h = hessian_of(loaded, species, coords)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=1e-8)


# --- torchani_fast.grad: one-pass Hessians ------------------------------------------


def test_one_pass_padded_batch_and_active_members():
    ref = reference_model("ANI2x", F64)
    ref.set_active_members([1, 4, 6])
    fast = torchani_fast.patch(copy.deepcopy(ref))
    methane = atoms_to_tensors(read_molecule("CH4-5.xyz", index=2))
    from ase.build import molecule

    water = atoms_to_tensors(molecule("H2O"))
    species = torch.full((2, 5), -1, dtype=torch.long)
    coords = torch.zeros(2, 5, 3, dtype=F64)
    species[0], coords[0] = methane[0][0], methane[1][0]
    species[1, :3], coords[1, :3] = water[0][0], water[1][0]
    e_ref, f_ref, h_ref = hessian_of(ref, species, coords)
    e, f, h = one_pass_hessians(fast, species, coords)
    torch.testing.assert_close(e, e_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(f, f_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=1e-8)
    assert (h[1, 9:] == 0).all() and (h[1, :, 9:] == 0).all()  # padding atoms


def test_one_pass_other_model_and_fallback():
    from ase.build import molecule

    species, coords, _, _ = atoms_to_tensors(molecule("CH3OH"))
    ref = reference_model("ANI1x", F64)
    _, _, h_ref = hessian_of(ref, species, coords)
    fast = torchani_fast.patch(copy.deepcopy(ref))
    _, _, h = one_pass_hessians(fast, species, coords)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=1e-8)
    # An unpatched model is not refused: it takes the autograd loop.
    assert "not patched" in hessians_supported(ref)
    _, _, h_loop = one_pass_hessians(ref, species, coords)
    torch.testing.assert_close(h_loop, h_ref, rtol=0, atol=0)


def test_local_derivatives_op():
    # The op's Jacobian and curvature blocks against aev_jvp / aev_double_backward
    # along every coordinate, on the tiny periodic system (self image, repeated pair).
    species, pairs, diff = tiny_periodic_system(seed=7)
    consts = tiny_consts()
    n = species.numel()
    g = torch.randn(1, n, TINY_LEN, generator=torch.Generator().manual_seed(8), dtype=F64)
    every = torch.arange(TINY_LEN)
    local, jac, curv = ops.aev_local_derivatives(g, every, species, pairs, diff, *consts)
    some = torch.tensor([1, 2, 9, 15, 19])  # a column subset gives those columns
    _, jac_some, curv_some = ops.aev_local_derivatives(g, some, species, pairs, diff, *consts)
    assert torch.equal(jac_some, jac[..., some]) and torch.equal(curv_some, curv)
    k = local.shape[1]
    assert (local[:, 0] == torch.where(species[0] >= 0, torch.arange(n), -1)).all()
    dense_j = torch.zeros(n, 3, n, TINY_LEN, dtype=F64)  # [atom, comp, centre, feature]
    dense_h = torch.zeros(n, 3, n, 3, dtype=F64)
    for i in range(n):
        for a in range(k):
            if local[i, a] < 0:
                continue
            dense_j[local[i, a], :, i] += jac[i, a]
            for b in range(k):
                if local[i, b] >= 0:
                    dense_h[local[i, a], :, local[i, b]] += curv[i, a, :, b]
    for atom in range(n):
        for c in range(3):
            t = torch.zeros_like(diff)
            t[pairs[0] == atom, c] += 1
            t[pairs[1] == atom, c] -= 1
            jv = ops.aev_jvp(t, species, pairs, diff, *consts)[0]
            torch.testing.assert_close(dense_j[atom, c], jv, rtol=0, atol=1e-12)
            hv = ops.aev_double_backward(g, t, species, pairs, diff, *consts)
            hx = torch.zeros(n, 3, dtype=F64).index_add_(0, pairs[0], hv).index_add_(0, pairs[1], -hv)
            torch.testing.assert_close(dense_h[:, :, atom, c], hx, rtol=0, atol=1e-10)
    with pytest.raises(RuntimeError, match="not differentiable"):
        ops.aev_local_derivatives(g, every, species, pairs, diff.clone().requires_grad_(True),
                                  *consts)
    for dt in (torch.float32, F64):
        cs = [c.to(dt) if torch.is_tensor(c) else c for c in consts]
        torch.library.opcheck(torch.ops.torchani_fast.aev_local_derivatives.default,
                              (g.to(dt), some, species, pairs, diff.to(dt), *cs))
