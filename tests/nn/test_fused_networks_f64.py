"""The float64 networks: the op's panel kernels (csrc/ensemble/gemm_f64.h) and
the patched models, against plain PyTorch and TorchANI in float64.

The panel kernels sum each output's products in the same order with AVX2 and
AVX-512 (and apply the same CELU), so the two levels give the same bits; the
portable level ("none") calls BLAS and agrees to rounding.
"""
import copy

import pytest
import torch

import torchani_fast
from torchani_fast.testing import random_model
from support import (BATCHES, ISA_LEVELS, assert_energies, assert_forces, energy_forces, model_pair,
                      padded_batch, reference_model, with_threads)
from support_networks import make_groups, panels_of, reference

ops = torch.ops.torchani_fast
op = ops.ensemble_mlp
TOL = dict(rtol=1e-10, atol=1e-12)


def _levels():
    best = torchani_fast.cpu_isa()
    return ISA_LEVELS[: ISA_LEVELS.index(best) + 1]  # lowest first


def _at(level, fn):
    before = torchani_fast.cpu_isa()
    torchani_fast.cpu_isa(level)
    try:
        return fn()
    finally:
        torchani_fast.cpu_isa(before)


# widths, AEV columns per group, atoms per group. Widths 112 = 3 x 32 + 16 and
# 80: AVX-512 tiles of 2 panels and of 1, AVX2 half panels; group sizes from 1
# to 200 rows: tiles of 1 to 6 rows, blocks of 96 rows (two and three blocks).
SHAPES = {
    "ani-like": ([32, 16, 16], [48, 32, 64], [70, 5, 130]),
    "wide": ([112, 80, 32], [48, 96, 64, 32, 80], [2, 7, 45, 23, 61]),
    "tile-edges": ([48, 32, 16], [16, 32, 48, 64, 32, 16], [1, 6, 7, 12, 13, 95]),
    "blocks": ([64, 48], [32, 48], [97, 200]),
    "one-layer-deep": ([32], [16, 32], [3, 4]),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_panels_match_pytorch(shape, isa):
    members = 3
    aev, atoms, sizes, columns, first, packs, layers, mlps = make_groups(torch.float64, members, *SHAPES[shape], features=128)
    v_ref, j_ref = reference(aev, atoms, sizes, columns, mlps)
    panels = panels_of(first, packs, layers, members)
    for p in (panels, []):
        values, jac = op(aev, atoms, sizes, columns, first, packs, p, layers, members, True)
        torch.testing.assert_close(values, v_ref, **TOL)
        torch.testing.assert_close(jac, j_ref, **TOL)
        values_only, empty = op(aev, atoms, sizes, columns, first, packs, p, layers, members, False)
        assert empty.numel() == 0 and torch.equal(values_only, values)


def test_avx2_and_avx512_give_the_same_bits():
    if torchani_fast.cpu_isa() != "avx512":
        pytest.skip("needs AVX-512")
    members = 4
    aev, atoms, sizes, columns, first, packs, layers, mlps = make_groups(torch.float64, members, *SHAPES["wide"], features=128)
    aev[aev < 0.1] = -aev[aev < 0.1]  # negative pre-activations too
    panels = panels_of(first, packs, layers, members)
    out = {level: _at(level, lambda: op(aev, atoms, sizes, columns, first, packs, panels, layers, members, True))
           for level in ("avx2", "avx512")}
    assert torch.equal(out["avx2"][0], out["avx512"][0])
    assert torch.equal(out["avx2"][1], out["avx512"][1])
    # the portable level (BLAS) is a different sum order: rounding only
    none = _at("none", lambda: op(aev, atoms, sizes, columns, first, packs, panels, layers, members, True))
    torch.testing.assert_close(none[0], out["avx512"][0], rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(none[1], out["avx512"][1], rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gelu_panels_match_pytorch(bias, isa):
    members = 3
    widths, cols, sizes = [48, 32, 16], [32, 64, 16], [9, 40, 1]
    aev, atoms, sizes, columns, first, packs, layers, mlps = make_groups(
        torch.float64, members, widths, cols, sizes, activation="gelu", bias=bias)
    ref, jac_ref = reference(aev, atoms, sizes, columns, mlps, "gelu")
    panels = panels_of(first, packs, layers, members)
    values, jac = ops.ensemble_mlp(aev, atoms, sizes, columns, first, packs, panels, layers,
                                   members, True, False, 1)
    torch.testing.assert_close(values, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(jac, jac_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("panel_dtype", [torch.float64, torch.float32])
def test_gradcheck_and_gradgradcheck_with_panels(panel_dtype):
    # (float32 panels: of weights that are float32 values, as packing.py makes them)
    members = 2
    aev, atoms, sizes, columns, first, packs, layers, _ = make_groups(
        torch.float64, members, [32, 16], [16, 32], [3, 7], features=40)
    first, packs = _float32_valued(first), _float32_valued(packs)
    panels = [p.to(panel_dtype) for p in panels_of(first, packs, layers, members)]

    def atomic(a):
        return torch.ops.torchani_fast.ensemble_atomic(a, atoms, sizes, columns, first, packs, panels, layers,
                                                       members, False, 0)

    def energies(a):
        return torch.ops.torchani_fast.ensemble_energies(a, atoms, sizes, columns, first, packs, panels, layers,
                                                         members, 1, members, False, 0)

    x = aev.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(atomic, (x,))
    assert torch.autograd.gradcheck(energies, (x,))
    assert torch.autograd.gradgradcheck(energies, (x,))


@pytest.mark.parametrize("zero_chunks", [False, True], ids=["dense", "zero-chunks"])
def test_backward_from_w_same_bits_as_stored_wt(zero_chunks):
    # 300 rows in one group: 4 blocks of 75, so the backward multiplies by the
    # stored W^T panels (ensemble/ensemble_cpu.cpp, kStoredMinBlocks); the same
    # rows as three groups of 100 (2 blocks each): with AVX-512 their backward
    # makes W^T's panels from W's (panel_nt_f64), with AVX2 it reads the stored
    # ones. The 288-wide layer is wider than panel_nt_f64's slab (256): stored
    # W^T for every group. Each J entry sums the same products in the same
    # order either way: the same bits, at every level. With zero chunks (and
    # zero_blocks_exact) J skips the 16-column chunks a row's AEV lacks, whole
    # slabs too (chunks 0 and 1 are 0 in every row); the chunks a row has are compared.
    members = 2
    aev, atoms, sizes, columns, first, packs, layers, mlps = make_groups(
        torch.float64, members, [96, 288, 48], [64], [300], features=128)
    if zero_chunks:
        g = torch.Generator().manual_seed(3)
        cols = columns[0]
        zero = torch.rand(300, 4, generator=g) < 0.4
        zero[:, :2] = True
        for r, a in enumerate(atoms.tolist()):
            for c in zero[r].nonzero().flatten().tolist():
                aev[a, cols[16 * c: 16 * c + 16]] = 0
    compared = (aev[atoms][:, columns[0]] != 0).view(300, 4, 16).any(2).repeat_interleave(16, 1).flatten()
    assert zero_chunks != bool(compared.all())
    panels = panels_of(first, packs, layers, members)
    v_ref, j_ref = reference(aev, atoms, sizes, columns, mlps)
    three = [100, 100, 100]
    for level in _levels()[1:]:  # the panel levels
        values, jac = _at(level, lambda: op(aev, atoms, sizes, columns, first, packs, panels, layers,
                                            members, True, zero_chunks))
        torch.testing.assert_close(values, v_ref, **TOL)
        torch.testing.assert_close(jac[compared], j_ref[compared], **TOL)
        v3, j3 = _at(level, lambda: op(aev, atoms, three, columns * 3, first * 3, packs * 3, panels * 3,
                                       layers * 3, members, True, zero_chunks))
        assert torch.equal(values, v3)
        assert torch.equal(jac[compared], j3[compared])
        if zero_chunks:  # chunks 0 and 1: no row has them, J is 0 there
            assert not j3.view(300, 64)[:, :32].any()


def test_panels_of_another_dtype_are_refused():
    # float64 AEVs take float64 panels, or float32 ones (widened: the next
    # tests); nothing else, and float32 AEVs take float32 panels only.
    members = 2
    if torchani_fast.cpu_isa() == "none":
        pytest.skip("panels are not read without AVX2")
    aev, atoms, sizes, columns, first, packs, layers, _ = make_groups(torch.float64, members, [32, 16], [16], [3])
    panels = [p.half() for p in panels_of(first, packs, layers, members)]
    with pytest.raises(RuntimeError, match=r"panels\[0\], panels\[1\] must be of the AEV's dtype \(Double; "
                                           r"float32 also for a float64 AEV\).*got Half"):
        op(aev, atoms, sizes, columns, first, packs, panels, layers, members, True)
    aev, atoms, sizes, columns, first, packs, layers, _ = make_groups(torch.float32, members, [32, 16], [16], [3])
    panels = [p.double() for p in panels_of(first, packs, layers, members)]
    with pytest.raises(RuntimeError, match=r"must be of the AEV's dtype \(Float;.*got Double"):
        op(aev, atoms, sizes, columns, first, packs, panels, layers, members, True)


def _float32_valued(tensors):
    return [t.float().double() if t.is_floating_point() else t for t in tensors]


@pytest.mark.parametrize("shape", list(SHAPES) + ["stored-wt"])
@pytest.mark.parametrize("zero_chunks", [False, True], ids=["dense", "zero-chunks"])
def test_float32_panels_give_the_same_bits(shape, zero_chunks):
    # Weights that are float32 values: float32 panels, widened as the kernels
    # read them (AVX-512: 12 x 16 tiles and the transposes of panel_nt_f64;
    # AVX2: a buffer per group of 32 columns), give the bits of float64 panels
    # at every panel level: values and J, with and without the zero chunks
    # skipped (zero_blocks_exact). "stored-wt": one group of 300 rows, whose
    # backward multiplies by the stored W^T panels (kStoredMinBlocks).
    members = 3
    widths, cols, rows = ([96, 48], [64], [300]) if shape == "stored-wt" else SHAPES[shape]
    aev, atoms, sizes, columns, first, packs, layers, _ = make_groups(
        torch.float64, members, widths, cols, rows, features=128)
    first, packs = _float32_valued(first), _float32_valued(packs)
    if zero_chunks:  # about a third of each row's 16-column chunks (of its group's columns) zero
        g = torch.Generator().manual_seed(5)
        row = 0
        for n, c in zip(sizes, columns):
            for a in atoms[row:row + n].tolist():
                for j in (torch.rand(len(c) // 16, generator=g) < 0.35).nonzero().flatten().tolist():
                    aev[a, c[16 * j:16 * j + 16]] = 0
            row += n
    compared = torch.ones(sum(n * len(c) for n, c in zip(sizes, columns)), dtype=torch.bool)
    if zero_chunks:
        parts, row = [], 0
        for n, c in zip(sizes, columns):
            x = aev[atoms[row:row + n]][:, c]
            parts.append((x.view(n, -1, 16) != 0).any(2).repeat_interleave(16, 1).flatten())
            row += n
        compared = torch.cat(parts)
        assert not compared.all()
    wide = panels_of(first, packs, layers, members)
    narrow = [p.float() for p in wide]
    assert all(torch.equal(n.double(), w) for n, w in zip(narrow, wide))
    levels = _levels()[1:]
    if not levels:
        pytest.skip("panels are not read without AVX2")
    for level in levels:
        v64, j64 = _at(level, lambda: op(aev, atoms, sizes, columns, first, packs, wide, layers,
                                         members, True, zero_chunks))
        v32, j32 = _at(level, lambda: op(aev, atoms, sizes, columns, first, packs, narrow, layers,
                                         members, True, zero_chunks))
        assert torch.equal(v64, v32), level
        # (with zero_chunks, J's entries in a row's zero chunks are 0 or computed,
        # as a tile's rows decide together: forces multiply them by 0)
        assert torch.equal(j64[compared], j32[compared]), level
    # and the panels' values are what the networks compute with: against BLAS
    v_blas, j_blas = _at("none", lambda: op(aev, atoms, sizes, columns, first, packs, [], layers,
                                            members, True, zero_chunks))
    torch.testing.assert_close(v32, v_blas, **TOL)


def _panel_dtypes(fast):
    nn = fast.potentials["nnp"].neural_networks
    return {p.dtype for plan in nn._native_plans.values() for p in plan.op_args[3]}


def test_float32_valued_weights_get_float32_panels(isa):
    # ANI's weights are float32 values (published in float32; random_model's
    # too): a float64 model packs float32 panels, with the bits of float64
    # panels (narrow_panels=False); a weight that is not a float32 value keeps
    # its layer's panels in float64, still matching TorchANI.
    ref, fast = model_pair("ANI2x", torch.float64)
    species, coords = padded_batch(BATCHES["ANI2x"], torch.float64)
    nn = fast.potentials["nnp"].neural_networks
    e, f = energy_forces(fast, species, coords)
    if isa != "none":
        assert _panel_dtypes(fast) == {torch.float32}
    nn.narrow_panels = False
    nn._eager_clear()
    e64, f64 = energy_forces(fast, species, coords)
    if isa != "none":
        assert _panel_dtypes(fast) == {torch.float64}
    assert torch.equal(e, e64) and torch.equal(f, f64)
    nn.narrow_panels = True
    with torch.no_grad():  # in place: the packs are rebuilt on the next call
        for model in (ref, fast):
            lin = model.potentials["nnp"].neural_networks[0].atomics["H"][2]
            lin.weight[0, 0] += 1e-9
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert_energies(e, e_ref, torch.float64)
    assert_forces(f, f_ref, torch.float64)
    if isa != "none":
        assert _panel_dtypes(fast) == {torch.float32, torch.float64}


def test_same_bits_for_any_number_of_threads():
    members = 8
    aev, atoms, sizes, columns, first, packs, layers, _ = make_groups(torch.float64, members, *SHAPES["blocks"])
    panels = panels_of(first, packs, layers, members)
    runs = [with_threads(n, lambda: op(aev, atoms, sizes, columns, first, packs, panels, layers, members, True))
            for n in (1, 2, 4)]
    for values, jac in runs[1:]:
        assert torch.equal(values, runs[0][0]) and torch.equal(jac, runs[0][1])


# -- patched models against TorchANI, float64 ---------------------------------------------


def _uses_panels(fast):
    nn = fast.potentials["nnp"].neural_networks
    return any(len(plan.op_args[3]) > 0 for plan in nn._native_plans.values())


@pytest.mark.parametrize("name", ["ANI2x", "ANI1x", "ANI1ccx"])
def test_models_match_torchani(name, isa):
    ref, fast = model_pair(name, torch.float64)
    species, coords = padded_batch(BATCHES["ANI2x" if name == "ANI2x" else "ANI1x"], torch.float64)
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert_energies(e, e_ref, torch.float64)
    assert_forces(f, f_ref, torch.float64)
    assert _uses_panels(fast)  # (read by the kernels from AVX2 up)
    a_ref = ref.atomic_energies((species, coords)).energies
    a = fast.atomic_energies((species, coords)).energies
    assert_energies(a, a_ref, torch.float64)


def test_periodic_water_matches_torchani():
    from torchani_fast.testing import water_box

    ref, fast = model_pair("ANI2x", torch.float64)
    z, x, cell, pbc = water_box(64)
    e_ref, f_ref = energy_forces(ref, z, x.double(), cell.double(), pbc)
    e, f = energy_forces(fast, z, x.double(), cell.double(), pbc)
    assert_energies(e, e_ref, torch.float64)
    assert_forces(f, f_ref, torch.float64)


def test_gelu_model_matches_torchani(isa):
    # ANI-2xr: GELU networks without biases (random weights of its architecture).
    ref = random_model("ANI2xr").double()
    fast = torchani_fast.patch(copy.deepcopy(ref))
    species, coords = padded_batch(BATCHES["ANI2x"], torch.float64)
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert_energies(e, e_ref, torch.float64)
    assert_forces(f, f_ref, torch.float64)


def test_torchscript_float64_matches_eager():
    ref = reference_model("ANI1x", torch.float64)
    fast = torchani_fast.patch(ref)
    scripted = torch.jit.script(torchani_fast.patch(reference_model("ANI1x", torch.float64)))
    species, coords = padded_batch(BATCHES["ANI1x"], torch.float64)
    e, f = energy_forces(fast, species, coords)
    e_s, f_s = energy_forces(scripted, species, coords)
    assert torch.equal(e, e_s) and torch.equal(f, f_s)


def test_narrowed_only_when_every_value_is_a_float32_value():
    from torchani_fast.nn.packing import _narrowed

    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 16, 32, generator=g).double()  # float32 values
    pair = [w, w.transpose(1, 2).contiguous()]
    assert [p.dtype for p in _narrowed(pair)] == [torch.float32] * 2
    assert all(torch.equal(n.double(), p) for n, p in zip(_narrowed(pair), pair))
    for value in (0.1, 1e-50, 1e300, float("nan")):  # not float32 values (0.1: rounded; the others out of range, NaN)
        bad = w.clone()
        bad[1, 3, 5] = value
        assert _narrowed([bad, bad])[0] is bad
    f32 = [w.float(), w.float()]
    assert _narrowed(f32) is f32  # float32 networks: their own panels
