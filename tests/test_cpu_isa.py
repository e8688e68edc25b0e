"""Every instruction set of the CPU kernels on this machine (torchani_fast.cpu_isa).

The networks' float32 products have an AVX2 and an AVX-512 version (and the
portable path without panels); the AEV, neighbour list and CELU an AVX2 and a
portable one. Each level this CPU has is checked against plain PyTorch (the
op) and TorchANI (a patched model). The forward pass (values, energies) of
AVX2 and AVX-512 sums every product in the same order, so they must agree to
the bit; the AVX-512 input gradient of blocks of up to 8 rows is summed in
another order (dot products with W's rows), so it agrees to float rounding.
The float32 AEV computes its exp and log on 16 lanes with AVX-512 and sums in
the AVX2 order, and the neighbour search tests 8 candidates per vector
instead of 4: pairs, AEV and its gradient are the same bits at both levels.
"""
import os
import subprocess
import sys

import pytest
import torch

import torchani_fast
from support import (MOLECULES, aev_args, assert_energies, assert_forces, atoms_to_tensors, energy_forces,
                      model_pair, read_molecule, reference_model)
from support_networks import make_groups, panels_of, reference

op = torch.ops.torchani_fast.ensemble_mlp


def run_at(level, fn, *args):
    assert torchani_fast.cpu_isa(level) == level
    return fn(*args)


# Widths 112 = 64 + 48 and 80 = 64 + 16: AVX-512 tiles of 4, 3 and 1 panels,
# and slabs of 2 and 1 W^T panels made on the fly in the backward; 2, 7, 45, 23
# and 61 rows: tiles of 1 to 6 rows in the forward, dot products of 1 to 3
# rows in the backward of the 2 and 7 (<= 8 rows), W^T made on the fly for
# the others.
WIDE = ([112, 80, 32], [48, 96, 64, 32, 80], [2, 7, 45, 23, 61])
# A hidden layer wider than the W^T slabs' buffer (256): dot products for any
# number of rows; 9 rows, the fewest that take the slabs elsewhere.
WIDER = ([288, 48], [64, 96, 80], [12, 9, 30])


@pytest.mark.parametrize("shapes", [WIDE, WIDER], ids=["wide", "wider"])
@pytest.mark.parametrize("zero_chunks", [False, True], ids=["dense", "zero-chunks"])
def test_op_at_every_level(levels, zero_chunks, shapes):
    members = 3
    aev, atoms, sizes, columns, first, packs, layers, mlps = make_groups(torch.float32, members, *shapes, features=128)
    if zero_chunks:  # chunks of 16 AEV columns that are 0 in some rows, as real AEVs have
        g = torch.Generator().manual_seed(5)
        for i, (atoms_g, cols) in enumerate(zip(atoms.split(sizes), columns)):
            zero = torch.rand(len(atoms_g), cols.shape[0] // 16, generator=g) < 0.5
            if i == 0:  # chunks 0 and 1 zero in every row: a whole slab of J that no row needs
                zero[:, :2] = True
            for r, a in enumerate(atoms_g.tolist()):
                for c in zero[r].nonzero().flatten().tolist():
                    aev[a, cols[16 * c: 16 * c + 16]] = 0
    panels = panels_of(first, packs, layers, members)
    v_ref, j_ref = reference(aev, atoms, sizes, columns, mlps)
    # With the flag, J may skip an atom's zero chunks (test_ensemble_op.py): compare the others.
    compared = torch.cat([(aev[a][:, cols] != 0).view(len(a), -1, 16).any(2).repeat_interleave(16, 1).flatten()
                          for a, cols in zip(atoms.split(sizes), columns)])
    assert zero_chunks != bool(compared.all())
    out = {}
    for level in levels:
        out[level] = run_at(level, op, aev, atoms, sizes, columns, first, packs, panels, layers, members,
                            True, zero_chunks)
        values, jac = out[level]
        torch.testing.assert_close(values, v_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(jac[compared], j_ref[compared], rtol=1e-5, atol=1e-5)
    if "avx512" in out:
        assert torch.equal(out["avx512"][0], out["avx2"][0])
        torch.testing.assert_close(out["avx512"][1][compared], out["avx2"][1][compared], rtol=1e-5, atol=1e-6)


def test_zero_chunk_runs_at_every_level(levels):
    # 1024 AEV columns: chunk bitmasks of 64 bits, runs of nonzero chunks up to
    # the last bit. 13 rows, tiles of 6, 6 and 1: chunk 0 zero in the whole
    # first tile (one run, chunks 1-63), the even chunks zero in the second (32
    # runs of one chunk), only chunk 63 nonzero in the last row. Skipping a
    # chunk of zeros drops products that are exactly 0: each row's values are
    # the same bits as when it is its own group (its own chunks skipped).
    members = 2
    aev, atoms, sizes, columns, first, packs, layers, mlps = make_groups(
        torch.float32, members, [32, 16], [1024], [13], features=1024)
    rows = atoms.tolist()
    chunks = aev.view(aev.shape[0], 64, 16)  # columns are 0 .. 1023, in order
    for a in rows[:6]:
        chunks[a, 0] = 0
    for a in rows[6:12]:
        chunks[a, 0::2] = 0
    chunks[rows[12], :63] = 0
    panels = panels_of(first, packs, layers, members)
    v_ref, j_ref = reference(aev, atoms, sizes, columns, mlps)
    compared = (aev[atoms] != 0).view(13, 64, 16).any(2).repeat_interleave(16, 1).flatten()
    one = [1] * 13  # every row its own group (same weights)
    for level in levels:
        values, jac = run_at(level, op, aev, atoms, sizes, columns, first, packs, panels, layers, members,
                             True, True)
        torch.testing.assert_close(values, v_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(jac[compared], j_ref[compared], rtol=1e-5, atol=1e-5)
        alone, _ = run_at(level, op, aev, atoms, one, columns * 13, first * 13, packs * 13, panels * 13,
                          layers * 13, members, False, True)
        if level != "none":  # panels: the same order of sums in a tile of any number of rows
            assert torch.equal(values, alone)


def test_stored_wt_backward_same_bits_as_transposed(levels):
    # 300 rows in one group: 4 blocks of 75, so with AVX-512 the backward
    # multiplies by the stored W^T panels (ensemble/ensemble_cpu.cpp, kStoredMinBlocks);
    # the same rows as three groups of 100 (2 blocks each) transpose W on the
    # fly. Each row's sums run in the same order either way: the same values
    # and J, bit for bit, and both close to plain PyTorch.
    members = 2
    aev, atoms, sizes, columns, first, packs, layers, mlps = make_groups(
        torch.float32, members, [96, 48], [64], [300], features=128)
    panels = panels_of(first, packs, layers, members)
    v_ref, j_ref = reference(aev, atoms, sizes, columns, mlps)
    three = [100, 100, 100]
    for level in levels[1:]:  # the panel levels
        values, jac = run_at(level, op, aev, atoms, sizes, columns, first, packs, panels, layers, members,
                             True, False)
        torch.testing.assert_close(values, v_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(jac, j_ref, rtol=1e-5, atol=1e-5)
        v3, j3 = run_at(level, op, aev, atoms, three, columns * 3, first * 3, packs * 3, panels * 3,
                        layers * 3, members, True, False)
        assert torch.equal(values, v3)
        assert torch.equal(jac, j3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_model_at_every_level(levels, dtype):
    ref, fast = model_pair("ANI2x", dtype)
    species, coords, _, _ = atoms_to_tensors(read_molecule("small.xyz"), dtype)
    e_ref, f_ref = energy_forces(ref, species, coords)
    results = {}
    for level in levels:
        e, f = results[level] = run_at(level, energy_forces, fast, species, coords)
        assert_energies(e, e_ref, dtype)
        assert_forces(f, f_ref, dtype)
    if "avx512" in results:
        assert torch.equal(results["avx512"][0], results["avx2"][0])
        assert_forces(results["avx512"][1], results["avx2"][1], dtype)


@pytest.mark.parametrize("name,molecule", [("ANI2x", "small.xyz"), ("ANI2x", "1hz5.xyz"), ("ANI1x", "small.xyz"),
                                           ("ANI2x", "benzene.xyz")])
def test_neighbors_and_aev_same_bits_at_avx2_and_avx512(levels, name, molecule):
    # ANI-2x: 4 sections and 8 angular shifts, 7 elements (1hz5 has S); ANI-1x: 8 and 4.
    if "avx512" not in levels:
        pytest.skip("this CPU has no AVX-512")
    from torchani_fast import ops

    ref = reference_model(name, torch.float32)
    aevc = ref.potentials["nnp"].aev_computer
    species, coords, cell, pbc = atoms_to_tensors(read_molecule(molecule), torch.float32)  # benzene: periodic
    elem = ref.species_converter(species)
    cutoff = float(aevc.radial.cutoff)
    found = {level: run_at(level, ops.neighbor_pairs, elem, coords, cell, pbc, cutoff, False)
             for level in ("avx2", "avx512")}
    assert all(torch.equal(a, b) for a, b in zip(found["avx2"], found["avx512"]))
    pairs, images = found["avx2"]
    diff, _ = ops.pair_vectors(coords.view(-1, 3), pairs, None if cell is None else images, cell)
    args = aev_args(aevc, torch.float32)
    length = ops.aev(elem, pairs, diff, *args).shape[-1]
    weights = torch.sin(torch.arange(elem.numel() * length, dtype=torch.float32)).view(1, -1, length)
    out = {level: run_at(level, lambda: (ops.aev(elem, pairs, diff, *args),
                                         ops.aev_backward(weights, elem, pairs, diff, *args)))
           for level in ("avx2", "avx512")}
    for a, b in zip(out["avx2"], out["avx512"]):
        assert torch.equal(a, b)
    assert out["avx2"][0].count_nonzero() > 0 and out["avx2"][1].count_nonzero() > 0


def test_bad_cap_is_named(levels):
    with pytest.raises(ValueError, match="'sse4'"):
        torchani_fast.cpu_isa("sse4")
    assert torchani_fast.cpu_isa() == levels[-1]  # unchanged


def test_cap_from_the_environment():
    code = "import torchani_fast; print(torchani_fast.cpu_isa())"
    env = dict(os.environ, TORCHANI_FAST_CPU_ISA="none")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "none", out.stderr
    env["TORCHANI_FAST_CPU_ISA"] = "avx1024"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "TORCHANI_FAST_CPU_ISA='avx1024'" in out.stderr
    assert MOLECULES.is_dir()
