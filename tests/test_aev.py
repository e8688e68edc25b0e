"""The AEV op and AEVComputer against TorchANI's own featurizer (same process)."""

import copy
import threading

import numpy as np
import pytest
import torch

import torchani_fast

from torchani_fast import ops

from support import (NONPERIODIC, PERIODIC, aev_args, atoms_to_tensors, chloromethane, model_pair, read_molecule,
                      reference_model)


def tol(dtype):
    return dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", NONPERIODIC + PERIODIC)
def test_aev_matches_torchani(name, dtype):
    ref, fast = model_pair("ANI2x", dtype)
    species, coords, cell, pbc = atoms_to_tensors(read_molecule(name), dtype)
    elem = ref.species_converter(species)
    expected = ref.potentials["nnp"].aev_computer(elem, coords, cell, pbc)
    got = fast.potentials["nnp"].aev_computer(elem, coords, cell, pbc)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, **tol(dtype))


def test_aev_ani1x_and_padded_batch():
    ref, fast = model_pair("ANI1x", torch.float64)
    mols = [read_molecule(n) for n in ("2iuz_ligand.xyz", "1hvj_ligand.xyz")]
    # ANI-1x knows H C N O only: both ligands qualify.
    n = max(len(m) for m in mols)
    species = torch.full((2, n), -1, dtype=torch.long)
    coords = torch.zeros(2, n, 3, dtype=torch.float64)
    for i, m in enumerate(mols):
        species[i, : len(m)] = torch.tensor(m.numbers)
        coords[i, : len(m)] = torch.tensor(m.positions)
    # Padding atoms sit on top of a real atom: they must still be ignored.
    coords[0, len(mols[0]):] = coords[0, 0]
    elem = ref.species_converter(species)
    expected = ref.potentials["nnp"].aev_computer(elem, coords)
    got = fast.potentials["nnp"].aev_computer(elem, coords)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert (got[0, len(mols[0]):] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_aev_with_chlorine(dtype):
    ref, fast = model_pair("ANI2x", dtype)
    species, coords = chloromethane(dtype)
    elem = ref.species_converter(species)
    expected = ref.potentials["nnp"].aev_computer(elem, coords)
    got = fast.potentials["nnp"].aev_computer(elem, coords)
    torch.testing.assert_close(got, expected, **tol(dtype))


def small_system(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    species = torch.tensor([[0, 1, 2, 0, 3, -1]])
    coords = torch.rand(1, 6, 3, generator=g, dtype=dtype) * 3.0
    return species, coords


def test_gradcheck_aev_op():
    ref = reference_model("ANI2x", torch.float64)
    species, coords = small_system()
    pairs, _ = ops.neighbor_pairs(species, coords, None, None, 5.1, False)
    flat = coords.view(-1, 3)
    diff = (flat[pairs[0]] - flat[pairs[1]]).requires_grad_(True)
    args = aev_args(ref.potentials["nnp"].aev_computer, torch.float64)
    assert torch.autograd.gradcheck(lambda d: ops.aev(species, pairs, d, *args), (diff,), fast_mode=True)


def test_gradcheck_through_coords_and_cell():
    ref, fast = model_pair("ANI2x", torch.float64)
    aevc = fast.potentials["nnp"].aev_computer
    species, coords = small_system(seed=1)
    coords.requires_grad_(True)
    cell = (torch.eye(3, dtype=torch.float64) * 3.2 + 0.3 * torch.rand(3, 3, dtype=torch.float64)).requires_grad_(True)
    pbc = torch.tensor([True, True, True])
    assert torch.autograd.gradcheck(lambda x, c: aevc(species, x, c, pbc), (coords, cell), fast_mode=True)


def test_opcheck_every_op():
    ref = reference_model("ANI2x", torch.float64)
    for dtype in (torch.float32, torch.float64):
        args = aev_args(ref.potentials["nnp"].aev_computer, dtype)
        species, coords = small_system(dtype)
        cell = torch.eye(3, dtype=dtype) * 4.0
        pbc = torch.tensor([True, False, True])
        for c, p in ((None, None), (cell, pbc)):
            for cl in (False, True):
                torch.library.opcheck(torch.ops.torchani_fast.neighbor_pairs.default,
                                      (species, coords, c, p, 5.1, cl))
        pairs, _ = ops.neighbor_pairs(species, coords, None, None, 5.1, False)
        flat = coords.view(-1, 3)
        diff = flat[pairs[0]] - flat[pairs[1]]
        torch.library.opcheck(torch.ops.torchani_fast.aev.default, (species, pairs, diff, *args))
        torch.library.opcheck(torch.ops.torchani_fast.aev.default,
                              (species, pairs, diff.clone().requires_grad_(True), *args))
        grad = torch.randn(*species.shape, ref.potentials["nnp"].aev_computer.out_dim, dtype=dtype)
        torch.library.opcheck(torch.ops.torchani_fast.aev_backward.default,
                              (grad, species, pairs, diff, *args))
        # The pair the Autograd kernel of aev uses (called below autograd).
        _, edges = torch.ops.torchani_fast.aev_with_edges(species, pairs, diff, *args)
        torch.library.opcheck(torch.ops.torchani_fast.aev_with_edges.default,
                              (species, pairs, diff, *args))
        for d in (diff, diff.clone().requires_grad_(True)):
            torch.library.opcheck(torch.ops.torchani_fast.aev_backward_edges.default,
                                  (grad, edges, species, pairs, d, *args))


def test_int32_species_accepted():
    ref, fast = model_pair("ANI2x", torch.float64)
    species, coords = small_system()
    aevc = fast.potentials["nnp"].aev_computer
    torch.testing.assert_close(aevc(species.int(), coords), aevc(species, coords), rtol=0, atol=0)


def test_float32_computed_in_float32():
    ref, fast = model_pair("ANI2x", torch.float32)
    species, coords = small_system(torch.float32)
    out = fast.potentials["nnp"].aev_computer(species, coords)
    assert out.dtype == torch.float32


@pytest.mark.parametrize("dtype,delta", [(torch.float32, 3e-5), (torch.float32, "ulp"), (torch.float64, 2e-9)],
                         ids=["f32", "f32-one-ulp", "f64"])
def test_cutoff_tail_is_accurate(dtype, delta, device):
    # Just inside a cutoff, TorchANI's 0.5 cos(pi r / Rc) + 0.5 rounds to exactly 0
    # (float32: the last 7.8e-5 Rc; float64: 5e-9 Rc) while its slope does not.
    # Ours keeps the accurate value, sin^2(pi (Rc - r) / (2 Rc)), so that a
    # neighbour inside the cutoff never leaves its AEV block 0: FusedEnsemble's
    # rare-element split reads a zero block as "no such neighbour". "ulp": the
    # float32 distances one step below the cutoffs, where the blocks' terms
    # (1e-15 for the radial block here, at least 1e-29 for an angular block)
    # must also survive the float32 kernels' flushing of denormals (below
    # 1.2e-38).
    ref, fast = model_pair("ANI2x", dtype)
    aevc = fast.potentials["nnp"].aev_computer.to(device)
    ref_aevc = ref.potentials["nnp"].aev_computer
    rc_r, rc_a = float(ref_aevc.radial.cutoff), float(ref_aevc.angular.cutoff)
    # C at the origin; O just inside the radial cutoff, H just inside the angular
    # one, N at 1.1 A (so that the C has an (H, N) triple).
    species = torch.tensor([[6, 8, 1, 7]])
    if delta == "ulp":
        below = lambda rc: float(np.nextafter(np.float32(rc), np.float32(0)))  # noqa: E731
        r_r, r_a = below(rc_r), below(rc_a)
    else:
        r_r, r_a = rc_r * (1 - delta), rc_a * (1 - delta)
    coords = torch.tensor([[[0.0, 0.0, 0.0], [-r_r, 0.0, 0.0],
                            [r_a, 0.0, 0.0], [0.0, 1.1, 0.0]]], dtype=dtype)
    elem = ref.species_converter(species)
    x = coords.to(device).requires_grad_(True)
    aev = aevc(elem.to(device), x)
    (grad,) = torch.autograd.grad(aev.sum(), x)
    aev, grad = aev.detach().cpu()[0, 0], grad.cpu()
    # The O's radial block of the C: 0.25 exp(-eta (r - shift)^2) fc(r), in float64.
    r = torch.linalg.vector_norm(coords[0, 1]).double()
    # (with the cutoff as the kernels hold it: 5.1 rounded to float32 is 9.5e-8
    # below 5.1, a fifth of the one-ulp case's Rc - r)
    rc = float(np.float32(rc_r)) if dtype == torch.float32 else rc_r
    fc = torch.sin(torch.pi * (rc - r) / (2 * rc)) ** 2
    radial = ref_aevc.radial
    expected = 0.25 * torch.exp(-radial.eta.double() * (r - radial.shifts.double()) ** 2) * fc
    o_block = aev[3 * 16: 4 * 16].double()  # element order H C N O S F Cl
    assert o_block.max() > 0
    rtol = 2e-2 if dtype == torch.float32 else 1e-5  # (Rc - r) carries the rounding of r
    torch.testing.assert_close(o_block, expected, rtol=rtol, atol=1e-30 if dtype == torch.float32 else 1e-60)
    # The (H, N) angular block of the C is not 0 either; in float32 it matches
    # TorchANI in float64, whose own zero stretch is 1e4 times narrower.
    p = int(ref_aevc.triu_index[0, 2])
    hn_block = aev[7 * 16 + 32 * p: 7 * 16 + 32 * (p + 1)]
    assert (hn_block != 0).all()
    if dtype == torch.float32:
        ref64 = copy.deepcopy(ref_aevc).double()
        hn_ref = ref64(elem, coords.double())[0, 0, 7 * 16 + 32 * p: 7 * 16 + 32 * (p + 1)]
        torch.testing.assert_close(hn_block.double(), hn_ref, rtol=2e-2, atol=0)
    # The gradient is TorchANI's (whose slope there was always right).
    y = coords.clone().requires_grad_(True)
    (grad_ref,) = torch.autograd.grad(ref_aevc(elem, y).sum(), y)
    torch.testing.assert_close(grad, grad_ref, **tol(dtype))


def _aev_and_gradient(aev_computer, species, coords, cell, pbc, weights):
    """The AEV and d(sum weights * AEV)/d(coords) in coords' dtype."""
    x = coords.detach().clone().requires_grad_(True)
    c = None if cell is None else cell.to(coords.dtype)
    aev = aev_computer(species, x, c, pbc)
    (g,) = torch.autograd.grad((aev * weights.to(aev.dtype)).sum(), x)
    return aev.detach(), g


@pytest.mark.parametrize("model,name", [
    ("ANI2x", "2iuz_ligand.xyz"), ("ANI2x", "1hz5.xyz"), ("ANI2x", "water-0.8nm.xyz"),
    ("ANI2x", "tight_cell.xyz"), ("ANI2x", "3hkw_ligand.xyz"), ("ANI2x", "dense cluster"),
    ("ANI1x", "1hvj_ligand.xyz"), ("ANI1x", "benzene.xyz")])
def test_float32_aev_and_gradient_as_accurate_as_torchani_float32(model, name):
    # float32 takes the vectorised CPU kernels (on AVX2 CPUs: triples 8 to a
    # vector, neighbours sorted by species, polynomial cutoffs); ANI-1x has 8
    # angular sections per block, ANI-2x 4. Against TorchANI in float64 (autograd
    # through its featurizer), the error must stay within twice TorchANI's own
    # float32 error, for the AEV and for the gradient of a random linear form.
    ref64 = reference_model(model, torch.float64)
    ref32 = reference_model(model, torch.float32)
    fast = torchani_fast.patch(copy.deepcopy(ref32))
    if name == "dense cluster":  # 64 atoms of all 7 elements in a 4.5 A box: ~60 angular
        g = torch.Generator().manual_seed(5)  # neighbours, ~1800 triples per atom
        species = torch.tensor([[1, 6, 7, 8, 16, 9, 17, 1] * 8])
        coords = torch.rand(1, 64, 3, generator=g, dtype=torch.float64) * 4.5
        cell = pbc = None
    else:
        species, coords, cell, pbc = atoms_to_tensors(read_molecule(name), torch.float64)
    elem = ref64.species_converter(species)
    weights = torch.randn(*elem.shape, ref64.potentials["nnp"].aev_computer.out_dim,
                          generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    aev64, g64 = _aev_and_gradient(ref64.potentials["nnp"].aev_computer, elem, coords, cell,
                                   pbc, weights)
    results = {}
    for key, m in (("torchani", ref32), ("fast", fast)):
        results[key] = _aev_and_gradient(m.potentials["nnp"].aev_computer, elem,
                                         coords.to(torch.float32), cell, pbc, weights)
    assert results["fast"][1].dtype == torch.float32
    for k, expected in enumerate((aev64, g64)):
        err = {key: (r[k].double() - expected).abs().max().item() for key, r in results.items()}
        floor = 1e-6 * expected.abs().max().item()
        assert err["fast"] <= 2 * err["torchani"] + floor, (k, err)


def test_float32_coincident_atoms_match_float64():
    # Atoms 0 and 1 coincide: r = 0 (no radial direction) and r1 r2 < 1e-10 in
    # every triple of that pair (TorchANI's clamped cosine); float32 takes the
    # vectorised kernels, float64 the scalar ones.
    ref = reference_model("ANI2x", torch.float64)
    aevc = torchani_fast.patch(copy.deepcopy(ref)).potentials["nnp"].aev_computer
    species = torch.tensor([[0, 1, 0, 1, 3, 2]])
    coords = torch.tensor([[[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.1, 0.2, 0.0], [0.1, 1.3, 0.4],
                            [-0.9, 0.5, 0.3], [0.4, -1.0, 1.2]]], dtype=torch.float64)
    weights = torch.randn(1, 6, aevc.out_dim, generator=torch.Generator().manual_seed(4),
                          dtype=torch.float64)
    aev64, g64 = _aev_and_gradient(aevc, species, coords, None, None, weights)
    aev32, g32 = _aev_and_gradient(aevc.to(torch.float32), species, coords.float(), None, None,
                                   weights)
    assert torch.isfinite(g32).all() and g64.abs().max() > 1e6  # the clamped cosine's 1e10
    torch.testing.assert_close(aev32.double(), aev64, rtol=0, atol=2e-5)
    torch.testing.assert_close(g32.double(), g64, rtol=1e-4, atol=1e-4)


def test_workspace_reuses_memory_but_never_a_held_tensor():
    """Inside a Workspace the CPU AEV and the networks op's AEV gradient reuse
    their memory from one call to the next (csrc/common/workspace.h), only once
    nothing references it: outputs the caller keeps stay intact, and reused ones
    hold the new values (checked against TorchANI). Outside any workspace the
    ops keep nothing. small.xyz in float64: 2 MB per output."""
    ref, fast = model_pair("ANI2x", torch.float64)
    species, coords, _, _ = atoms_to_tensors(read_molecule("small.xyz"))
    elem = ref.species_converter(species)
    aevc, nets = fast.potentials["nnp"].aev_computer, fast.potentials["nnp"].neural_networks
    ref_aevc, ref_nets = ref.potentials["nnp"].aev_computer, ref.potentials["nnp"].neural_networks
    block = aevc(elem, coords).numel() * 8
    assert block > 2**20  # above the workspace's 1 MB threshold

    def aev_and_grad(model_aevc, model_nets, x):
        aev = model_aevc(elem, x)
        leaf = aev.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(model_nets(elem, leaf).sum(), leaf)
        return aev, grad

    geometries = [coords + 0.02 * k * torch.sin(torch.arange(coords.numel(), dtype=torch.float64)).view_as(coords)
                  for k in range(4)]
    workspace = torchani_fast.Workspace()
    aev_and_grad(aevc, nets, coords)
    assert workspace.nbytes == 0  # (calls outside it)
    with workspace:
        held = [aev_and_grad(aevc, nets, x) for x in geometries[:2]]  # both kept
        copies = [(a.clone(), g.clone()) for a, g in held]
        pointers = []
        for x in geometries[2:]:
            a, g = aev_and_grad(aevc, nets, x)  # results dropped at once: their memory is free to reuse
            pointers.append((a.data_ptr(), g.data_ptr()))
            del a, g
    assert pointers[0] == pointers[1]  # the fourth call reused the third's blocks
    assert workspace.nbytes == 2 * block  # one AEV and one AEV gradient held for the next call
    for (a, g), (a0, g0) in zip(held, copies):
        assert torch.equal(a, a0) and torch.equal(g, g0)
    assert not torch.equal(held[0][0], held[1][0])
    for x in geometries:
        expected = aev_and_grad(ref_aevc, ref_nets, x)
        with workspace:
            inside = aev_and_grad(aevc, nets, x)
        outside = aev_and_grad(aevc, nets, x)
        for got in (inside, outside):
            torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-12)
            # The fused networks skip an atom's 16-column AEV chunks that are zero (no
            # neighbours of that kind: the AEV's derivative there is zero too, so J is
            # not needed there); compare where the atom's chunk is nonzero.
            nonzero = expected[0].unflatten(-1, (-1, 16)).ne(0).any(-1, keepdim=True)
            used = nonzero.expand(*nonzero.shape[:-1], 16).flatten(-2)
            assert used.float().mean() > 0.2
            torch.testing.assert_close(got[1][used], expected[1][used], rtol=1e-10, atol=1e-12)
        assert torch.equal(inside[0], outside[0]) and torch.equal(inside[1], outside[1])


def test_workspace_is_current_in_the_thread_that_entered_it():
    """A workspace serves the calls of the thread inside its ``with`` block
    only; blocks nest; leaving one that is not the current one is an error."""
    _, fast = model_pair("ANI2x", torch.float64)
    species, coords, _, _ = atoms_to_tensors(read_molecule("small.xyz"))
    elem = fast.species_converter(species)
    aevc = fast.potentials["nnp"].aev_computer
    outer, inner = torchani_fast.Workspace(), torchani_fast.Workspace()
    with outer:
        thread = threading.Thread(target=lambda: aevc(elem, coords))
        thread.start()
        thread.join()
        assert outer.nbytes == 0  # another thread's call
        with inner:
            kept = aevc(elem, coords)
        assert inner.nbytes == kept.numel() * 8 and outer.nbytes == 0
        aevc(elem, coords)
        assert outer.nbytes == kept.numel() * 8
        with pytest.raises(RuntimeError, match="not the current one"):
            inner.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match="not the current one"):
        outer.__exit__(None, None, None)


def test_chunked_half_edges_same_bits_for_any_thread_count():
    """Above 16 384 pairs the CPU AEV ops build their half edges in parallel
    chunks of pairs (csrc/aev/half_edges.h), each atom's half edges still by
    neighbour species, each species in pair order: the AEV, its gradient and
    the second-derivative products give the same bits with 1, 2 and 4 threads
    (1 thread: one chunk, the serial order).
    A pair that indexes no atom is reported, the first one of all."""
    ref = reference_model("ANI2x", torch.float64)
    species, coords, _, _ = atoms_to_tensors(read_molecule("1hz5.xyz"), torch.float64)
    # A batch of two copies of 1hz5 (973 atoms), the second one displaced.
    species, coords = species.repeat(2, 1), torch.cat([coords, coords + 0.05 * torch.sin(coords)])
    elem = ref.species_converter(species)
    pairs, _ = ops.neighbor_pairs(elem, coords, None, None, 5.2, False)
    assert pairs.shape[1] > 2 * 16384
    flat = coords.view(-1, 3)
    results = {}
    for dtype in (torch.float32, torch.float64):
        diff = (flat[pairs[0]] - flat[pairs[1]]).to(dtype)
        args = aev_args(ref.potentials["nnp"].aev_computer, dtype)
        weights = torch.sin(torch.arange(elem.numel() * 1008, dtype=dtype)).view(1, -1, 1008)
        tangent = torch.cos(torch.arange(diff.numel(), dtype=dtype)).view_as(diff)
        threads = torch.get_num_threads()
        try:
            for n in (1, 2, 4):
                torch.set_num_threads(n)
                results[dtype, n] = (ops.aev(elem, pairs, diff, *args),
                                     ops.aev_backward(weights, elem, pairs, diff, *args),
                                     ops.aev_double_backward(weights, tangent, elem, pairs, diff, *args),
                                     ops.aev_jvp(tangent, elem, pairs, diff, *args))
        finally:
            torch.set_num_threads(threads)
        for n in (2, 4):
            for a, b in zip(results[dtype, 1], results[dtype, n]):
                assert torch.equal(a, b)
        assert results[dtype, 1][1].abs().sum() > 0
    bad = pairs.clone()
    first_bad, later_bad = 100, pairs.shape[1] - 100  # one in each of the two chunks
    bad[1, later_bad] = elem.numel() + 5
    bad[0, first_bad] = elem.numel() + 7
    diff = flat[pairs[0]] - flat[pairs[1]]
    args = aev_args(ref.potentials["nnp"].aev_computer, torch.float64)
    with pytest.raises(RuntimeError, match=f"pairs must index the {elem.numel()} flattened atoms, "
                                           f"got pair {first_bad} = \\({elem.numel() + 7}, "):
        ops.aev(elem, bad, diff, *args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backward_reuses_forward_half_edges_only_for_the_same_inputs(dtype):
    """The CPU forward hands its half edges to the backward of the same call
    through autograd (aev_with_edges returns their handle, which the Autograd
    kernel of aev saves; aev_backward_edges reads it: csrc/ops.h). The backward
    must then give the same bits as one that builds them anew, and must build
    them anew when handed the handle with other tensors, with the same tensor
    changed in place, with another radial cutoff, or a tensor that is not a
    handle (a copy of one): a stale handle would read the old vectors or drop
    other pairs. Nothing is kept between calls: an op called twice gives the
    same bits whatever ran in between."""
    ref = reference_model("ANI2x", torch.float64)
    species, coords, _, _ = atoms_to_tensors(read_molecule("3o99_ligand.xyz"), dtype)
    elem = ref.species_converter(species)
    pairs, _ = ops.neighbor_pairs(elem, coords, None, None, 5.2, False)
    flat = coords.view(-1, 3)
    args = aev_args(ref.potentials["nnp"].aev_computer, dtype)
    weights = torch.sin(torch.arange(elem.numel() * 1008, dtype=dtype)).view(1, -1, 1008)
    tf = torch.ops.torchani_fast

    def fresh(diff, *a):  # new tensors: no handle matches them
        return ops.aev_backward(weights, elem.clone(), pairs.clone(), diff.detach().clone(),
                                *(a or args))

    diff = (flat[pairs[0]] - flat[pairs[1]]).requires_grad_(True)
    # Through autograd: the forward's half edges.
    (got,) = torch.autograd.grad(ops.aev(elem, pairs, diff, *args), diff, weights)
    assert torch.equal(got, fresh(diff))
    # Two graphs alive at once, each with its own handle.
    other = (diff.detach() * 1.01).requires_grad_(True)
    aev = ops.aev(elem, pairs, diff, *args)
    aev_other = ops.aev(elem, pairs, other, *args)
    (got,) = torch.autograd.grad(aev, diff, weights)
    (got_other,) = torch.autograd.grad(aev_other, other, weights)
    assert torch.equal(got, fresh(diff)) and torch.equal(got_other, fresh(other))
    assert not torch.equal(got, got_other)
    # The ops themselves.
    aev, edges = tf.aev_with_edges(elem, pairs, diff, *args)
    assert torch.equal(aev, ops.aev(elem, pairs, diff.detach(), *args))
    assert edges.dtype == torch.uint8 and edges.shape == (0,)
    assert torch.equal(tf.aev_backward_edges(weights, edges, elem, pairs, diff, *args), fresh(diff))
    # Handed other vectors, a copy of the handle, or no handle: built anew.
    assert torch.equal(tf.aev_backward_edges(weights, edges, elem, pairs, other, *args), fresh(other))
    for not_ours in (edges.clone(), torch.empty(0, dtype=torch.uint8)):
        assert torch.equal(tf.aev_backward_edges(weights, not_ours, elem, pairs, diff, *args),
                           fresh(diff))
    # The same tensor, changed in place after the forward (pairs drop out of
    # the cutoff): the backward reads the new vectors.
    with torch.no_grad():
        diff.mul_(1.2)
    assert torch.equal(tf.aev_backward_edges(weights, edges, elem, pairs, diff, *args), fresh(diff))
    # Another radial cutoff for the same tensors.
    _, edges = tf.aev_with_edges(elem, pairs, diff, *args)
    shorter = args[:6] + [4.0, 3.5, args[8]]
    assert torch.equal(tf.aev_backward_edges(weights, edges, elem, pairs, diff, *shorter),
                       fresh(diff, *shorter))
    assert not torch.equal(fresh(diff, *shorter), fresh(diff))
