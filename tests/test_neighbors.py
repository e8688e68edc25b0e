"""The neighbour op against a brute-force oracle and TorchANI's all_pairs.

The oracle enumerates, for every pair of atoms of a molecule, the lattice images
near the minimum image (``n = m - rint(f_i - f_j)`` for a small box of ``m``), in
NumPy and with no binning or wrapping, so it shares no code path with the op.
Pair sets are compared as sorted (i, j, image) rows in one canonical orientation,
and distances pair by pair.
"""
import copy
import itertools
import math
import time

import numpy as np
import pytest
import torch
import torchani

import torchani_fast
from torchani_fast import ops
from torchani_fast.aev import CELL_LIST_MIN_ATOMS, NeighborList

from support import atoms_to_tensors, energy_forces, model_pair, read_molecule, reference_model

CUTOFF = 5.1
# Pairs this close to the cutoff may be kept by one method and not the other
# (different rounding); they contribute exactly zero to any AEV.
TIE = 1e-9

TRICLINIC = [[8.0, 0.0, 0.0], [2.5, 7.5, 0.0], [-1.5, 1.0, 7.0]]


# ----------------------------------------------------------------------------- oracle

def oracle(species, coords, cell, pbc, cutoff=CUTOFF):
    """Rows (i, j, n0, n1, n2) and distances of every pair within ``cutoff``.

    species (M, A), coords (M, A, 3) arrays; cell (3, 3) rows or None; pbc (3,).
    """
    species = np.asarray(species)
    coords = np.asarray(coords, dtype=np.float64)
    M, A = species.shape
    C = np.eye(3) if cell is None else np.asarray(cell, dtype=np.float64)
    per = np.zeros(3, bool) if cell is None else np.asarray(pbc, bool)
    inv = np.linalg.inv(C)
    # A pair closer than the cutoff differs by at most span[a] in fractional coordinate a.
    span = cutoff * np.linalg.norm(inv, axis=0)
    box = [range(-math.ceil(span[a] + 0.5), math.ceil(span[a] + 0.5) + 1) if per[a] else [0]
           for a in range(3)]
    rows, dists = [], []
    for mol in range(M):
        real = np.nonzero(species[mol] >= 0)[0]
        x = coords[mol, real]
        a, b = np.triu_indices(len(real))  # i <= j, the diagonal for self images
        dx = x[a] - x[b]
        near = np.where(per, -np.rint(dx @ inv), 0.0)  # image nearest to the pair
        for m in itertools.product(*box):
            n = near + np.array(m)
            self_pair = a == b
            # Self images: n != 0, and only one of n and -n.
            keep = ~self_pair | (np.sign(n[:, 0]) * 4 + np.sign(n[:, 1]) * 2 + np.sign(n[:, 2]) > 0)
            r = np.linalg.norm(dx + n @ C, axis=1)
            sel = keep & (r <= cutoff)
            rows.append(np.column_stack([real[a[sel]] + mol * A, real[b[sel]] + mol * A,
                                         n[sel].astype(np.int64)]))
            dists.append(r[sel])
    return canonical(np.concatenate(rows), np.concatenate(dists))


def canonical(rows, dists):
    """Orient every pair as i < j (or i == j with a lexicographically positive image),
    drop ties at the cutoff and sort."""
    rows = np.array(rows, dtype=np.int64).reshape(-1, 5)
    n = rows[:, 2:]
    neg = (n[:, 0] < 0) | ((n[:, 0] == 0) & ((n[:, 1] < 0) | ((n[:, 1] == 0) & (n[:, 2] < 0))))
    flip = (rows[:, 0] > rows[:, 1]) | ((rows[:, 0] == rows[:, 1]) & neg)
    rows[flip] = np.column_stack([rows[flip, 1], rows[flip, 0], -n[flip]])
    dists = np.asarray(dists, dtype=np.float64)
    keep = np.abs(dists - CUTOFF) > TIE
    rows, dists = rows[keep], dists[keep]
    order = np.lexsort(rows.T[::-1])
    return rows[order], dists[order]


def op_rows(species, coords, cell, pbc, cell_list, cutoff=CUTOFF):
    """Run the op and return canonical rows and distances (plus raw checks)."""
    pairs, images = ops.neighbor_pairs(species, coords, cell, pbc, cutoff, cell_list)
    assert pairs.dtype == torch.long and images.dtype == coords.dtype
    assert (pairs[0] <= pairs[1]).all()
    assert torch.equal(images, images.round())
    if cell is None:
        assert not images.any()
    else:  # no image along an aperiodic axis
        assert not images[:, ~pbc].any()
    flat = species.reshape(-1)
    assert (flat[pairs] >= 0).all(), "a padding atom was paired"
    assert (pairs[0] // species.shape[1] == pairs[1] // species.shape[1]).all(), \
        "a pair spans two molecules"
    x = coords.detach().reshape(-1, 3).double()
    diff = x[pairs[0]] - x[pairs[1]]
    if cell is not None:
        diff = diff + images.double() @ cell.double()
    rows = torch.cat([pairs.t(), images.round().long()], 1).numpy()
    return canonical(rows, diff.norm(dim=1).numpy())


def torchani_rows(species, coords, cell, pbc, cutoff=CUTOFF):
    """TorchANI's all_pairs as canonical rows; images recovered from its diff vectors."""
    nb = torchani.neighbors.all_pairs(cutoff, species, coords, cell, pbc)
    x = coords.detach().reshape(-1, 3).double()
    i, j = nb.indices
    shift = nb.diff_vectors.double() - (x[i] - x[j])
    if cell is None:
        images = torch.zeros_like(shift)
    else:
        images = shift @ torch.linalg.inv(cell.double())
    n = images.round()
    assert (images - n).abs().max() < 1e-6 if len(n) else True
    rows = torch.cat([nb.indices.t(), n.long()], 1).numpy()
    return canonical(rows, nb.distances.double().numpy())


def assert_same(got, expected, dist_tol=1e-10):
    rows_g, d_g = got
    rows_e, d_e = expected
    if rows_g.shape != rows_e.shape or not np.array_equal(rows_g, rows_e):
        sg = {tuple(r) for r in rows_g}
        se = {tuple(r) for r in rows_e}
        raise AssertionError(
            f"pair sets differ: {len(rows_g)} vs {len(rows_e)} pairs; extra {sorted(sg - se)[:5]}, "
            f"missing {sorted(se - sg)[:5]}"
        )
    np.testing.assert_allclose(d_g, d_e, rtol=0, atol=dist_tol)


def check_all(species, coords, cell=None, pbc=None, torchani_too=True, dist_tol=1e-10):
    """Oracle, both strategies and (for one molecule or no pbc) TorchANI agree."""
    expected = oracle(species.numpy(), coords.numpy(), None if cell is None else cell.numpy(),
                      None if pbc is None else pbc.numpy())
    got_all = op_rows(species, coords, cell, pbc, cell_list=False)
    got_cells = op_rows(species, coords, cell, pbc, cell_list=True)
    assert_same(got_all, expected, dist_tol)
    assert_same(got_cells, expected, dist_tol)
    # The two strategies find the very same pairs, images included.
    assert np.array_equal(got_all[0], got_cells[0])
    if torchani_too:
        assert_same(torchani_rows(species, coords, cell, pbc), expected, dist_tol)
    return expected


# ----------------------------------------------------------------------------- systems

def random_box(rng, n, cell, dtype=torch.float64):
    """n atoms uniformly in the cell (species 0..3), as (1, n) / (1, n, 3) tensors."""
    cell = torch.as_tensor(cell, dtype=dtype)
    frac = torch.as_tensor(rng.uniform(size=(n, 3)), dtype=dtype)
    species = torch.as_tensor(rng.integers(0, 4, size=(1, n)))
    return species, (frac @ cell).unsqueeze(0), cell


def periodic(name, dtype=torch.float64):
    species, coords, cell, pbc = atoms_to_tensors(read_molecule(name), dtype)
    return species, coords, cell, pbc


def to_triclinic(coords, cell, new_cell):
    """Same fractional coordinates in another cell."""
    new_cell = torch.as_tensor(new_cell, dtype=coords.dtype)
    return coords @ torch.linalg.inv(cell) @ new_cell, new_cell


ALL = torch.tensor([True, True, True])


# ----------------------------------------------------------------------------- pair sets

def test_nonperiodic_batch_with_padding():
    rng = np.random.default_rng(0)
    species = torch.as_tensor(rng.integers(0, 4, size=(3, 40)))
    coords = torch.as_tensor(rng.uniform(-6, 6, size=(3, 40, 3)))
    species[1, 25:] = -1
    species[2, ::3] = -1  # padding in the middle too
    coords[1, 25:] = coords[1, 0]  # padding on top of a real atom
    check_all(species, coords)


def test_nonperiodic_large_uses_bins():
    # Above CELL_LIST_MIN_ATOMS, sparse and elongated (the bin grid is capped).
    rng = np.random.default_rng(1)
    n = CELL_LIST_MIN_ATOMS + 44
    coords = torch.as_tensor(rng.uniform(0, 1, size=(1, n, 3)) * np.array([400.0, 12.0, 9.0]))
    species = torch.zeros(1, n, dtype=torch.long)
    check_all(species, coords)


def test_batch_of_binned_molecules_any_thread_count():
    """Cell lists for a batch whose chunks of atoms (csrc/neighbors/neighbors_cpu.cpp,
    about N / (2 threads), 64-256 atoms) straddle molecules, with padding
    inside: the scan of each bin starts at its first atom j >= i, kept per bin
    of the current molecule as i grows, so a start carried over from another
    molecule or a skipped padding atom would lose or add pairs."""
    rng = np.random.default_rng(12)
    M, A = 3, 300
    species = torch.as_tensor(rng.integers(0, 4, size=(M, A)))
    coords = torch.as_tensor(rng.uniform(0, 16, size=(M, A, 3)))
    species[0, 150:170] = -1
    species[1, ::7] = -1
    coords[2] = coords[0] + 0.2  # the same bins as molecule 0: nothing carried over
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            check_all(species, coords, torchani_too=False)
    finally:
        torch.set_num_threads(before)


def test_nonperiodic_degenerate_extents():
    # All atoms on a plane, on a line, a single atom, an empty molecule.
    species = torch.zeros(4, 30, dtype=torch.long)
    rng = np.random.default_rng(2)
    coords = torch.as_tensor(rng.uniform(0, 15, size=(4, 30, 3)))
    coords[0, :, 2] = 1.0
    coords[1, :, 1:] = 0.0
    species[2, 1:] = -1
    species[3] = -1
    check_all(species, coords)


@pytest.mark.parametrize("name", ["water-0.8nm.xyz", "benzene.xyz", "tight_cell.xyz"])
def test_periodic_molecules(name):
    check_all(*periodic(name))


def test_triclinic_cells():
    species, coords, cell, pbc = periodic("water-0.8nm.xyz")
    coords, cell = to_triclinic(coords, cell, TRICLINIC)
    check_all(species, coords, cell, pbc)
    # A strongly sheared cell whose nearest images are not along the cell vectors.
    rng = np.random.default_rng(3)
    species, coords, cell = random_box(rng, 60, [[11.0, 0, 0], [9.0, 6.0, 0], [-7.5, 4.0, 6.5]])
    check_all(species, coords, cell, ALL)


@pytest.mark.parametrize("pbc", [[True, True, False], [True, False, False], [False, True, False],
                                 [False, False, True], [False, True, True]])
def test_per_axis_pbc(pbc):
    pbc = torch.tensor(pbc)
    species, coords, cell, _ = periodic("water-0.8nm.xyz")
    coords, cell = to_triclinic(coords, cell, TRICLINIC)
    # Spread the aperiodic axes beyond the cell, as a slab or wire would be.
    frac = torch.rand(coords.shape, generator=torch.Generator().manual_seed(0), dtype=coords.dtype)
    coords = coords + (2 * frac * (~pbc).to(coords.dtype)) @ cell
    # TorchANI's map_to_central restores the Cartesian components of aperiodic
    # *lattice* axes, which is only a lattice translation in an orthorhombic cell:
    # here it is compared on the orthorhombic cell only.
    check_all(species, coords, cell, pbc, torchani_too=False)
    ortho = torch.diag(torch.linalg.norm(cell, dim=1))
    check_all(species, coords @ torch.linalg.inv(cell) @ ortho, ortho, pbc)


@pytest.mark.parametrize("edge", [1.3, 2.9, 4.0, 6.0, 9.5])
def test_cells_smaller_than_twice_the_cutoff(edge):
    # Several images of every atom, its own included.
    rng = np.random.default_rng(int(edge * 10))
    cell = np.array(TRICLINIC) * edge / 8.0
    species, coords, cell = random_box(rng, 4 if edge < 3 else 12, cell)
    expected = check_all(species, coords, cell, ALL)
    self_images = expected[0][expected[0][:, 0] == expected[0][:, 1]]
    shortest = torch.linalg.norm(cell, dim=1).min().item()
    assert (len(self_images) > 0) == (shortest <= CUTOFF)


def test_single_atom_in_tiny_cell():
    # One atom and its own images only: count them by brute force.
    cell = torch.eye(3, dtype=torch.float64) * 2.0
    species = torch.zeros(1, 1, dtype=torch.long)
    coords = torch.full((1, 1, 3), 0.3, dtype=torch.float64)
    rows, _ = check_all(species, coords, cell, ALL)
    k = np.arange(-3, 4)
    n = np.stack(np.meshgrid(k, k, k), -1).reshape(-1, 3)
    r = np.linalg.norm(n * 2.0, axis=1)
    assert len(rows) == ((r > 0) & (r <= CUTOFF)).sum() // 2


def test_coordinates_far_outside_the_cell():
    species, coords, cell, pbc = periodic("water-0.8nm.xyz")
    coords, cell = to_triclinic(coords, cell, TRICLINIC)
    inside = check_all(species, coords, cell, pbc)
    rng = np.random.default_rng(4)
    k = torch.as_tensor(rng.integers(-60, 61, size=(coords.shape[1], 3)), dtype=coords.dtype)
    moved = coords + (k @ cell).unsqueeze(0)
    outside = check_all(species, moved, cell, pbc, dist_tol=1e-9)
    # Same distances; each image changes by the translations of its two atoms.
    np.testing.assert_allclose(np.sort(outside[1]), np.sort(inside[1]), rtol=0, atol=1e-9)
    # Exactly on a cell face, and a hair below zero (rounds up to 1 in fractional).
    edge = coords.clone()
    edge[0, 0] = cell[0] + cell[1]
    edge[0, 1] = -1e-17 * cell[2]
    check_all(species, edge, cell, pbc)


def test_periodic_padded_batch_each_molecule_alone():
    # TorchANI's all_pairs ignores molecules after the first under pbc, so each
    # molecule is compared with TorchANI alone, and the batch with the oracle.
    species, coords, cell, pbc = periodic("water-0.8nm.xyz")
    coords, cell = to_triclinic(coords, cell, TRICLINIC)
    A = coords.shape[1]
    g = torch.Generator().manual_seed(5)
    batch_species = species.repeat(3, 1)
    batch_coords = coords.repeat(3, 1, 1)
    batch_coords[1] += torch.randn(A, 3, generator=g, dtype=coords.dtype) * 0.3
    batch_coords[2] += 17.0  # out of the cell
    batch_species[1, 20:] = -1
    batch_species[2, :7] = -1
    expected = check_all(batch_species, batch_coords, cell, pbc, torchani_too=False)
    for m in range(3):
        real = batch_species[m] >= 0
        alone = torchani_rows(batch_species[m][real][None], batch_coords[m][real][None], cell, pbc)
        mine = expected[0][expected[0][:, 0] // A == m]
        # map the batch's flat indices to the molecule's compacted indices
        index = torch.full((A,), -1, dtype=torch.long)
        index[real] = torch.arange(int(real.sum()))
        mapped = mine.copy()
        mapped[:, 0] = index[mine[:, 0] - m * A].numpy()
        mapped[:, 1] = index[mine[:, 1] - m * A].numpy()
        assert np.array_equal(canonical(mapped, np.zeros(len(mapped)))[0],
                              alone[0])


def test_strategies_agree_on_a_large_box():
    # Many bins per axis, atoms out of the cell, float32: identical pairs and images.
    rng = np.random.default_rng(6)
    for dtype in (torch.float64, torch.float32):
        cell = [[18.0, 0, 0], [3.0, 17.0, 0], [2.0, -2.5, 16.0]]
        species, coords, cell = random_box(rng, 450, cell, dtype)
        coords[0, ::5] += 3 * cell[0] - 2 * cell[2]
        args = (species, coords, cell, ALL, CUTOFF)
        p1, i1 = ops.neighbor_pairs(*args, False)
        p2, i2 = ops.neighbor_pairs(*args, True)
        r1 = canonical(torch.cat([p1.t(), i1.long()], 1).numpy(), np.zeros(p1.shape[1]))[0]
        r2 = canonical(torch.cat([p2.t(), i2.long()], 1).numpy(), np.zeros(p2.shape[1]))[0]
        assert np.array_equal(r1, r2)
        if dtype == torch.float64:
            assert_same(op_rows(species, coords, cell, ALL, True),
                        oracle(species.numpy(), coords.numpy(), cell.numpy(), [True] * 3))


def test_neighborlist_module_strategies():
    species, coords, cell, pbc = periodic("benzene.xyz")
    results = []
    for strategy in ("all_pairs", "cell_list", "auto"):
        nb = NeighborList(strategy)(CUTOFF, species, coords, cell, pbc)
        results.append(nb)
        # pair_vectors' lengths: sqrt(x^2 + y^2 + z^2), within 2 ulp of torch.norm's
        eps = torch.finfo(nb.distances.dtype).eps
        torch.testing.assert_close(nb.distances, nb.diff_vectors.norm(dim=1), rtol=2 * eps, atol=0)
    for nb in results[1:]:
        assert torch.equal(nb.indices, results[0].indices)
        torch.testing.assert_close(nb.diff_vectors, results[0].diff_vectors, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="strategy"):
        NeighborList("verlet")


def test_deterministic_across_thread_counts():
    rng = np.random.default_rng(7)
    species, coords, cell = random_box(rng, 500, np.eye(3) * 17.0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = ops.neighbor_pairs(species, coords, cell, ALL, CUTOFF, True)
        torch.set_num_threads(2)
        b = ops.neighbor_pairs(species, coords, cell, ALL, CUTOFF, True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def reference_pair_vectors(coords, pairs, images, cell):
    """pair_vectors in plain ATen ops (what the op replaces)."""
    diff = coords[pairs[0]] - coords[pairs[1]]
    if cell is not None:
        diff = diff + images @ cell
    return diff, diff.norm(2, -1)


def pair_vector_case(dtype, periodic):
    rng = np.random.default_rng(11)
    cell = torch.tensor([[6.0, 0, 0], [1.0, 5.5, 0], [0.5, -1.0, 6.5]], dtype=dtype)
    species, coords, cell = random_box(rng, 30, cell, dtype)
    c, p = (cell, ALL) if periodic else (None, None)
    pairs, images = ops.neighbor_pairs(species, coords, c, p, CUTOFF, False)
    return coords.view(-1, 3), pairs, (images if periodic else None), c


@pytest.mark.parametrize("periodic", [False, True])
def test_pair_vectors_match_aten_and_differentiate(periodic):
    """Values, first and second derivatives (w.r.t. coords and cell, through the
    vectors and the lengths) against the ATen expression it replaces."""
    for dtype in (torch.float32, torch.float64):
        x, pairs, images, cell = pair_vector_case(dtype, periodic)
        assert pairs.shape[1] > 100 and (images is None or images.abs().sum() > 0)
        got, expected = ops.pair_vectors(x, pairs, images, cell), reference_pair_vectors(x, pairs, images, cell)
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=8 * eps * float(x.abs().max()))
        torch.testing.assert_close(got[1], expected[1], rtol=8 * eps, atol=8 * eps)
        # First derivative, each output alone and both: equal to autograd through ATen.
        leaves = (x.clone().requires_grad_(),) + ((cell.clone().requires_grad_(),) if periodic else ())
        for weights in ((1.0, 0.0), (0.0, 1.0), (0.7, -1.3)):
            grads = []
            for fn in (ops.pair_vectors, reference_pair_vectors):
                d, r = fn(leaves[0], pairs, images, leaves[1] if periodic else None)
                gd = torch.linspace(-1, 1, d.numel(), dtype=dtype).view_as(d)
                loss = weights[0] * (gd * d).sum() + weights[1] * (r * r.flip(0)).sum()
                grads.append(torch.autograd.grad(loss, leaves))
            for a, b in zip(*grads):
                torch.testing.assert_close(a, b, rtol=64 * eps, atol=64 * eps * float(b.abs().max()))
    x, pairs, images, cell = pair_vector_case(torch.float64, periodic)
    x = x[: int(pairs.max()) + 1].clone().requires_grad_()
    inputs = (x, cell.clone().requires_grad_()) if periodic else (x,)

    def both(x, c=None):
        return ops.pair_vectors(x, pairs, images, c)

    assert torch.autograd.gradcheck(both, inputs)
    assert torch.autograd.gradgradcheck(both, inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pair_vectors_backward_sums_in_pair_order(dtype):
    """pair_vectors_backward adds each pair's gradient to its first atom and
    subtracts it from its second, every atom's terms in pair order (the same
    bits for any thread count): equal to that sequence written out, for a cell
    smaller than the cutoff (atoms paired with their own images), the pairs in
    the search's order (an atom's pairs together), shuffled and swapped."""
    rng = np.random.default_rng(13)
    cell = [[3.2, 0, 0], [0.6, 3.0, 0], [0.3, -0.4, 3.4]]
    species, coords, cell = random_box(rng, 12, cell, dtype)
    pairs, _ = ops.neighbor_pairs(species, coords, cell, ALL, CUTOFF, True)
    assert int((pairs[0] == pairs[1]).sum()) > 0
    n = coords.shape[1]
    grad = torch.as_tensor(rng.normal(size=(pairs.shape[1], 3)), dtype=dtype)
    order = torch.as_tensor(rng.permutation(pairs.shape[1]))
    for p, g in ((pairs, grad), (pairs[:, order], grad[order]), (pairs.flip(0), grad)):
        expected = torch.zeros(n, 3, dtype=dtype)
        for k in range(p.shape[1]):
            expected[p[0, k]] += g[k]
            expected[p[1, k]] -= g[k]
        assert torch.equal(torch.ops.torchani_fast.pair_vectors_backward(g, p, n), expected)


def test_pair_vectors_opcheck_and_errors():
    for periodic in (False, True):
        x, pairs, images, cell = pair_vector_case(torch.float64, periodic)
        torch.library.opcheck(torch.ops.torchani_fast.pair_vectors.default, (x, pairs, images, cell))
        torch.library.opcheck(torch.ops.torchani_fast.pair_vectors.default,
                              (x.clone().requires_grad_(), pairs, images, cell))
        diff, _ = ops.pair_vectors(x, pairs, images, cell)
        torch.library.opcheck(torch.ops.torchani_fast.pair_vectors_backward.default,
                              (torch.randn_like(diff), pairs, x.shape[0]))
    x, pairs, images, cell = pair_vector_case(torch.float64, True)
    bad = pairs.clone()
    bad[1, 3] = x.shape[0]
    with pytest.raises(RuntimeError, match=f"pairs must index the {x.shape[0]} atoms, got {x.shape[0]}"):
        ops.pair_vectors(x, bad, images, cell)
    with pytest.raises(RuntimeError, match="images and cell must be given together"):
        torch.ops.torchani_fast.pair_vectors(x, pairs, images, None)
    with pytest.raises(RuntimeError, match="cell must be a \\(3, 3\\) tensor of the coords' dtype"):
        ops.pair_vectors(x, pairs, images, cell.float())
    diff, _ = ops.pair_vectors(x, pairs, images, cell)
    backward = torch.ops.torchani_fast.pair_vectors_backward
    with pytest.raises(RuntimeError, match="pair_vectors_backward: pairs must index the 5 atoms"):
        backward(diff, pairs, 5)
    with pytest.raises(RuntimeError, match="grad must be a float \\(" + str(diff.shape[0]) + ", 3\\) tensor"):
        backward(diff[:-1], pairs, x.shape[0])


def test_errors_name_the_problem():
    species = torch.zeros(1, 3, dtype=torch.long)
    coords = torch.zeros(1, 3, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="singular"):
        ops.neighbor_pairs(species, coords, torch.zeros(3, 3, dtype=torch.float64), ALL, CUTOFF,
                           True)
    bad = coords.clone()
    bad[0, 1, 0] = float("nan")
    with pytest.raises(RuntimeError, match="finite"):
        ops.neighbor_pairs(species, bad, None, None, CUTOFF, True)
    with pytest.raises(RuntimeError, match="cutoff"):
        ops.neighbor_pairs(species, coords, None, None, -1.0, True)


@pytest.mark.parametrize("cell_list", [False, True])
def test_cell_far_smaller_than_the_cutoff_is_refused_at_once(cell_list):
    # A 1e-4 A cube with a 5.2 A cutoff: 52 000 images along each vector, 1e14
    # in all. The search used to accept it (each axis below 1e5) and ran for
    # hours; it refuses it now, and a patched model passes the error on.
    species = torch.zeros(1, 2, dtype=torch.long)
    coords = torch.tensor([[[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]], dtype=torch.float64)
    tiny = torch.eye(3, dtype=torch.float64) * 1e-4
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"cell is too small for the cutoff: the search around "
                                           r"each atom would visit 1\.\d+e\+15 periodic images"):
        ops.neighbor_pairs(species, coords, tiny, ALL, CUTOFF, cell_list)
    with pytest.raises(RuntimeError, match="cell is too small for the cutoff"):
        ops.neighbor_pairs_padded(species, coords, tiny, ALL, CUTOFF, cell_list, 100)
    assert time.perf_counter() - t0 < 5
    # Below the limit: a 0.5 A cube (23^3 images visited) gives every image pair.
    small = torch.eye(3, dtype=torch.float64) * 0.5
    pairs, _ = ops.neighbor_pairs(species[:, :1], coords[:, :1], small, ALL, CUTOFF, cell_list)
    k = np.arange(-11, 12)
    n = np.stack(np.meshgrid(k, k, k), -1).reshape(-1, 3)
    r = np.linalg.norm(n * 0.5, axis=1)
    assert pairs.shape[1] == ((r > 0) & (r <= CUTOFF)).sum() // 2


def test_model_refuses_a_cell_far_smaller_than_the_cutoff():
    _, fast = model_pair("ANI2x", torch.float64)
    species = torch.tensor([[8, 1, 1]])
    coords = torch.tensor([[[0.0, 0.0, 0.1], [0.0, 0.75, -0.47], [0.0, -0.75, -0.47]]],
                          dtype=torch.float64)
    cell, pbc = torch.eye(3, dtype=torch.float64) * 0.01, torch.ones(3, dtype=torch.bool)
    # The model refuses it before any search (validation.check_periodic_work) ...
    with pytest.raises(ValueError, match="cell is too small for the cutoff.*nm or bohr"):
        fast((species, coords), cell=cell, pbc=pbc)
    # ... and the op itself still bounds its work.
    with pytest.raises(RuntimeError, match="cell is too small for the cutoff"):
        ops.neighbor_pairs(fast.species_converter(species), coords, cell, pbc, 5.1, False)


# ----------------------------------------------------------------------------- energies

@pytest.fixture(scope="module")
def models():
    ref = reference_model("ANI2x", torch.float64)
    return ref, torchani_fast.patch(copy.deepcopy(ref))


def assert_energy_forces(got, expected):
    (e1, f1), (e0, f0) = got, expected
    torch.testing.assert_close(e1, e0, rtol=1e-10, atol=0)
    torch.testing.assert_close(f1, f0, rtol=0, atol=1e-9)


def wrap(coords, cell):
    """Every atom translated into the cell (along all three lattice vectors)."""
    frac = coords @ torch.linalg.inv(cell)
    return (frac - frac.floor()) @ cell


def periodic_cases():
    """name -> (species, coords, cell, pbc, coords given to TorchANI)."""
    species, coords, cell, pbc = periodic("water-0.8nm.xyz")
    tri_coords, tri_cell = to_triclinic(coords, cell, TRICLINIC)
    rng = np.random.default_rng(8)
    k = torch.as_tensor(rng.integers(-40, 41, size=(coords.shape[1], 3)), dtype=coords.dtype)
    # Partial pbc in a triclinic cell: TorchANI's map_to_central is only a lattice
    # translation when the coordinates already lie in the cell, so it gets them
    # wrapped, and ours also gets them moved along the periodic axis.
    wire = wrap(tri_coords, tri_cell)
    wire_pbc = torch.tensor([False, True, False])
    along_y = k * wire_pbc.to(k.dtype)
    cases = {
        "benzene": periodic("benzene.xyz"),
        "tight_cell": periodic("tight_cell.xyz"),
        "water_small_cell": (species, coords, cell, pbc),
        "water_triclinic": (species, tri_coords, tri_cell, pbc),
        "water_triclinic_far_outside": (species, tri_coords + (k @ tri_cell)[None], tri_cell, pbc),
        "water_slab": (species, coords, cell, torch.tensor([True, True, False])),
        "water_triclinic_wire": (species, wire + (along_y @ tri_cell)[None], tri_cell, wire_pbc),
    }
    out = {name: (*case, case[1]) for name, case in cases.items()}
    out["water_triclinic_wire"] = (*cases["water_triclinic_wire"], wire)
    return out


_REFERENCE = {}


def reference_energy_forces(ref, case):
    if case not in _REFERENCE:  # once for both strategies
        species, _, cell, pbc, ref_coords = periodic_cases()[case]
        _REFERENCE[case] = energy_forces(ref, species, ref_coords, cell, pbc)
    return _REFERENCE[case]


# Both strategies give identical pair sets (tested above): energies with the cell
# list for the cases where it has most to get wrong.
ENERGY_CASES = [(case, "auto") for case in periodic_cases()] + [
    (case, "cell_list") for case in ("benzene", "water_triclinic_far_outside",
                                      "water_triclinic_wire")]


@pytest.mark.parametrize("case,strategy", ENERGY_CASES)
def test_energies_forces_match_torchani(models, case, strategy):
    ref, fast = models
    species, coords, cell, pbc, _ = periodic_cases()[case]
    fast.neighborlist.set_strategy(strategy)
    try:
        got = energy_forces(fast, species, coords, cell, pbc)
    finally:
        fast.neighborlist.set_strategy("auto")
    assert_energy_forces(got, reference_energy_forces(ref, case))


def test_periodic_padded_batch_energies(models):
    ref, fast = models
    species, coords, cell, pbc = periodic("water-0.8nm.xyz")
    coords, cell = to_triclinic(coords, cell, TRICLINIC)
    A = coords.shape[1]
    batch_species = species.repeat(3, 1)
    batch_coords = coords.repeat(3, 1, 1)
    batch_coords[1] += torch.randn(A, 3, generator=torch.Generator().manual_seed(9),
                                   dtype=coords.dtype) * 0.1
    batch_coords[2] -= 2.5 * cell[1]
    batch_species[1, 21:] = -1
    batch_species[2, :6] = -1
    e, f = energy_forces(fast, batch_species, batch_coords, cell, pbc)
    for m in range(3):
        real = batch_species[m] >= 0
        e0, f0 = energy_forces(ref, batch_species[m][real][None], batch_coords[m][real][None],
                               cell, pbc)
        torch.testing.assert_close(e[m:m + 1], e0, rtol=1e-10, atol=0)
        torch.testing.assert_close(f[m][real][None], f0, rtol=0, atol=1e-9)
        assert not f[m][~real].any()


@pytest.mark.parametrize("strategy", ["all_pairs", "cell_list"])
def test_padded_search_returns_its_count_and_keeps_nothing(strategy):
    """NeighborList.padded: the exact list's pairs in max_pairs slots (the rest
    -1), and the pair count as a tensor, which check_num_pairs reads (an
    overflow raises there, naming the count). The module keeps no state from a
    call (no buffer, no attribute), eager or scripted; the infinite cutoff of
    UnboundedNeighborList gives every pair of a molecule here too."""
    from torchani_fast.potentials import UnboundedNeighborList

    species, coords, cell, pbc = atoms_to_tensors(read_molecule("water-0.8nm.xyz"), torch.float64)
    nl = NeighborList(strategy)
    before = (dict(nl.named_buffers()), dict(vars(nl)))
    exact = nl(CUTOFF, species.clamp(max=0), coords, cell, pbc)
    n = exact.indices.shape[1]
    for module in (nl, "scripted"):
        if module == "scripted":
            assert (dict(nl.named_buffers()), dict(vars(nl))) == before  # the eager calls kept nothing
            module = torch.jit.script(nl)
        neighbors, count = module.padded(CUTOFF, species.clamp(max=0), coords, cell, pbc, n + 7)
        assert ops.check_num_pairs(count, n + 7) == n
        got = neighbors.indices
        assert got.shape == (2, n + 7) and bool((got[:, n:] == -1).all())
        assert sorted(map(tuple, got[:, :n].t().tolist())) == sorted(map(tuple, exact.indices.t().tolist()))
        torch.testing.assert_close(neighbors.distances[:n].sort().values, exact.distances.sort().values,
                                   rtol=0, atol=1e-12)
        _, small = module.padded(CUTOFF, species.clamp(max=0), coords, cell, pbc, n - 1)
        with pytest.raises(RuntimeError, match=f"{n} pairs do not fit in max_pairs={n - 1}"):
            ops.check_num_pairs(small, n - 1)
        with pytest.raises((ValueError, torch.jit.Error), match="max_pairs must be > 0, got 0"):
            module.padded(CUTOFF, species, coords, cell, pbc, 0)
    molecule = coords[:, :9]
    everything, count = UnboundedNeighborList(strategy).padded(
        float("inf"), species[:, :9].clamp(max=0), molecule, None, None, 64)
    assert ops.check_num_pairs(count, 64) == 9 * 8 // 2
