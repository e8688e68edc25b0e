"""CUDA kernels against the CPU kernels and TorchANI, plus CUDA graphs and streams.

Every case that needs a GPU is marked ``requires_cuda`` and skips cleanly on a
machine without one; the fixed-capacity neighbour op also runs on the CPU.
Models use the ANI-2x architecture with random weights (seeded), so nothing
here needs the pretrained files: the same tests run on a bare GPU machine.
"""

from pathlib import Path

import pytest
import torch

import torchani_fast
from torchani_fast import ops
from torchani_fast.aev import AEVComputer, NeighborList
from torchani_fast.testing import water_box
from support import TINY_LEN, aev_args, energy_forces, tiny_consts, tiny_periodic_system
from support_cuda import CUTOFF, SYSTEMS, diff_vectors, elem_idxs, molecule, padded_batch, pair_set, random_model, to

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
DTYPES = [torch.float32, torch.float64]

# ---------------------------------------------------------------------------
# Build


@requires_cuda
def test_extension_has_cuda_kernels():
    for name in ("neighbor_pairs", "neighbor_pairs_padded", "pair_vectors", "pair_vectors_backward",
                 "aev", "aev_backward", "aev_jvp", "aev_double_backward", "aev_local_derivatives",
                 "ensemble_dense"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"torchani_fast::{name}", "CUDA"), (
            f"torchani_fast::{name} has no CUDA kernel: rebuild with TORCHANI_FAST_CUDA=1"
        )


# ---------------------------------------------------------------------------
# Neighbour search


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell_list", [False, True])
@pytest.mark.parametrize("name", list(SYSTEMS))
def test_neighbor_pairs_cuda_matches_cpu(name, cell_list, dtype):
    cpu = to(SYSTEMS[name], "cpu", dtype)
    gpu = to(SYSTEMS[name], "cuda", dtype)
    p_cpu, i_cpu = ops.neighbor_pairs(*cpu, CUTOFF, cell_list)
    p_gpu, i_gpu = ops.neighbor_pairs(*gpu, CUTOFF, cell_list)
    assert p_gpu.device.type == "cuda" and p_gpu.dtype == torch.long and i_gpu.dtype == dtype
    assert pair_set(p_gpu.cpu(), i_gpu.cpu()) == pair_set(p_cpu, i_cpu)
    # Grouped by first atom, and the same bits on a second call.
    assert bool((p_gpu[0, 1:] >= p_gpu[0, :-1]).all())
    p2, i2 = ops.neighbor_pairs(*gpu, CUTOFF, cell_list)
    assert torch.equal(p2, p_gpu) and torch.equal(i2, i_gpu)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["padded_batch", "water192", "tiny_cell"])
def test_neighbor_pairs_padded(device, name):
    species, coords, cell, pbc = to(SYSTEMS[name], device, torch.float64)
    exact, exact_images = ops.neighbor_pairs(species, coords, cell, pbc, CUTOFF, True)
    n = exact.shape[1]
    for capacity in (n + 37, n, n // 2):
        pairs, images, num = ops.neighbor_pairs_padded(
            species, coords, cell, pbc, CUTOFF, True, capacity)
        assert pairs.shape == (2, capacity) and images.shape == (capacity, 3)
        assert num.shape == () and int(num) == n
        kept = min(n, capacity)
        assert torch.equal(pairs[:, :kept], exact[:, :kept])
        assert torch.equal(images[:kept], exact_images[:kept])
        assert bool((pairs[:, kept:] == -1).all()) and bool((images[kept:] == 0).all())
        if capacity >= n:
            assert ops.check_num_pairs(num, capacity) == n
        else:
            with pytest.raises(RuntimeError, match="do not fit in max_pairs"):
                ops.check_num_pairs(num, capacity)


@pytest.mark.parametrize("device", DEVICES)
def test_neighbor_pairs_padded_opcheck(device):
    species, coords, cell, pbc = to(SYSTEMS["water192"], device, torch.float64)
    torch.library.opcheck(torch.ops.torchani_fast.neighbor_pairs_padded.default,
                          (species, coords, cell, pbc, CUTOFF, True, 5000))
    torch.library.opcheck(torch.ops.torchani_fast.neighbor_pairs_padded.default,
                          (species, coords, None, None, CUTOFF, False, 100))


@requires_cuda
def test_neighbor_errors_cuda():
    species, coords, cell, pbc = to(SYSTEMS["water192"], "cuda", torch.float64)
    bad = coords.clone()
    bad[0, 5, 1] = float("nan")
    with pytest.raises(RuntimeError, match="coords must be finite.*atom 5 of molecule 0"):
        ops.neighbor_pairs(species, bad, cell, pbc, CUTOFF, True)
    _, _, num = ops.neighbor_pairs_padded(species, bad, cell, pbc, CUTOFF, True, 100)
    assert int(num) == -1
    singular = cell.clone()
    singular[2] = singular[0]
    with pytest.raises(RuntimeError, match="cell is singular"):
        ops.neighbor_pairs(species, coords, singular, pbc, CUTOFF, True)
    pairs, _, num = ops.neighbor_pairs_padded(species, coords, singular, pbc, CUTOFF, True, 100)
    assert int(num) == -2 and bool((pairs == -1).all())
    tiny = torch.eye(3, dtype=torch.float64, device="cuda") * 1e-3  # 1e12 images
    with pytest.raises(RuntimeError, match="cell is too small for the cutoff"):
        ops.neighbor_pairs(species, coords, tiny, pbc, CUTOFF, True)
    pairs, _, num = ops.neighbor_pairs_padded(species, coords, tiny, pbc, CUTOFF, False, 100)
    assert int(num) == -3 and bool((pairs == -1).all())
    with pytest.raises(RuntimeError, match="cell must be on cuda"):
        ops.neighbor_pairs(species, coords, cell.cpu(), pbc, CUTOFF, True)


# ---------------------------------------------------------------------------
# AEV


def _aev_inputs(name, dtype, device, extra_invalid=False):
    model = random_model()
    species, coords, cell, pbc = to(SYSTEMS[name], "cpu", dtype)
    pairs, images = ops.neighbor_pairs(species, coords, cell, pbc, CUTOFF, True)
    if extra_invalid:  # unused slots of a fixed-capacity list
        pairs = torch.cat([pairs, torch.full((2, 17), -1)], 1)
        images = torch.cat([images, torch.zeros(17, 3, dtype=dtype)])
    diff = diff_vectors(coords, cell, pairs, images)
    args = aev_args(model.aev_computer, dtype, device)
    return species.to(device), pairs.to(device), diff.to(device), args


def _tol(dtype):
    return dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SYSTEMS))
def test_aev_cuda_matches_cpu(name, dtype):
    species, pairs, diff, args = _aev_inputs(name, dtype, "cuda", extra_invalid=True)
    a_gpu = ops.aev(species, pairs, diff, *args)
    a_cpu = ops.aev(species.cpu(), pairs.cpu(), diff.cpu(), *[
        t.cpu() if isinstance(t, torch.Tensor) else t for t in args])
    torch.testing.assert_close(a_gpu.cpu(), a_cpu, **_tol(dtype))
    g = torch.randn(a_cpu.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    gd_gpu = ops.aev_backward(g.cuda(), species, pairs, diff, *args)
    gd_cpu = ops.aev_backward(g, species.cpu(), pairs.cpu(), diff.cpu(), *[
        t.cpu() if isinstance(t, torch.Tensor) else t for t in args])
    scale = gd_cpu.abs().max().item()
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(gd_gpu.cpu(), gd_cpu, rtol=tol, atol=tol * scale)


@requires_cuda
@pytest.mark.parametrize("kernels", ["warp", "old"])
@pytest.mark.parametrize("n_molecules", [30, 100, 400, 1400])
def test_aev_cuda_all_launch_shapes(n_molecules, kernels, monkeypatch):
    """90 to 4200 atoms against the CPU: the warp kernels, and every warps-per-atom
    setting (8, 4, 2, 1) of the old ones."""
    monkeypatch.setenv("TORCHANI_FAST_CUDA_AEV", kernels)
    model = random_model()
    z, x, cell, pbc = water_box(n_molecules, seed=n_molecules)
    species = elem_idxs(z)
    pairs, images = ops.neighbor_pairs(species, x, cell, pbc, CUTOFF, True)
    diff = diff_vectors(x, cell, pairs, images)
    args_cpu = aev_args(model.aev_computer, torch.float64, "cpu")
    args_gpu = aev_args(model.aev_computer, torch.float64, "cuda")
    a_cpu = ops.aev(species, pairs, diff, *args_cpu)
    a_gpu = ops.aev(species.cuda(), pairs.cuda(), diff.cuda(), *args_gpu)
    torch.testing.assert_close(a_gpu.cpu(), a_cpu, rtol=1e-10, atol=1e-12)
    g = torch.randn(a_cpu.shape, dtype=torch.float64)
    gd_cpu = ops.aev_backward(g, species, pairs, diff, *args_cpu)
    gd_gpu = ops.aev_backward(g.cuda(), species.cuda(), pairs.cuda(), diff.cuda(), *args_gpu)
    torch.testing.assert_close(gd_gpu.cpu(), gd_cpu, rtol=1e-10, atol=1e-10)


@requires_cuda
@pytest.mark.parametrize("dtype,delta", [(torch.float32, 3e-5), (torch.float64, 2e-9)], ids=["f32", "f64"])
def test_aev_cuda_cutoff_tail(dtype, delta):
    """Neighbours just inside both cutoffs, where 0.5 cos(pi r / Rc) + 0.5 rounds to
    0: the CUDA AEV keeps the accurate tail, as the CPU (nonzero blocks; the
    networks' rare-element split and zero-chunk skipping rely on it)."""
    aevc = random_model().aev_computer
    rc_r, rc_a, r_len = float(aevc.radial.cutoff), float(aevc.angular.cutoff), int(aevc.radial.num_feats)
    species = torch.tensor([[1, 3, 0, 2]])  # C, then O at the radial cutoff, H at the angular one, N
    x = torch.tensor([[[0.0, 0.0, 0.0], [-rc_r * (1 - delta), 0.0, 0.0],
                       [rc_a * (1 - delta), 0.0, 0.0], [0.0, 1.1, 0.0]]], dtype=dtype)
    pairs, images = ops.neighbor_pairs(species, x, None, None, CUTOFF, False)
    diff = diff_vectors(x, None, pairs, images)
    a_cpu = ops.aev(species, pairs, diff, *aev_args(aevc, dtype, "cpu"))
    a_gpu = ops.aev(species.cuda(), pairs.cuda(), diff.cuda(), *aev_args(aevc, dtype, "cuda")).cpu()
    torch.testing.assert_close(a_gpu, a_cpu, **_tol(dtype))
    p = int(aevc.triu_index[0, 2])
    assert a_gpu[0, 0, 3 * r_len: 4 * r_len].max() > 0  # the O's radial block
    assert a_gpu[0, 0, 7 * r_len + 32 * p: 7 * r_len + 32 * (p + 1)].max() > 0  # the (H, N) angular block


@requires_cuda
def test_aev_cuda_deterministic():
    species, pairs, diff, args = _aev_inputs("water192", torch.float32, "cuda")
    g = torch.randn(species.shape + (1008,), device="cuda")
    first = ops.aev(species, pairs, diff, *args), ops.aev_backward(g, species, pairs, diff, *args)
    for _ in range(3):
        again = ops.aev(species, pairs, diff, *args), ops.aev_backward(g, species, pairs, diff, *args)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["molecule46", "padded_batch", "water192", "tiny_cell"])
def test_aev_cuda_warp_and_old_kernels(monkeypatch, name, dtype):
    """TORCHANI_FAST_CUDA_AEV=warp (the default) and old in one process: both against the
    CPU; the warp kernels the same bits on every run, and aev_backward_edges with the
    forward's handle the same bits as aev_backward."""
    species, pairs, diff, args = _aev_inputs(name, dtype, "cuda", extra_invalid=True)
    cpu_args = [t.cpu() if isinstance(t, torch.Tensor) else t for t in args]
    a_cpu = ops.aev(species.cpu(), pairs.cpu(), diff.cpu(), *cpu_args)
    g = torch.randn(a_cpu.shape, dtype=dtype, generator=torch.Generator().manual_seed(5))
    gd_cpu = ops.aev_backward(g, species.cpu(), pairs.cpu(), diff.cpu(), *cpu_args)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    results = {}
    for which in ("old", "warp"):
        monkeypatch.setenv("TORCHANI_FAST_CUDA_AEV", which)
        a, edges = torch.ops.torchani_fast.aev_with_edges(species, pairs, diff, *args)
        gk = torch.ops.torchani_fast.aev_backward_edges(g.cuda(), edges, species, pairs, diff, *args)
        gd = ops.aev_backward(g.cuda(), species, pairs, diff, *args)
        torch.testing.assert_close(a.cpu(), a_cpu, **_tol(dtype))
        torch.testing.assert_close(gd.cpu(), gd_cpu, rtol=tol, atol=tol * gd_cpu.abs().max().item())
        assert torch.equal(gk, gd)
        for _ in range(3):
            assert torch.equal(ops.aev(species, pairs, diff, *args), a)
            assert torch.equal(ops.aev_backward(g.cuda(), species, pairs, diff, *args), gd)
        results[which] = a, gd
    torch.testing.assert_close(results["warp"][0], results["old"][0], **_tol(dtype))
    monkeypatch.setenv("TORCHANI_FAST_CUDA_AEV", "fast")
    with pytest.raises(RuntimeError, match="TORCHANI_FAST_CUDA_AEV must be 'warp'"):
        ops.aev(species, pairs, diff, *args)


@requires_cuda
def test_aev_cuda_warp_too_many_neighbours(monkeypatch):
    """More than 256 half edges on an atom: NaN (the warp kernels' fixed capacity); the
    old kernels have no such limit."""
    species = torch.tensor([[0, 1, 0, 3]])
    x = torch.tensor([[[0.1, 0.2, 0.3], [0.8, 0.7, 0.9], [1.4, 0.3, 0.4], [0.5, 1.3, 1.5]]],
                     dtype=torch.float64)
    cell, pbc = torch.eye(3, dtype=torch.float64) * 1.8, torch.tensor([True] * 3)
    pairs, images = ops.neighbor_pairs(species, x, cell, pbc, CUTOFF, True)
    assert torch.bincount(pairs.flatten()).min() > 256
    diff = diff_vectors(x, cell, pairs, images)
    args = aev_args(random_model().aev_computer, torch.float64, "cuda")
    out = ops.aev(species.cuda(), pairs.cuda(), diff.cuda(), *args)
    assert bool(out.isnan().all())
    monkeypatch.setenv("TORCHANI_FAST_CUDA_AEV", "old")
    ref = ops.aev(species, pairs, diff, *aev_args(random_model().aev_computer, torch.float64, "cpu"))
    torch.testing.assert_close(ops.aev(species.cuda(), pairs.cuda(), diff.cuda(), *args).cpu(), ref,
                               **_tol(torch.float64))


@requires_cuda
def test_aev_cuda_input_forms():
    """int32 species and pairs, non-contiguous diff vectors, empty pair list."""
    species, pairs, diff, args = _aev_inputs("molecule46", torch.float64, "cuda")
    ref = ops.aev(species, pairs, diff, *args)
    strided = torch.cat([diff, diff], 1)[:, :3]
    assert not strided.is_contiguous()
    out = ops.aev(species.int(), pairs.int(), strided, *args)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    empty = ops.aev(species, pairs[:, :0], diff[:0], *args)
    assert empty.shape == ref.shape and bool((empty == 0).all())
    assert ops.aev_backward(torch.ones_like(ref), species, pairs[:, :0], diff[:0], *args).shape == (0, 3)


@requires_cuda
def test_aev_cuda_invalid_values_poison():
    """Errors the CPU raises for need a sync on CUDA, so they give NaN instead."""
    species, pairs, diff, args = _aev_inputs("molecule46", torch.float64, "cuda")
    bad_species = species.clone()
    bad_species[0, 3] = 7  # ANI-2x has 7 elements: 0..6
    out = ops.aev(bad_species, pairs, diff, *args)
    assert bool(out[0, 3].isnan().all()) and not bool(out[0, 4].isnan().any())
    bad_pairs = pairs.clone()
    bad_pairs[1, 0] = species.numel()
    assert bool(ops.aev(species, bad_pairs, diff, *args).isnan().all())
    with pytest.raises(RuntimeError, match="radial_eta must be on cuda"):
        ops.aev(species, pairs, diff, args[0].cpu(), *args[1:])
    with pytest.raises(RuntimeError, match="species must be on cuda"):
        ops.aev(species.cpu(), pairs, diff, *args)


@requires_cuda
def test_aev_gradcheck_cuda():
    species, pairs, diff, args = _aev_inputs("tiny_cell", torch.float64, "cuda")
    diff = diff.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda d: ops.aev(species, pairs, d, *args), (diff,),
                                    eps=1e-6, atol=1e-5, rtol=1e-4)
    torch.library.opcheck(torch.ops.torchani_fast.aev.default, (species, pairs, diff, *args))


@requires_cuda
def test_coords_and_cell_gradcheck_cuda():
    """Forces and stress: gradients through the neighbour list to coords and cell."""
    model = random_model()
    aevc = AEVComputer.from_torchani(model.aev_computer).cuda()
    species, coords, cell, pbc = to(SYSTEMS["tiny_cell"], "cuda", torch.float64)
    w = torch.randn(1008, dtype=torch.float64, device="cuda")

    def energy(x, c):
        return (aevc(species, x, c, pbc) @ w).sum()

    x = coords.clone().requires_grad_(True)
    c = cell.clone().requires_grad_(True)
    # nondet_tol: the pair-to-atom sum of the coordinate gradient is torch's
    # index_add (atomics on CUDA), reproducible to rounding only.
    assert torch.autograd.gradcheck(energy, (x, c), eps=1e-6, atol=1e-5, rtol=1e-4,
                                    nondet_tol=1e-12)


# ---------------------------------------------------------------------------
# The neighbour search's two paths, pair vectors and the force gather


@requires_cuda
def test_neighbor_search_old_and_new_agree(tmp_path):
    # TORCHANI_FAST_CUDA_NEIGHBORS is read once per process: the other path runs in a child.
    import os
    import subprocess
    import sys

    mine = os.environ.get("TORCHANI_FAST_CUDA_NEIGHBORS", "new") or "new"
    other = "old" if mine == "new" else "new"
    names = ["padded_batch", "triclinic_xy", "tiny_cell", "hair_below_face"]
    script = (
        "import sys, torch; sys.path.insert(0, {tests!r})\n"
        "from torchani_fast import ops\n"
        "from support_cuda import CUTOFF, SYSTEMS, to\n"
        "out = {{}}\n"
        "for name in {names!r}:\n"
        "    s = to(SYSTEMS[name], 'cuda', torch.float32)\n"
        "    out[name] = [t.cpu() for t in ops.neighbor_pairs(*s, CUTOFF, True)]\n"
        "    out[name + '/padded'] = [t.cpu() for t in ops.neighbor_pairs_padded(*s, CUTOFF, True, 150)]\n"
        "torch.save(out, {path!r})\n"
    ).format(tests=str(Path(__file__).resolve().parent), names=names, path=str(tmp_path / "o.pt"))
    env = dict(os.environ, TORCHANI_FAST_CUDA_NEIGHBORS=other)
    subprocess.run([sys.executable, "-c", script], env=env, check=True)
    theirs = torch.load(tmp_path / "o.pt")
    for name in names:
        s = to(SYSTEMS[name], "cuda", torch.float32)
        ours = [t.cpu() for t in ops.neighbor_pairs(*s, CUTOFF, True)]
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs[name])), name
        ours = [t.cpu() for t in ops.neighbor_pairs_padded(*s, CUTOFF, True, 150)]
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs[name + "/padded"])), name


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["padded_batch", "triclinic_xy", "tiny_cell"])
def test_pair_vectors_cuda_matches_cpu(name, dtype):
    species, coords, cell, pbc = to(SYSTEMS[name], "cpu", dtype)
    pairs, images = ops.neighbor_pairs(species, coords, cell, pbc, CUTOFF, True)
    x = coords.reshape(-1, 3)
    img = None if cell is None else images
    ref = torch.ops.torchani_fast.pair_vectors(x, pairs, img, cell)
    got = torch.ops.torchani_fast.pair_vectors(
        x.cuda(), pairs.cuda(), None if img is None else img.cuda(), None if cell is None else cell.cuda())
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.cpu(), b, **tol)
    # The force gather: additions in pair order, no atomics: the CPU's bits, every run.
    grad = torch.randn(pairs.shape[1], 3, dtype=dtype, generator=torch.Generator().manual_seed(1))
    want = torch.ops.torchani_fast.pair_vectors_backward(grad, pairs, x.shape[0])
    for _ in range(3):
        out = torch.ops.torchani_fast.pair_vectors_backward(grad.cuda(), pairs.cuda(), x.shape[0])
        assert torch.equal(out.cpu(), want)
    gpu = (x.cuda(), pairs.cuda(), None if img is None else img.cuda(), None if cell is None else cell.cuda())
    torch.library.opcheck(torch.ops.torchani_fast.pair_vectors.default, gpu)
    torch.library.opcheck(torch.ops.torchani_fast.pair_vectors_backward.default,
                          (grad.cuda(), pairs.cuda(), x.shape[0]))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_forces_cuda_bit_for_bit_run_to_run(dtype):
    z, x, cell, pbc = water_box(64, seed=7)
    fast = torchani_fast.patch(random_model()).to("cuda", dtype)
    args = (z.cuda(), x.to("cuda", dtype), cell.to("cuda", dtype), pbc.cuda())
    e0, f0 = energy_forces(fast, *args)
    for _ in range(3):
        e, f = energy_forces(fast, *args)
        assert torch.equal(e, e0) and torch.equal(f, f0)


# ---------------------------------------------------------------------------
# Whole models: CUDA against TorchANI


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["molecule46", "padded_batch", "water192", "water_triclinic"])
def test_energy_forces_cuda_vs_torchani(kind, dtype):
    ref = random_model()
    if kind == "molecule46":
        z, x = molecule()
        cell = pbc = None
    elif kind == "padded_batch":
        z, x = padded_batch()
        cell = pbc = None
    else:
        z, x, cell, pbc = water_box(64, seed=7)
        if kind == "water_triclinic":
            cell = cell.clone()
            cell[1, 0] = 0.25 * cell[0, 0]
    # Reference: TorchANI's own pure-PyTorch path in float64 on the CPU.
    e_ref, f_ref = energy_forces(ref, z, x, cell, pbc)
    fast = torchani_fast.patch(random_model()).to("cuda", dtype)
    e, f = energy_forces(fast, z.cuda(), x.to("cuda", dtype),
                          None if cell is None else cell.to("cuda", dtype),
                          None if pbc is None else pbc.cuda())
    if dtype == torch.float64:
        torch.testing.assert_close(e.cpu(), e_ref, rtol=0, atol=1e-9)
        torch.testing.assert_close(f.cpu(), f_ref, rtol=0, atol=1e-8)
    else:
        torch.testing.assert_close(e.cpu().double(), e_ref, rtol=1e-6, atol=2e-4)
        fs = f_ref.abs().max().item()
        torch.testing.assert_close(f.cpu().double(), f_ref, rtol=1e-4, atol=1e-4 * fs)
    # And the same model on the CPU agrees with the CUDA one.
    if dtype == torch.float64:
        e_cpu, f_cpu = energy_forces(torchani_fast.patch(random_model()), z, x, cell, pbc)
        torch.testing.assert_close(e.cpu(), e_cpu, rtol=0, atol=1e-10)
        torch.testing.assert_close(f.cpu(), f_cpu, rtol=0, atol=1e-9)


# ---------------------------------------------------------------------------
# Second derivatives: Hessians and force training


def _cpu(args):
    return [t.cpu() if isinstance(t, torch.Tensor) else t for t in args]


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["molecule46", "padded_batch", "tiny_cell"])
def test_second_derivative_ops_cuda_match_cpu(name, dtype):
    species, pairs, diff, args = _aev_inputs(name, dtype, "cuda", extra_invalid=True)
    cpu = [species.cpu(), pairs.cpu(), diff.cpu(), *_cpu(args)]
    g = torch.Generator().manual_seed(3)
    tangent = torch.randn(diff.shape, generator=g, dtype=dtype)
    tangent[::3] = 0
    grad_aev = torch.randn(*species.shape, 1008, generator=g, dtype=dtype)
    tol = 1e-10 if dtype == torch.float64 else 2e-5

    def close(a, b):
        torch.testing.assert_close(a.cpu(), b, rtol=tol, atol=tol * max(b.abs().max().item(), 1e-30))

    gpu = [species, pairs, diff, *args]
    jvp = ops.aev_jvp(tangent.cuda(), *gpu)
    close(jvp, ops.aev_jvp(tangent, *cpu))
    hvp = ops.aev_double_backward(grad_aev.cuda(), tangent.cuda(), *gpu)
    close(hvp, ops.aev_double_backward(grad_aev, tangent, *cpu))
    columns = torch.arange(0, 1008, 2)
    local = ops.aev_local_derivatives(grad_aev.cuda(), columns.cuda(), *gpu)
    ref = ops.aev_local_derivatives(grad_aev, columns, *cpu)
    assert torch.equal(local[0].cpu(), ref[0])
    close(local[1], ref[1])
    close(local[2], ref[2])
    # Deterministic: the same bits again.
    assert torch.equal(ops.aev_jvp(tangent.cuda(), *gpu), jvp)
    assert torch.equal(ops.aev_double_backward(grad_aev.cuda(), tangent.cuda(), *gpu), hvp)
    again = ops.aev_local_derivatives(grad_aev.cuda(), columns.cuda(), *gpu)
    assert all(torch.equal(a, b) for a, b in zip(again, local))


def _tiny_periodic_cuda():
    """test_hessian's tiny system (self image, repeated pair, padding) on CUDA, float64."""
    species, pairs, diff = tiny_periodic_system(torch.float64, seed=4)
    consts = [c.cuda() if torch.is_tensor(c) else c for c in tiny_consts()]
    return species.cuda(), pairs.cuda(), diff.cuda(), consts


@requires_cuda
def test_gradgradcheck_cuda():
    species, pairs, diff, consts = _tiny_periodic_cuda()
    diff.requires_grad_(True)
    f = lambda d: ops.aev(species, pairs, d, *consts)  # noqa: E731
    assert torch.autograd.gradcheck(f, (diff,))
    assert torch.autograd.gradgradcheck(f, (diff,))
    g = torch.Generator(device="cuda").manual_seed(2)
    tangent = torch.randn(diff.shape, generator=g, dtype=torch.float64, device="cuda")
    tangent.requires_grad_(True)
    grad_aev = torch.randn(*species.shape, TINY_LEN, generator=g, dtype=torch.float64,
                           device="cuda")
    assert torch.autograd.gradcheck(lambda t, d: ops.aev_jvp(t, species, pairs, d, *consts),
                                    (tangent, diff))
    assert torch.autograd.gradcheck(
        lambda t: ops.aev_double_backward(grad_aev, t, species, pairs, diff.detach(), *consts),
        (tangent,))
    torch.library.opcheck(torch.ops.torchani_fast.aev_jvp.default,
                          (tangent, species, pairs, diff, *consts))
    torch.library.opcheck(torch.ops.torchani_fast.aev_double_backward.default,
                          (grad_aev, tangent, species, pairs, diff.detach(), *consts))
    torch.library.opcheck(torch.ops.torchani_fast.aev_local_derivatives.default,
                          (grad_aev, torch.arange(3, TINY_LEN, device="cuda"), species, pairs,
                           diff.detach(), *consts))


@requires_cuda
def test_hessian_cuda_vs_cpu_and_torchani():
    from torchani.grad import energies_forces_and_hessians
    from torchani_fast.grad import energies_forces_and_hessians as one_pass_hessians

    z, x = molecule(12, seed=4)
    _, _, h_ref = energies_forces_and_hessians(random_model(), z, x.clone())  # TorchANI, CPU
    fast_cpu = torchani_fast.patch(random_model())
    _, _, h_cpu = one_pass_hessians(fast_cpu, z, x)
    fast = torchani_fast.patch(random_model()).cuda()
    zc, xc = z.cuda(), x.cuda()
    # Through autograd (aev_jvp / aev_double_backward) and in one pass (aev_local_derivatives).
    for e, f, h in (energies_forces_and_hessians(fast, zc, xc.clone()),
                    one_pass_hessians(fast, zc, xc)):
        assert h.device.type == "cuda" and h.shape == (1, 36, 36)
        torch.testing.assert_close(h.cpu(), h_ref, rtol=0, atol=1e-8)
        torch.testing.assert_close(h.cpu(), h_cpu, rtol=0, atol=1e-9)
        torch.testing.assert_close(h, h.transpose(1, 2), rtol=0, atol=1e-10)
    # float32 on CUDA: within float32 round-off of the float64 Hessian.
    fast32 = torchani_fast.patch(random_model()).to("cuda", torch.float32)
    _, _, h32 = one_pass_hessians(fast32, zc, xc.float())
    scale = h_ref.abs().max().item()
    assert (h32.double().cpu() - h_ref).abs().max().item() <= 1e-4 * scale


@requires_cuda
def test_force_training_weight_gradients_cuda_vs_cpu():
    z, x, cell, pbc = water_box(8, seed=6)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    grads = []
    for device in ("cpu", "cuda"):
        model = torchani_fast.patch(random_model()).to(device)
        params = list(model.potentials["nnp"].neural_networks.parameters())
        for p in params:
            p.requires_grad_(True)
        xd = x.to(device).requires_grad_(True)
        e = model((z.to(device), xd), cell=cell.to(device), pbc=pbc.to(device)).energies
        (g,) = torch.autograd.grad(e.sum(), xd, create_graph=True)
        loss = ((-g - target.to(device)) ** 2).sum() + 0.1 * e.sum()
        grads.append(torch.autograd.grad(loss, params, allow_unused=True))
    used = 0
    for a, b in zip(grads[1], grads[0]):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a.cpu(), b, rtol=1e-9, atol=1e-10)
            used += 1
    assert used > 0


# ---------------------------------------------------------------------------
# CUDA graphs and streams


def assert_forces_equal_to_rounding(f, f_ref):
    """Forces of the same step twice: the same up to the order of the atomic adds
    in the coordinate gradient (torch's index_add), i.e. a few ulps of the largest
    component, far below any race or stale-buffer error."""
    ulp = torch.finfo(f.dtype).eps
    scale = f_ref.abs().max().item()
    torch.testing.assert_close(f, f_ref, rtol=0, atol=64 * ulp * scale)


def _aev_energy_step(max_pairs, dtype, name="water192"):
    """A sync-free energy + forces step: padded neighbour list, AEV, linear head.
    ``step(x)`` returns the energy, the forces and the pair count (a tensor)."""
    model = random_model()
    nl = NeighborList("cell_list")
    aevc = AEVComputer.from_torchani(model.aev_computer, nl).to("cuda", dtype)
    species, coords, cell, pbc = to(SYSTEMS[name], "cuda", dtype)
    head = torch.nn.Linear(aevc.out_dim, 1).to("cuda", dtype)

    def step(x):
        neighbors, count = nl.padded(float(aevc.radial.cutoff), species, x, cell, pbc, max_pairs)
        e = head(aevc.compute_from_neighbors(species, x, neighbors)).sum()
        (g,) = torch.autograd.grad(e, x)
        return e.detach(), -g, count

    return step, coords


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_graph_capture(dtype):
    step, coords = _aev_energy_step(max_pairs=20000, dtype=dtype)
    static_x = coords.clone().requires_grad_(True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch requires
        for _ in range(2):
            step(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        e_static, f_static, count = step(static_x)
    g = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(3):
        new = coords + 0.05 * torch.randn(coords.shape, device="cuda", dtype=dtype, generator=g)
        with torch.no_grad():
            static_x.copy_(new)
        graph.replay()
        replayed = int(count)  # the count of the replay, read back explicitly
        e_eager, f_eager, eager_count = step(new.clone().requires_grad_(True))
        torch.testing.assert_close(e_static, e_eager, rtol=0, atol=0)
        assert_forces_equal_to_rounding(f_static, f_eager)
        assert 0 < replayed == ops.check_num_pairs(eager_count, 20000) <= 20000


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["molecule46", "water192", "padded_batch"])
def test_energy_forces_step_in_cuda_graph(name, dtype):
    # The whole patched model (fused networks included) captured once and replayed.
    from torchani_fast.step import EnergyForcesStep

    ref = random_model().to("cuda", dtype)
    fast = torchani_fast.patch(random_model()).to("cuda", dtype)
    elem, coords, cell, pbc = to(SYSTEMS[name], "cuda", dtype)
    species = torch.where(elem >= 0, ref.atomic_numbers.to("cuda")[elem.clamp(min=0)], -1)
    step = EnergyForcesStep(fast, species, coords, cell, pbc)
    assert step._graph is not None
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(3):
        x = coords + 0.03 * torch.randn(coords.shape, device="cuda", dtype=dtype, generator=g)
        x = torch.where(elem.unsqueeze(-1) >= 0, x, coords)
        e, f = step(x)
        xr = x.clone().requires_grad_(True)
        e_ref = ref((species, xr), cell=cell, pbc=pbc).energies
        (g_ref,) = torch.autograd.grad(e_ref.sum(), xr)
        tol = dict(rtol=1e-10, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-5, atol=5e-4)
        torch.testing.assert_close(e, e_ref.detach(), **tol)
        torch.testing.assert_close(f, -g_ref, **tol)
    bad = coords.clone()
    bad[0, 1, 2] = float("nan")
    with pytest.raises(RuntimeError, match="coords must be finite"):
        step(bad)
    if cell is not None:  # a compressed box: far more pairs than max_pairs
        with pytest.raises(RuntimeError, match="Raise max_pairs"):
            step(coords * 0.4)
    # A molecule cannot overflow: the default capacity holds all of its pairs.
    # After an error the step still gives the right result for good input.
    e, f = step(coords)
    xr = coords.clone().requires_grad_(True)
    e_ref = ref((species, xr), cell=cell, pbc=pbc).energies
    torch.testing.assert_close(e, e_ref.detach(), **tol)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["molecule46", "water192", "padded_batch"])
def test_step_chain_rule_by_hand_equals_autograd(name, dtype):
    # EnergyForcesStep's device path: forces from the networks op's AEV gradient
    # through the AEV's and pair vectors' backward, no autograd seed or negation
    # (step._energies_forces_by_hand), the same bits as its autograd path, eager
    # and replayed; self energies changed in place are seen by the replay.
    from torchani_fast.step import EnergyForcesStep

    fast = torchani_fast.patch(random_model()).to("cuda", dtype)
    elem, coords, cell, pbc = to(SYSTEMS[name], "cuda", dtype)
    species = torch.where(elem >= 0, fast.atomic_numbers.to("cuda")[elem.clamp(min=0)], -1)
    graphed = EnergyForcesStep(fast, species, coords, cell, pbc)
    eager = EnergyForcesStep(fast, species, coords, cell, pbc, cuda_graph=False)
    autograd = EnergyForcesStep(fast, species, coords, cell, pbc, cuda_graph=False)
    autograd._ani_only = False
    x = coords + 0.02
    assert graphed._graph is not None and eager._chain_rule(x) and not autograd._chain_rule(x)
    e, f = eager(x)
    for other in (autograd, graphed):
        e_other, f_other = other(x)
        assert torch.equal(e, e_other) and torch.equal(f, f_other)
    saved = fast.energy_shifter.self_energies.clone()
    with torch.no_grad():
        fast.energy_shifter.self_energies.add_(1.0)
    try:
        e_shifted, f_shifted = graphed(x)
    finally:
        with torch.no_grad():
            fast.energy_shifter.self_energies.copy_(saved)
    atoms = (species >= 0).sum(1).to(dtype)
    torch.testing.assert_close(e_shifted - e, atoms, rtol=0, atol=1e-9 if dtype == torch.float64 else 1e-2)
    assert torch.equal(f_shifted, f)


@requires_cuda
def test_cuda_graph_overflow_is_reported():
    step, coords = _aev_energy_step(max_pairs=100, dtype=torch.float32)
    count = step(coords.clone().requires_grad_(True))[2]
    with pytest.raises(RuntimeError, match="do not fit in max_pairs=100"):
        ops.check_num_pairs(count, 100)


@requires_cuda
def test_non_default_stream():
    fast = torchani_fast.patch(random_model()).to("cuda", torch.float32)
    z, x, cell, pbc = water_box(64, seed=11)
    args = (z.cuda(), x.to("cuda", torch.float32), cell.to("cuda", torch.float32), pbc.cuda())
    e_ref, f_ref = energy_forces(fast, *args)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # A busy stream: if a kernel ran on the default stream it would race with this.
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(4):
            big = big @ big / 64
        e, f = energy_forces(fast, *args)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    torch.testing.assert_close(e, e_ref, rtol=0, atol=0)
    assert_forces_equal_to_rounding(f, f_ref)


# ---------------------------------------------------------------------------
# Automatic CUDA graphs of the front ends (GraphedSteps): the decisions are tested
# on the CPU (test_graphed_steps.py); here, that replays equal eager results.


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_ase_calculator_replays_a_cuda_graph_equal_to_eager(dtype):
    import copy

    import numpy as np
    from ase.md.verlet import VelocityVerlet
    import ase.units

    from torchani_fast.apps.ase import Calculator
    from support import read_molecule

    model = torchani_fast.patch(random_model()).to("cuda", dtype).requires_grad_(False)
    start = read_molecule("2iuz_ligand.xyz")
    runs = []
    for graphs in (True, False):
        own = copy.deepcopy(model)
        atoms = start.copy()
        atoms.calc = calc = Calculator(own, cuda_graphs=graphs)
        VelocityVerlet(atoms, 0.5 * ase.units.fs).run(5)
        energies = [atoms.get_potential_energy()]
        with torch.no_grad():  # weights changed in place: a graph must be re-captured
            for p in own.parameters():
                p.mul_(1.01)
        atoms.positions[0, 0] += 1e-3
        energies.append(atoms.get_potential_energy())
        atoms.positions *= 0.7  # denser: the list overflows, more room (a new capture)
        energies.append(atoms.get_potential_energy())
        runs.append((energies, atoms.get_forces(), calc))
    (e_graph, f_graph, graphed), (e_eager, f_eager, eager) = runs
    assert [a for a, _ in graphed._steps.events] == ["capture"] * 3, graphed._steps.events
    assert graphed._step.step._graph is not None
    assert [a for a, _ in eager._steps.events] == ["eager"] * 2 and eager._step.step._graph is None
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    np.testing.assert_allclose(e_graph, e_eager, rtol=tol)
    np.testing.assert_allclose(f_graph, f_eager, rtol=0, atol=tol * 100 * np.abs(f_eager).max())


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_graphed_periodic_step_follows_a_box_changed_in_place(dtype):
    """What the OpenMM force does under a barostat: the new box copied into the
    captured cell tensor, the graph replayed, equal to an eager model call."""
    import numpy as np

    from torchani_fast.step import GraphedSteps

    model = torchani_fast.patch(random_model()).to("cuda", dtype).requires_grad_(False)
    z, x, cell, pbc = water_box(64, seed=3)
    species, coords = z.cuda(), x.to("cuda", dtype)
    cell, pbc = cell.to("cuda", dtype), pbc.cuda()
    steps = GraphedSteps(model)
    steps.get(True, lambda: (species, coords.clone(), cell, pbc))
    assert steps.events == [("capture", "first use")] and steps.step.step._graph is not None
    original = cell.clone()
    for scale in (1.0, 1.02, 0.99):
        cell.copy_(original * scale)
        positions = (x * scale).numpy()[0]
        energies, forces = steps.host_call(positions)
        want = model.energies_forces(species, (x * scale).to("cuda", dtype), cell, pbc)
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        np.testing.assert_allclose(energies, want.energies.cpu().numpy(), rtol=tol)
        np.testing.assert_allclose(forces, want.forces.cpu().numpy(), rtol=0,
                                   atol=tol * 100 * float(want.forces.abs().max()))
    assert steps.events == [("capture", "first use")]


# ---------------------------------------------------------------------------
# The networks op (ensemble_dense, csrc/ensemble/ensemble_cuda.cu) against the
# ATen path (TORCHANI_FAST_CUDA_NETWORKS=aten) and the CPU's C++ op


def _energy_forces_paths(model, z, x, cell=None, pbc=None):
    """{path: (energies, forces)} of a CUDA model with the networks by each path."""
    from torchani_fast.nn import fused

    out = {}
    for path in ("fused", "aten"):
        fused.CUDA_NETWORKS = path
        try:
            out[path] = energy_forces(model, z, x, cell, pbc)
        finally:
            fused.CUDA_NETWORKS = "fused"
    return out


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["molecule46", "padded_batch", "water400"])
@pytest.mark.parametrize("name", ["ANI2x", "ANI2xr"])
def test_networks_op_cuda_vs_aten_and_cpu(name, kind, dtype):
    from torchani_fast.testing import random_model as factory_model

    cell = pbc = None
    if kind == "molecule46":
        z, x = molecule()
    elif kind == "padded_batch":
        z, x = padded_batch()
    else:  # 1200 atoms: tiles enough for one block per tile (no member split)
        z, x, cell, pbc = water_box(400, seed=5)
    model = torchani_fast.patch(factory_model(name, dtype=torch.float64)).to("cuda", dtype)
    args = [z.cuda(), x.to("cuda", dtype), None if cell is None else cell.to("cuda", dtype),
            None if pbc is None else pbc.cuda()]
    paths = _energy_forces_paths(model, *args)
    cpu = torchani_fast.patch(factory_model(name, dtype=torch.float64)).to(dtype)
    want_cpu = energy_forces(cpu, z, x.to(dtype), None if cell is None else cell.to(dtype), pbc)
    # float64 1e-12 relative; float32 1e-5 of the largest value (energies, forces)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    for got, aten, want in zip(paths["fused"], paths["aten"], want_cpu):
        scale = want.abs().max().item()
        torch.testing.assert_close(got, aten, rtol=rtol, atol=rtol * scale)
        torch.testing.assert_close(got.cpu(), want, rtol=rtol, atol=rtol * scale)
    again = energy_forces(model, *args)  # the same bits on every run
    assert all(torch.equal(a, b) for a, b in zip(paths["fused"], again))


@requires_cuda
def test_networks_op_cuda_no_sync():
    # One op, three kernels (group, networks, member sum), nothing read back.
    z, x = molecule()
    model = torchani_fast.patch(random_model()).to("cuda")
    nets = model.potentials["nnp"].neural_networks
    elem = model.species_converter(z.cuda())
    aevs = model.potentials["nnp"].aev_computer(elem, x.cuda()).requires_grad_(True)
    nets(elem, aevs)  # (packs cached)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        energies = nets(elem, aevs)
        (grad,) = torch.autograd.grad(energies.sum(), aevs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert grad.abs().sum() > 0


@requires_cuda
@pytest.mark.parametrize("periodic", [False, True], ids=["molecule", "periodic"])
def test_model_api_synchronises_once(periodic):
    """A model-API call reads the device once: the checks' status with the pair count
    (tests/test_host_syncs.py counts the same on the CPU), and equals the CPU path."""
    import warnings

    model = torchani_fast.patch(random_model())  # (float64)
    species, coords, cell, pbc = water_box(10)
    if not periodic:
        cell = pbc = None
    want = model.energies_forces(species, coords, cell, pbc)
    model = model.to("cuda")
    args = [None if t is None else t.cuda() for t in (species, coords, cell, pbc)]
    model.energies_forces(*args)  # (packs the weights)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            got = model.energies_forces(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, syncs
    torch.testing.assert_close(got.energies.cpu(), want.energies, rtol=1e-12, atol=0)
    torch.testing.assert_close(got.forces.cpu(), want.forces, rtol=1e-12, atol=1e-12)
