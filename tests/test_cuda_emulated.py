"""The CUDA kernels' own source, run on the CPU by a small emulator, against the CPU ops.

No GPU needed: tests/cuda_emulation/ compiles csrc/**/*.cu as host C++ with one
OS thread per CUDA thread and real barriers for __syncthreads, __syncwarp and
warp shuffles (see emu_runtime.h). This checks the kernels' logic (indexing,
layouts, synchronisation, padding, error encoding), not the device compiler,
timing or memory model. It takes minutes (a compile, then thousands of threads
per launch), so it runs only when TORCHANI_FAST_EMULATE_CUDA=1.
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
from support import aev_args, tiny_consts, tiny_periodic_system  # noqa: E402
from support_cuda import (  # noqa: E402
    CUTOFF, SYSTEMS, diff_vectors, pair_set, random_model, small_batch, to,
)

DTYPES = [torch.float32, torch.float64]


@pytest.fixture(scope="module")
def emu():
    sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_emulation"))
    import build

    return build.load()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell_list", [False, True])
@pytest.mark.parametrize("name", list(SYSTEMS))
def test_neighbor_pairs(emu, name, cell_list, dtype):
    args = to(SYSTEMS[name], "cpu", dtype)
    ref = ops.neighbor_pairs(*args, CUTOFF, cell_list)
    pairs, images = emu.neighbor_pairs(*args, CUTOFF, cell_list)
    assert pairs.dtype == torch.long and images.dtype == dtype
    assert pair_set(pairs, images) == pair_set(*ref)
    assert bool((pairs[0, 1:] >= pairs[0, :-1]).all())
    # Each atom's partners sorted by (j, image): canonical whatever the atomics did.
    key = pairs[0] * (1 << 40) + pairs[1] * (1 << 20) + images.round().long() @ torch.tensor([1 << 12, 1 << 6, 1]) + 2000
    assert bool((key[1:] > key[:-1]).all())
    padded, pimages, num = emu.neighbor_pairs_padded(*args, CUTOFF, cell_list, pairs.shape[1] + 5)
    assert int(num) == pairs.shape[1]
    assert torch.equal(padded[:, : pairs.shape[1]], pairs)
    assert torch.equal(pimages[: pairs.shape[1]], images)
    assert bool((padded[:, pairs.shape[1]:] == -1).all()) and bool((pimages[pairs.shape[1]:] == 0).all())
    short, _, num = emu.neighbor_pairs_padded(*args, CUTOFF, cell_list, pairs.shape[1] // 3)
    assert int(num) == pairs.shape[1] and torch.equal(short, pairs[:, : pairs.shape[1] // 3])


def test_neighbor_errors(emu):
    species, coords, cell, pbc = to(SYSTEMS["water192"], "cpu", torch.float64)
    bad = coords.clone()
    bad[0, 7, 2] = float("inf")
    with pytest.raises(RuntimeError, match="coords must be finite.*atom 7 of molecule 0"):
        emu.neighbor_pairs(species, bad, cell, pbc, CUTOFF, True)
    pairs, _, num = emu.neighbor_pairs_padded(species, bad, cell, pbc, CUTOFF, True, 50)
    assert int(num) == -1 and bool((pairs == -1).all())
    singular = cell.clone()
    singular[1] = 2 * singular[0]
    with pytest.raises(RuntimeError, match="cell is singular"):
        emu.neighbor_pairs(species, coords, singular, pbc, CUTOFF, True)
    _, _, num = emu.neighbor_pairs_padded(species, coords, singular, pbc, CUTOFF, True, 50)
    assert int(num) == -2
    tiny = torch.eye(3, dtype=torch.float64) * 1e-3
    with pytest.raises(RuntimeError, match="cell is too small for the cutoff"):
        emu.neighbor_pairs(species, coords, tiny, pbc, CUTOFF, False)
    _, _, num = emu.neighbor_pairs_padded(species, coords, tiny, pbc, CUTOFF, True, 50)
    assert int(num) == -3
    empty = emu.neighbor_pairs(species[:, :0], coords[:, :0], None, None, CUTOFF, True)
    assert empty[0].shape == (2, 0)


def _aev_case(species, coords, cell, pbc, dtype, pad_slots=0):
    model = random_model()
    coords = coords.to(dtype)
    cell = None if cell is None else cell.to(dtype)
    pairs, images = ops.neighbor_pairs(species, coords, cell, pbc, CUTOFF, True)
    if pad_slots:
        pairs = torch.cat([pairs, torch.full((2, pad_slots), -1)], 1)
        images = torch.cat([images, torch.zeros(pad_slots, 3, dtype=dtype)])
    diff = diff_vectors(coords, cell, pairs, images)
    return species, pairs, diff, aev_args(model.aev_computer, dtype, "cpu")


def _check_aev(emu, species, pairs, diff, args, dtype):
    ref = ops.aev(species, pairs, diff, *args)
    out = emu.aev(species, pairs, diff, *args)
    tol = dict(rtol=1e-11, atol=1e-13) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, ref, **tol)
    g = torch.randn(ref.shape, dtype=dtype, generator=torch.Generator().manual_seed(2))
    gref = ops.aev_backward(g, species, pairs, diff, *args)
    gout = emu.aev_backward(g, species, pairs, diff, *args)
    scale = gref.abs().max().item()
    t = 1e-11 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(gout, gref, rtol=t, atol=t * scale)
    # Same bits on a second run.
    assert torch.equal(emu.aev(species, pairs, diff, *args), out)
    assert torch.equal(emu.aev_backward(g, species, pairs, diff, *args), gout)


def gas(n, seed=0, neighbours=3.0):
    """A dilute non-periodic gas of n atoms (HCNO) with a few neighbours each: cheap
    to emulate, but as many atoms as the launch-shape thresholds need."""
    g = torch.Generator().manual_seed(seed)
    length = (n / (neighbours / (4 / 3 * 3.14159 * CUTOFF**3))) ** (1 / 3)
    coords = torch.rand(1, n, 3, generator=g, dtype=torch.float64) * length
    species = torch.randint(0, 4, (1, n), generator=g)
    return species, coords, None, None


EMU_SYSTEMS = {
    "tiny_cell": SYSTEMS["tiny_cell"],
    "small_batch": small_batch(),
    "gas_triclinic": (gas(60, 1)[0], gas(60, 1)[1], torch.tensor(
        [[14.0, 0.0, 0.0], [3.0, 13.0, 0.0], [0.0, -2.0, 12.0]], dtype=torch.float64),
        torch.tensor([True, True, False])),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(EMU_SYSTEMS))
def test_aev(emu, name, dtype):
    """Fewer than 256 atoms: 8 warps per atom; unused (-1) pair slots appended."""
    _check_aev(emu, *_aev_case(*EMU_SYSTEMS[name], dtype, pad_slots=11), dtype)


@pytest.mark.parametrize("dtype,delta", [(torch.float32, 3e-5), (torch.float64, 2e-9)], ids=["f32", "f64"])
def test_aev_cutoff_tail(emu, dtype, delta):
    """Neighbours just inside the cutoffs, where 0.5 cos(pi r / Rc) + 0.5 rounds to
    0: the device kernels keep the accurate tail (aev_math::cutoff_tail) as the
    CPU does, so the blocks are not 0 (test_aev.py::test_cutoff_tail_is_accurate)."""
    aevc = random_model().aev_computer
    rc_r, rc_a, r_len = float(aevc.radial.cutoff), float(aevc.angular.cutoff), int(aevc.radial.num_feats)
    species = torch.tensor([[1, 3, 0, 2]])  # C, then O at the radial cutoff, H at the angular one, N
    coords = torch.tensor([[[0.0, 0.0, 0.0], [-rc_r * (1 - delta), 0.0, 0.0],
                            [rc_a * (1 - delta), 0.0, 0.0], [0.0, 1.1, 0.0]]], dtype=torch.float64)
    case = _aev_case(species, coords, None, None, dtype)
    _check_aev(emu, *case, dtype)
    out = emu.aev(*case[:3], *case[3])
    p = int(aevc.triu_index[0, 2])
    assert out[0, 0, 3 * r_len: 4 * r_len].max() > 0  # the O's radial block
    assert out[0, 0, 7 * r_len + 32 * p: 7 * r_len + 32 * (p + 1)].max() > 0  # the (H, N) angular block


SMOOTH = [ops.CUTOFF_SMOOTH, 2, 1e-10]  # TorchANI's CutoffSmooth() (ANI-2xr, ANI-r2s, ...)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["tiny_cell", "small_batch"])
def test_aev_smooth_cutoff(emu, name, dtype):
    """The cutoff kind is an argument of the device kernels too (aev_math::CutoffFn):
    forward, backward, JVP, double backward and local derivatives against the CPU
    ops with the smooth cutoff (order 2, and order 3 with a large eps)."""
    species, pairs, diff, args = _aev_case(*EMU_SYSTEMS[name], dtype, pad_slots=3)
    for extra in (SMOOTH, [ops.CUTOFF_SMOOTH, 3, 1e-3]):
        smooth = args + extra
        assert not torch.equal(ops.aev(species, pairs, diff, *smooth), ops.aev(species, pairs, diff, *args))
        _check_aev(emu, species, pairs, diff, smooth, dtype)
    species, pairs, diff, args = _tiny_periodic(dtype)
    smooth = args + SMOOTH
    tangent, grad_aev, n_feat = _second_inputs(species, pairs, diff, smooth)
    _close(emu.aev_jvp(tangent, species, pairs, diff, *smooth),
           ops.aev_jvp(tangent, species, pairs, diff, *smooth), dtype)
    _close(emu.aev_double_backward(grad_aev, tangent, species, pairs, diff, *smooth),
           ops.aev_double_backward(grad_aev, tangent, species, pairs, diff, *smooth), dtype)
    columns = torch.arange(1, n_feat, 2)
    ref = ops.aev_local_derivatives(grad_aev, columns, species, pairs, diff, *smooth)
    out = emu.aev_local_derivatives(grad_aev, columns, species, pairs, diff, *smooth)
    assert torch.equal(out[0], ref[0])
    _close(out[1], ref[1], dtype)
    _close(out[2], ref[2], dtype)


@pytest.mark.parametrize("n_atoms", [300, 1100, 4200])
def test_aev_launch_shapes(emu, n_atoms, monkeypatch):
    """The old kernels' 4, 2 and 1 warps per atom (dilute gas, so that the emulation stays
    quick); the default warp kernels run one warp per atom at every size."""
    monkeypatch.setenv("TORCHANI_FAST_CUDA_AEV", "old")
    _check_aev(emu, *_aev_case(*gas(n_atoms, n_atoms), torch.float64), torch.float64)


def test_aev_invalid_values(emu):
    species, pairs, diff, args = _aev_case(*EMU_SYSTEMS["small_batch"], torch.float64)
    bad = species.clone()
    bad[0, 3] = 7
    out = emu.aev(bad, pairs, diff, *args)
    assert bool(out[0, 3].isnan().all()) and not bool(out[0, 4].isnan().any())
    assert bool((out[2, 4:] == 0).all())  # padding rows
    bad_pairs = pairs.clone()
    bad_pairs[0, 2] = species.numel() + 3
    assert bool(emu.aev(species, bad_pairs, diff, *args).isnan().all())
    assert bool((emu.aev_backward(torch.ones(out.shape, dtype=torch.float64), species, bad_pairs,
                                  diff, *args) == 0).all())
    empty = emu.aev(species, pairs[:, :0], diff[:0], *args)
    assert bool((empty == 0).all())


# ---------------------------------------------------------------------------
# Second derivatives: aev_jvp, aev_double_backward, aev_local_derivatives


def _tiny_periodic(dtype):
    """5 atoms + 1 padding atom, an atom paired with its own image and a pair present
    twice through two images (test_hessian's system), non-integer zeta."""
    species, pairs, diff = tiny_periodic_system(dtype, seed=11)
    args = [c.to(dtype) if torch.is_tensor(c) else c for c in tiny_consts()]
    return species, pairs, diff, args


SECOND_CASES = {
    "tiny_periodic": _tiny_periodic,
    # A cell smaller than the cutoff (many images of every atom), unused pair slots.
    "tiny_cell": lambda dt: _aev_case(*EMU_SYSTEMS["tiny_cell"], dt, pad_slots=5),
    # Three molecules padded with -1, unused pair slots.
    "small_batch": lambda dt: _aev_case(*EMU_SYSTEMS["small_batch"], dt, pad_slots=7),
    # More atoms than one block of threads.
    "gas300": lambda dt: _aev_case(*gas(300, 3), dt),
}


def _second_inputs(species, pairs, diff, args):
    g = torch.Generator().manual_seed(21)
    n_feat = ops.aev(species, pairs, diff, *args).shape[-1]
    tangent = torch.randn(diff.shape, generator=g, dtype=diff.dtype)
    tangent[::4] = 0  # pairs that do not move are skipped
    grad_aev = torch.randn(*species.shape, n_feat, generator=g, dtype=diff.dtype)
    return tangent, grad_aev, n_feat


def _close(out, ref, dtype):
    t = 1e-11 if dtype == torch.float64 else 2e-5
    scale = max(ref.abs().max().item(), 1e-30) if ref.numel() else 1.0
    torch.testing.assert_close(out, ref, rtol=t, atol=t * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SECOND_CASES))
def test_second_derivatives(emu, name, dtype):
    species, pairs, diff, args = SECOND_CASES[name](dtype)
    tangent, grad_aev, n_feat = _second_inputs(species, pairs, diff, args)
    jvp = emu.aev_jvp(tangent, species, pairs, diff, *args)
    _close(jvp, ops.aev_jvp(tangent, species, pairs, diff, *args), dtype)
    hvp = emu.aev_double_backward(grad_aev, tangent, species, pairs, diff, *args)
    _close(hvp, ops.aev_double_backward(grad_aev, tangent, species, pairs, diff, *args), dtype)
    for columns in (torch.arange(n_feat), torch.arange(1, n_feat, 3)):
        ref = ops.aev_local_derivatives(grad_aev, columns, species, pairs, diff, *args)
        out = emu.aev_local_derivatives(grad_aev, columns, species, pairs, diff, *args)
        assert torch.equal(out[0], ref[0])  # the same slots in the same order
        assert out[1].shape == ref[1].shape and out[2].shape == ref[2].shape
        _close(out[1], ref[1], dtype)
        _close(out[2], ref[2], dtype)
    # Same bits on a second run.
    assert torch.equal(emu.aev_jvp(tangent, species, pairs, diff, *args), jvp)
    assert torch.equal(emu.aev_double_backward(grad_aev, tangent, species, pairs, diff, *args), hvp)
    again = emu.aev_local_derivatives(grad_aev, columns, species, pairs, diff, *args)
    assert all(torch.equal(a, b) for a, b in zip(again, out))


def test_second_derivatives_invalid_values(emu):
    species, pairs, diff, args = SECOND_CASES["small_batch"](torch.float64)
    tangent, grad_aev, n_feat = _second_inputs(species, pairs, diff, args)
    every = torch.arange(n_feat)
    bad = species.clone()
    bad[0, 3] = 7
    # Sync-free ops encode the error like aev / aev_backward do.
    jvp = emu.aev_jvp(tangent, bad, pairs, diff, *args)
    assert bool(jvp[0, 3].isnan().all()) and not bool(jvp[0, 4].isnan().any())
    assert bool(emu.aev_double_backward(grad_aev, tangent, bad, pairs, diff, *args).isfinite().all())
    bad_pairs = pairs.clone()
    bad_pairs[0, 2] = species.numel() + 3
    assert bool(emu.aev_jvp(tangent, species, bad_pairs, diff, *args).isnan().all())
    assert bool((emu.aev_double_backward(grad_aev, tangent, species, bad_pairs, diff, *args)
                 == 0).all())
    # The local derivatives synchronise anyway, so they raise like the CPU.
    with pytest.raises(RuntimeError, match="species must be -1 .* got 7 at flattened atom 3"):
        emu.aev_local_derivatives(grad_aev, every, bad, pairs, diff, *args)
    with pytest.raises(RuntimeError, match="pairs must index the 24 flattened atoms"):
        emu.aev_local_derivatives(grad_aev, every, species, bad_pairs, diff, *args)
    with pytest.raises(RuntimeError, match="columns must be increasing .* got 4 at position 2"):
        emu.aev_local_derivatives(grad_aev, torch.tensor([3, 5, 4]), species, pairs, diff, *args)
    with pytest.raises(RuntimeError, match=f"got {n_feat} at position 1"):
        emu.aev_local_derivatives(grad_aev, torch.tensor([0, n_feat]), species, pairs, diff, *args)
    # No pairs at all: zeros, K = 1.
    empty = emu.aev_local_derivatives(grad_aev, every, species, pairs[:, :0], diff[:0], *args)
    ref = ops.aev_local_derivatives(grad_aev, every, species, pairs[:, :0], diff[:0], *args)
    assert all(torch.equal(a, b) for a, b in zip(empty, ref))
    assert bool((emu.aev_jvp(tangent[:0], species, pairs[:, :0], diff[:0], *args) == 0).all())
    assert emu.aev_double_backward(grad_aev, tangent[:0], species, pairs[:, :0], diff[:0],
                                   *args).shape == (0, 3)
