"""The two-launch CUDA neighbour search and the CUDA pair vectors, run in the CPU emulator.

Against the CPU ops: the same pairs in the same order (rows that overflow their
64 slots included), the same distances (float64, 1e-12 relative), and a backward
gather (the force scatter) equal to the CPU's bit for bit, run after run. The
basic search cases (every system of support_cuda, cell_list on and off, the
padded op, errors) are in test_cuda_emulated.py. Runs only when
TORCHANI_FAST_EMULATE_CUDA=1 (see tests/cuda_emulation).
"""
import os
import sys
from pathlib import Path

import pytest
import torch

from torchani_fast import ops

pytestmark = pytest.mark.skipif(
    os.environ.get("TORCHANI_FAST_EMULATE_CUDA") != "1",
    reason="set TORCHANI_FAST_EMULATE_CUDA=1 to run the CUDA kernels in the CPU emulator",
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from support_cuda import CUTOFF, SYSTEMS, to  # noqa: E402

ROW = 64  # slots of an atom's row in neighbor_rows_cuda.cu (kRow)
EDGES = 96  # half edges of an atom's row in pair_vectors_cuda.cu (kEdges)


@pytest.fixture(scope="module")
def emu():
    sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_emulation"))
    import build

    return build.load()


def _needs_new_path():
    if os.environ.get("TORCHANI_FAST_CUDA_NEIGHBORS", "new") == "old":
        pytest.skip("TORCHANI_FAST_CUDA_NEIGHBORS=old selects the old search")


def _dense_cell():
    """tiny_cell shrunk to 3/4: each atom owns more partners (images) than a row holds."""
    species, coords, cell, pbc = SYSTEMS["tiny_cell"]
    return species, 0.75 * coords, 0.75 * cell, pbc


def _system(name):
    return to(_dense_cell() if name == "dense_cell" else SYSTEMS[name], "cpu", torch.float64)


def _vectors(system, pairs, images):
    species, coords, cell, pbc = system
    return (coords.reshape(-1, 3), pairs, None if cell is None else images, cell)


@pytest.mark.parametrize("cell_list", [False, True])
@pytest.mark.parametrize("name", ["molecule46", "padded_batch", "triclinic_xy", "dense_cell"])
def test_same_list_as_cpu(emu, name, cell_list):
    _needs_new_path()
    system = _system(name)
    pairs, images = emu.neighbor_pairs(*system, CUTOFF, cell_list)
    ref, ref_images = ops.neighbor_pairs(*system, CUTOFF, cell_list)
    # dense_cell: some atom owns more pairs than its row holds (the second walk).
    owned = torch.bincount(ref[0])
    assert (int(owned.max()) > ROW) == (name == "dense_cell")
    # The same set as the CPU, in the canonical order (by first atom, then (j, image)).
    order = torch.argsort(ref[0] * (1 << 40) + ref[1] * (1 << 20)
                          + (ref_images.round().long() + 64) @ torch.tensor([1 << 14, 1 << 7, 1]))
    assert torch.equal(pairs, ref[:, order]) and torch.equal(images, ref_images[order])
    # Cut inside the largest row: its smallest pairs are kept, in order.
    big = int(owned.argmax())
    cut = int(owned[:big].sum()) + min(ROW, int(owned[big])) - 3
    padded, padded_images, num = emu.neighbor_pairs_padded(*system, CUTOFF, cell_list, cut)
    assert int(num) == pairs.shape[1]
    assert torch.equal(padded, pairs[:, :cut]) and torch.equal(padded_images, images[:cut])
    # Same distances as the CPU's pair_vectors, in float64 to 1e-12.
    diff, dist = emu.pair_vectors(*_vectors(system, pairs, images))
    ref_diff, ref_dist = ops.pair_vectors(*_vectors(system, ref[:, order], ref_images[order]))
    torch.testing.assert_close(diff, ref_diff, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dist, ref_dist, rtol=1e-12, atol=0)
    assert float(dist.max()) <= CUTOFF


def test_pair_vectors_padding_and_bad_indices(emu):
    species, coords, cell, pbc = to(SYSTEMS["water192"], "cpu", torch.float64)
    small = coords[:, :12]
    pairs = torch.tensor([[0, 3, -1, -1], [5, 3, -1, -1]])
    images = torch.tensor([[0.0, 0, 0], [1, 0, -1], [0, 0, 0], [0, 0, 0]], dtype=torch.float64)
    diff, dist = emu.pair_vectors(small.reshape(-1, 3), pairs, images, cell)
    ref_diff, ref_dist = ops.pair_vectors(small.reshape(-1, 3), pairs[:, :2], images[:2], cell)
    torch.testing.assert_close(diff[:2], ref_diff, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dist[:2], ref_dist, rtol=1e-12, atol=0)
    assert bool((diff[2:] == 0).all()) and bool((dist[2:] == 0).all())  # (-1, -1): padding
    diff, dist = emu.pair_vectors(small.reshape(-1, 3), torch.tensor([[0, 12], [1, 2]]), None, None)
    assert bool(diff[0].isfinite().all()) and bool(diff[1].isnan().all()) and bool(dist[1].isnan())
    grad = emu.pair_vectors_backward(torch.ones(2, 3, dtype=torch.float64),
                                     torch.tensor([[0, 12], [1, 2]]), 12)
    assert bool(grad.isnan().all())  # an index outside [0, N): every atom poisoned, not skipped


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backward_gather_is_the_cpu_one_bit_for_bit(emu, dtype):
    g = torch.Generator().manual_seed(7)
    # Atom 0 has more half edges than its row holds (the pair-order fallback);
    # one pair of an atom with its own image (i == j); some zero gradients.
    n_atoms, n_pairs = 9, 260
    first = torch.randint(0, n_atoms, (n_pairs,), generator=g)
    second = torch.randint(0, n_atoms, (n_pairs,), generator=g)
    first[::2] = 0
    second[5] = first[5]
    pairs = torch.stack([torch.minimum(first, second), torch.maximum(first, second)])
    grad = torch.randn(n_pairs, 3, generator=g, dtype=dtype)
    grad[10:20] = 0
    assert int((pairs == 0).sum()) > EDGES and int((pairs == 3).sum()) < EDGES
    ref = torch.ops.torchani_fast.pair_vectors_backward(grad, pairs, n_atoms)
    out = emu.pair_vectors_backward(grad, pairs, n_atoms)
    assert torch.equal(out, ref)
    assert torch.equal(emu.pair_vectors_backward(grad, pairs, n_atoms), out)
    # With padding (-1, -1) after the pairs: ignored.
    padded = torch.cat([pairs, torch.full((2, 7), -1)], 1)
    padded_grad = torch.cat([grad, torch.randn(7, 3, generator=g, dtype=dtype)])
    assert torch.equal(emu.pair_vectors_backward(padded_grad, padded, n_atoms), ref)


@pytest.mark.parametrize("name", ["triclinic_xy", "dense_cell"])
def test_forces_of_a_periodic_list_bit_for_bit(emu, name):
    # The backward of a real list against the CPU's: triclinic, per-axis pbc
    # (rows of half edges), and several images per atom (the pair-order fallback).
    species, coords, cell, pbc = _system(name)
    pairs, images = emu.neighbor_pairs(species, coords, cell, pbc, CUTOFF, True)
    assert (int(torch.bincount(pairs.flatten()).max()) > EDGES) == (name == "dense_cell")
    grad = torch.randn(pairs.shape[1], 3, generator=torch.Generator().manual_seed(3),
                       dtype=torch.float64)
    n = coords.shape[0] * coords.shape[1]
    ref = torch.ops.torchani_fast.pair_vectors_backward(grad, pairs, n)
    for _ in range(2):
        assert torch.equal(emu.pair_vectors_backward(grad, pairs, n), ref)
