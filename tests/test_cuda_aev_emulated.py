"""The warp-cooperative CUDA AEV kernels (csrc/aev/cuda/aev_warp.cuh), run in the CPU
emulator (tests/cuda_emulation) against the CPU ops and against the old CUDA kernels.

TORCHANI_FAST_CUDA_AEV selects the kernels on every call (warp, the default, or old),
so one process runs both. Needs the emulator build: TORCHANI_FAST_EMULATE_CUDA=1.
"""
import contextlib
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
from support import aev_args  # noqa: E402
from support_cuda import CUTOFF, SYSTEMS, diff_vectors, random_model, small_batch  # noqa: E402

DTYPES = [torch.float32, torch.float64]
MAX_SLOTS = 256  # half edges per atom (kMaxSlots in aev_warp.cuh)
WARP = 32


@pytest.fixture(scope="module")
def emu():
    sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_emulation"))
    import build

    return build.load()


@contextlib.contextmanager
def kernels(which):
    old = os.environ.get("TORCHANI_FAST_CUDA_AEV")
    os.environ["TORCHANI_FAST_CUDA_AEV"] = which
    try:
        yield
    finally:
        if old is None:
            del os.environ["TORCHANI_FAST_CUDA_AEV"]
        else:
            os.environ["TORCHANI_FAST_CUDA_AEV"] = old


def case(species, coords, cell, pbc, dtype, pad_slots=0):
    """(species, pairs, diff, AEV args) of a system, with unused (-1) pair slots appended."""
    coords = coords.to(dtype)
    cell = None if cell is None else cell.to(dtype)
    pairs, images = ops.neighbor_pairs(species, coords, cell, pbc, CUTOFF, True)
    if pad_slots:
        pairs = torch.cat([pairs, torch.full((2, pad_slots), -1)], 1)
        images = torch.cat([images, torch.zeros(pad_slots, 3, dtype=dtype)])
    return species, pairs, diff_vectors(coords, cell, pairs, images), aev_args(
        random_model().aev_computer, dtype, "cpu")


def water_cluster(n_atoms=64):
    """The atoms of water192 nearest its centre (liquid density), plus one far atom with
    no neighbours."""
    species, coords, cell, _ = SYSTEMS["water192"]
    keep = (coords[0] - cell.sum(0) / 2).norm(dim=1).argsort()[:n_atoms]
    species = torch.cat([species[:, keep], torch.tensor([[1]])], 1)
    coords = torch.cat([coords[:, keep], torch.tensor([[[60.0, 60.0, 60.0]]], dtype=torch.float64)], 1)
    return species, coords, None, None


CASES = {
    # A cell smaller than the cutoff: 59 half edges per atom, self-image pairs.
    "tiny_cell": lambda dt: case(*SYSTEMS["tiny_cell"], dt, pad_slots=7),
    "small_batch": lambda dt: case(*small_batch(), dt, pad_slots=3),
    # 65 atoms: more than a warp of radial and angular neighbours, an isolated atom.
    "water_cluster": lambda dt: case(*water_cluster(), dt),
}


def tolerance(dtype):
    return 1e-12 if dtype == torch.float64 else 1e-5


def close(out, ref, dtype):
    t = tolerance(dtype)
    scale = max(ref.abs().max().item(), 1e-30)
    torch.testing.assert_close(out, ref, rtol=t, atol=t * scale)


def test_cases_need_several_rounds():
    """The cases reach the multi-round paths: more than 32 neighbours and triples."""
    species, pairs, diff, args = CASES["water_cluster"](torch.float64)
    kept = pairs[:, diff.norm(dim=1) <= CUTOFF]
    counts = torch.bincount(kept.flatten(), minlength=species.numel())
    assert counts.max() > WARP and counts[-1] == 0
    ang = pairs[:, diff.norm(dim=1) <= args[-2]]
    n_ang = torch.bincount(ang.flatten(), minlength=species.numel())
    assert (n_ang * (n_ang - 1) // 2).max() > 2 * WARP


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("name", list(CASES))
def test_warp_aev_matches_cpu(emu, name, dtype):
    """Forward and backward against the CPU ops; the same bits on a second run; the old
    kernels agree."""
    species, pairs, diff, args = CASES[name](dtype)
    ref = ops.aev(species, pairs, diff, *args)
    g = torch.randn(ref.shape, dtype=dtype, generator=torch.Generator().manual_seed(2))
    gref = ops.aev_backward(g, species, pairs, diff, *args)
    with kernels("warp"):
        out = emu.aev(species, pairs, diff, *args)
        gout = emu.aev_backward(g, species, pairs, diff, *args)
        close(out, ref, dtype)
        close(gout, gref, dtype)
        assert torch.equal(emu.aev(species, pairs, diff, *args), out)
        assert torch.equal(emu.aev_backward(g, species, pairs, diff, *args), gout)
    with kernels("old"):
        close(emu.aev(species, pairs, diff, *args), out, dtype)
        close(emu.aev_backward(g, species, pairs, diff, *args), gout, dtype)


SMOOTH = [[ops.CUTOFF_SMOOTH, 2, 1e-10], [ops.CUTOFF_SMOOTH, 3, 1e-3]]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_warp_aev_smooth_cutoff(emu, dtype):
    species, pairs, diff, args = CASES["tiny_cell"](dtype)
    for extra in SMOOTH:
        smooth = args + extra
        ref = ops.aev(species, pairs, diff, *smooth)
        assert not torch.equal(ref, ops.aev(species, pairs, diff, *args))
        g = torch.randn(ref.shape, dtype=dtype, generator=torch.Generator().manual_seed(3))
        close(emu.aev(species, pairs, diff, *smooth), ref, dtype)
        close(emu.aev_backward(g, species, pairs, diff, *smooth),
              ops.aev_backward(g, species, pairs, diff, *smooth), dtype)


def launches(emu, fn):
    before = emu.launch_count()
    out = fn()
    return out, emu.launch_count() - before


def test_warp_aev_keeps_edges_and_launches(emu):
    """aev_with_edges hands its slots to aev_backward_edges (the same bits as
    aev_backward, with fewer launches); a handle built from other inputs is not used.
    Launches (kernels): warp forward 2, backward 2 with the handle, 3 without; old
    forward 4, backward 5."""
    species, pairs, diff, args = CASES["small_batch"](torch.float64)
    g = torch.randn(*species.shape, ops.aev(species, pairs, diff, *args).shape[-1],
                    dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with kernels("warp"):
        (aev, edges), n_fwd = launches(emu, lambda: emu.aev_with_edges(species, pairs, diff, *args))
        assert edges.shape == (0,) and edges.dtype == torch.uint8
        plain, n_plain = launches(emu, lambda: emu.aev(species, pairs, diff, *args))
        assert torch.equal(aev, plain) and n_fwd == n_plain == 2
        gk, n_kept = launches(emu, lambda: emu.aev_backward_edges(g, edges, species, pairs, diff, *args))
        gb, n_built = launches(emu, lambda: emu.aev_backward(g, species, pairs, diff, *args))
        assert torch.equal(gk, gb) and n_kept == 2 and n_built == 3
        # The handle of other inputs (moved atoms): built again, not read.
        moved = diff * 1.01
        gm, n_moved = launches(emu, lambda: emu.aev_backward_edges(g, edges, species, pairs, moved, *args))
        assert n_moved == 3
        close(gm, ops.aev_backward(g, species, pairs, moved, *args), torch.float64)
    with kernels("old"):
        (aev_old, edges_old), n_fwd_old = launches(emu, lambda: emu.aev_with_edges(species, pairs, diff, *args))
        assert edges_old.shape == (0,) and n_fwd_old == 4
        # The old kernels ignore a warp handle.
        g_old, n_bwd_old = launches(emu, lambda: emu.aev_backward_edges(g, edges, species, pairs, diff, *args))
        assert n_bwd_old == 5
        close(g_old, gk, torch.float64)


def test_warp_aev_invalid_values(emu):
    """Device errors as the old kernels: a bad species poisons its row, a bad pair index
    the whole AEV (and gives a zero gradient); more than MAX_SLOTS half edges on an atom
    poison its row and the whole gradient."""
    species, pairs, diff, args = CASES["small_batch"](torch.float64)
    bad = species.clone()
    bad[0, 3] = 7
    out = emu.aev(bad, pairs, diff, *args)
    assert bool(out[0, 3].isnan().all()) and not bool(out[0, 4].isnan().any())
    assert bool((out[2, 4:] == 0).all())  # padding rows
    bad_pairs = pairs.clone()
    bad_pairs[0, 2] = species.numel() + 3
    assert bool(emu.aev(species, bad_pairs, diff, *args).isnan().all())
    ones = torch.ones(out.shape, dtype=torch.float64)
    assert bool((emu.aev_backward(ones, species, bad_pairs, diff, *args) == 0).all())
    empty = emu.aev(species, pairs[:, :0], diff[:0], *args)
    assert bool((empty == 0).all())
    with kernels("fast"), pytest.raises(RuntimeError, match="TORCHANI_FAST_CUDA_AEV must be 'warp'.*got 'fast'"):
        emu.aev(species, pairs, diff, *args)


def test_warp_aev_too_many_neighbours(emu):
    """A 4-atom molecule in a 1.8 A periodic cube: hundreds of images within the cutoff."""
    species = torch.tensor([[0, 1, 0, 3]])
    coords = torch.tensor([[[0.1, 0.2, 0.3], [0.8, 0.7, 0.9], [1.4, 0.3, 0.4], [0.5, 1.3, 1.5]]],
                          dtype=torch.float64)
    cell = torch.eye(3, dtype=torch.float64) * 1.8
    species, pairs, diff, args = case(species, coords, cell, torch.tensor([True] * 3), torch.float64)
    counts = torch.bincount(pairs.flatten(), minlength=4)
    assert counts.min() > MAX_SLOTS
    out = emu.aev(species, pairs, diff, *args)
    assert bool(out.isnan().all())
    assert bool(emu.aev_backward(torch.ones_like(out), species, pairs, diff, *args).isnan().all())
    with kernels("old"):  # no such limit
        close(emu.aev(species, pairs, diff, *args), ops.aev(species, pairs, diff, *args), torch.float64)
