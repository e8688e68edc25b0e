"""The fused networks' C++ op (torchani_fast::ensemble_mlp) against plain PyTorch.

The reference (tests/support_networks.py) evaluates each member's MLP with
torch.nn.functional and takes J = d(sum over members)/d(input) by autograd:
nothing of torchani_fast.nn is used.
"""
import pytest
import torch

import torchani_fast  # noqa: F401  (also loads the op)
from support_networks import make_groups, panels_of, reference, reference_values

op = torch.ops.torchani_fast.ensemble_mlp


CASES = {
    # widths, AEV columns per group, atoms per group
    "ani-like": ([32, 16, 16], [48, 32, 64], [70, 5, 130]),
    "one-atom": ([32, 16, 16], [16], [1]),
    "two-atoms": ([48, 32, 16], [32, 64], [2, 1]),  # backward on the forward panels (<= 2 rows)
    "odd-widths": ([10, 6], [7, 13], [9, 66]),  # not multiples of 16: BLAS only
    # last hidden width 30 = 16 + 8 + 6: every step of the last layer's dot products
    "dot-tails": ([16, 30], [16, 32], [9, 40]),
    "linear": ([], [16, 32], [4, 3]),  # one Linear layer: J = W^T
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_matches_pytorch(case, dtype):
    widths, cols, sizes = CASES[case]
    members = 3
    aev, atoms, sizes, columns, first, packs, layers, mlps = make_groups(dtype, members, widths, cols, sizes)
    v_ref, j_ref = reference(aev, atoms, sizes, columns, mlps)
    variants = [[]]
    if dtype == torch.float32 and all(w % 16 == 0 for w in widths + cols) and widths:
        variants.append(panels_of(first, packs, layers, members))
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for panels in variants:
        values, jac = op(aev, atoms, sizes, columns, first, packs, panels, layers, members, True)
        torch.testing.assert_close(values, v_ref, **tol)
        torch.testing.assert_close(jac, j_ref, **tol)
        values_only, empty = op(aev, atoms, sizes, columns, first, packs, panels, layers, members, False)
        assert empty.numel() == 0
        torch.testing.assert_close(values_only, values, rtol=0, atol=0)


def test_same_bits_for_any_number_of_threads():
    widths, cols, sizes = CASES["ani-like"]
    args = make_groups(torch.float32, 8, widths, cols, sizes)[:7]
    aev, atoms, sizes, columns, first, packs, layers = args
    panels = panels_of(first, packs, layers, 8)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(op(aev, atoms, sizes, columns, first, packs, panels, layers, 8, True))
    finally:
        torch.set_num_threads(threads)
    for values, jac in results[1:]:
        assert torch.equal(values, results[0][0]) and torch.equal(jac, results[0][1])


def test_bad_arguments_are_named():
    widths, cols, sizes = CASES["ani-like"]
    aev, atoms, sizes, columns, first, packs, layers, _ = make_groups(torch.float32, 2, widths, cols, sizes)
    good = dict(aev=aev, atoms=atoms, sizes=sizes, columns=columns, first=first, packs=packs, panels=[],
                layers=layers, members=2, input_grad=True)

    def call(**change):
        kw = {**good, **change}
        return op(kw["aev"], kw["atoms"], kw["sizes"], kw["columns"], kw["first"], kw["packs"], kw["panels"],
                  kw["layers"], kw["members"], kw["input_grad"])

    bad_atoms = atoms.clone()
    bad_atoms[0] = aev.shape[0]
    bad_cols = [c.clone() for c in columns]
    bad_cols[1][-1] = aev.shape[1]
    for change, message in [
        (dict(atoms=bad_atoms), "atoms must be distinct rows"),
        (dict(atoms=torch.cat([atoms[:1], atoms[:-1]])), "atoms must be distinct rows"),
        (dict(columns=bad_cols), r"columns\[1\] must be in"),
        (dict(sizes=[sizes[0] + 1] + sizes[1:]), "sizes add up to"),
        (dict(first=[first[0].double()] + first[1:]), r"first\[0\]"),
        (dict(packs=packs[:-1]), "packs"),
        (dict(layers=layers[:-1]), "one entry per group"),
        (dict(members=0), "members = 0"),
        (dict(aev=aev.t()), "aev must be a contiguous"),
        (dict(aev=aev.half()), "float32 or float64"),
        (dict(panels=[torch.zeros(1)]), "panels holds"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            call(**change)


def test_opcheck():
    widths, cols, sizes = CASES["ani-like"]
    aev, atoms, sizes, columns, first, packs, layers, _ = make_groups(torch.float32, 2, widths, cols, sizes)
    panels = panels_of(first, packs, layers, 2)
    for grad in (True, False):
        torch.library.opcheck(op.default, (aev, atoms, sizes, columns, first, packs, panels, layers, 2, grad),
                              test_utils=("test_schema", "test_faketensor"))


def test_backward_of_an_ensemble_mean():
    # ensemble_mlp_backward: grad_values[0] * J scattered to (atom, column) when
    # every member has the same incoming gradient; empty (recompute) otherwise.
    widths, cols, sizes = CASES["ani-like"]
    aev, atoms, sizes, columns, first, packs, layers, mlps = make_groups(torch.float64, 3, widths, cols, sizes)
    values, jac = op(aev, atoms, sizes, columns, first, packs, [], layers, 3, True)
    weights = torch.rand(aev.shape[0], dtype=torch.float64)  # per row of aev
    _, j_ref = reference(aev, atoms, sizes, columns, mlps)  # d(sum of members)/d(used columns)
    expected = torch.zeros_like(aev)
    for atoms_g, cols, j in zip(atoms.split(sizes), columns, j_ref.split([n * c.numel() for n, c in zip(sizes, columns)])):
        w = weights[atoms_g]
        expected[atoms_g.unsqueeze(1), cols.unsqueeze(0)] = w.unsqueeze(1) * j.view(atoms_g.numel(), -1)
    differing = weights.expand(3, -1).clone()
    padding = [i for i in range(aev.shape[0]) if i not in set(atoms.tolist())]
    differing[1, padding] += 1  # rows of atoms in no group are not read
    grad = torch.ops.torchani_fast.ensemble_mlp_backward(differing, atoms, sizes, columns, jac, aev.shape[1])
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    differing[2, atoms[5]] += 1
    empty = torch.ops.torchani_fast.ensemble_mlp_backward(differing, atoms, sizes, columns, jac, aev.shape[1])
    assert empty.shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_nan_input_gives_nan(dtype):
    # A NaN in an AEV row must not come out as a finite energy.
    widths, cols, sizes = CASES["ani-like"]
    aev, atoms, sizes, columns, first, packs, layers, _ = make_groups(dtype, 2, widths, cols, sizes)
    panels = panels_of(first, packs, layers, 2) if dtype == torch.float32 else []
    aev[atoms[3], columns[0]] = float("nan")
    values, jac = op(aev, atoms, sizes, columns, first, packs, panels, layers, 2, True)
    assert torch.isnan(values[:, atoms[3]]).all()
    others = torch.ones(aev.shape[0], dtype=torch.bool)
    others[atoms[3]] = False
    assert torch.isfinite(values[:, others]).all()


# --- ensemble_atomic: the op TorchScript models call, differentiable in C++ ------------------


@pytest.mark.parametrize("case", ["ani-like", "two-atoms", "linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_ensemble_atomic_values_and_gradients(case, dtype):
    widths, cols, sizes = CASES[case]
    aev, atoms, sizes, columns, first, packs, layers, mlps = make_groups(dtype, 3, widths, cols, sizes)
    panels = panels_of(first, packs, layers, 3) if dtype == torch.float32 and widths else []
    args = (atoms, sizes, columns, first, packs, panels, layers, 3)
    expected_values = op(aev, atoms, sizes, columns, first, packs, panels, layers, 3, False)[0]
    assert torch.equal(torch.ops.torchani_fast.ensemble_atomic(aev, *args), expected_values)
    x = aev.clone().requires_grad_(True)
    values = torch.ops.torchani_fast.ensemble_atomic(x, *args)
    assert torch.equal(values.detach(), expected_values)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    g = torch.Generator().manual_seed(1)
    # The same gradient for every member (grad * J) and a different one per
    # member (recomputation), against autograd through plain PyTorch.
    for weights in (torch.rand(aev.shape[0], generator=g, dtype=dtype).expand(3, -1),
                    torch.rand(3, aev.shape[0], generator=g, dtype=dtype)):
        (grad,) = torch.autograd.grad((torch.ops.torchani_fast.ensemble_atomic(x, *args) * weights).sum(), x)
        (grad_ref,) = torch.autograd.grad((reference_values(x, atoms, sizes, columns, mlps) * weights).sum(), x)
        torch.testing.assert_close(grad, grad_ref, **tol)
    if not widths:
        return  # one linear layer: no second derivative
    # create_graph=True: the backward is differentiable (Hessian-vector products).
    weights = torch.rand(aev.shape[0], generator=g, dtype=dtype).expand(3, -1)
    tangent = torch.rand(aev.shape, generator=g, dtype=dtype)
    hvps = []
    for f in (lambda y: torch.ops.torchani_fast.ensemble_atomic(y, *args),
              lambda y: reference_values(y, atoms, sizes, columns, mlps)):
        (grad,) = torch.autograd.grad((f(x) * weights).sum(), x, create_graph=True)
        hvps.append(torch.autograd.grad((grad * tangent).sum(), x)[0])
    torch.testing.assert_close(hvps[0], hvps[1], **tol)


def test_ensemble_atomic_recomputes_in_chunks():
    # Per-member gradients recompute the activations 1024 atoms at a time: a
    # group of 1100 atoms spans two chunks.
    aev, atoms, sizes, columns, first, packs, layers, mlps = make_groups(torch.float64, 2, [16], [24, 16], [1100, 30], features=32)
    x = aev.clone().requires_grad_(True)
    weights = torch.rand(2, aev.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    values = torch.ops.torchani_fast.ensemble_atomic(x, atoms, sizes, columns, first, packs, [], layers, 2)
    (grad,) = torch.autograd.grad((values * weights).sum(), x)
    (grad_ref,) = torch.autograd.grad((reference_values(x, atoms, sizes, columns, mlps) * weights).sum(), x)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-14)


def test_ensemble_atomic_gradcheck():
    widths, cols, sizes = [8, 4], [6, 10], [4, 3]
    aev, atoms, sizes, columns, first, packs, layers, _ = make_groups(torch.float64, 2, widths, cols, sizes, features=12)
    f = lambda y: torch.ops.torchani_fast.ensemble_atomic(y, atoms, sizes, columns, first, packs, [], layers, 2)  # noqa: E731
    x = aev.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))


def test_ensemble_atomic_opcheck():
    widths, cols, sizes = CASES["ani-like"]
    aev, atoms, sizes, columns, first, packs, layers, _ = make_groups(torch.float32, 2, widths, cols, sizes)
    panels = panels_of(first, packs, layers, 2)
    torch.library.opcheck(torch.ops.torchani_fast.ensemble_atomic.default,
                          (aev, atoms, sizes, columns, first, packs, panels, layers, 2),
                          test_utils=("test_schema", "test_faketensor"))


# --- ensemble_energies: the values reduced to energies in the op ----------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_ensemble_energies_values_and_gradients(dtype):
    # (molecules,) = sum over each molecule's atoms and the members / divisor,
    # bit for bit the ATen reduction of ensemble_atomic's values; gradients
    # (grad * J, and create_graph=True) against autograd through plain PyTorch.
    widths, cols, sizes = CASES["ani-like"]
    aev, atoms, sizes, columns, first, packs, layers, mlps = make_groups(dtype, 3, widths, cols, sizes)
    assert aev.shape[0] == 208  # 4 molecules of 52 rows
    panels = panels_of(first, packs, layers, 3) if dtype == torch.float32 else []
    args = (atoms, sizes, columns, first, packs, panels, layers, 3)
    energies = torch.ops.torchani_fast.ensemble_energies
    for divisor in (3, 5):
        values = torch.ops.torchani_fast.ensemble_atomic(aev, *args)
        expected = values.view(3, 4, -1).sum(2).sum(0) / divisor
        assert torch.equal(energies(aev, *args, 4, divisor), expected)
    x = aev.clone().requires_grad_(True)
    weights = torch.rand(4, dtype=dtype, generator=torch.Generator().manual_seed(3))
    (grad,) = torch.autograd.grad((energies(x, *args, 4, 5) * weights).sum(), x, create_graph=dtype == torch.float64)
    ref_energies = reference_values(x, atoms, sizes, columns, mlps).view(3, 4, -1).sum(2).sum(0) / 5
    (grad_ref,) = torch.autograd.grad((ref_energies * weights).sum(), x, create_graph=dtype == torch.float64)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, grad_ref, **tol)
    if dtype == torch.float64:  # the backward is differentiable (Hessian-vector products)
        tangent = torch.rand(aev.shape, dtype=dtype, generator=torch.Generator().manual_seed(4))
        hvp = torch.autograd.grad((grad * tangent).sum(), x)[0]
        hvp_ref = torch.autograd.grad((grad_ref * tangent).sum(), x)[0]
        torch.testing.assert_close(hvp, hvp_ref, **tol)


def test_ensemble_energies_gradcheck_and_errors():
    widths, cols, sizes = [8, 4], [6, 10], [4, 3]
    aev, atoms, sizes, columns, first, packs, layers, _ = make_groups(torch.float64, 2, widths, cols, sizes, features=12)
    aev = torch.cat([aev, aev.new_zeros(2, aev.shape[1])])  # 12 rows: 3 molecules of 4
    args = (atoms, sizes, columns, first, packs, [], layers, 2)
    f = lambda y: torch.ops.torchani_fast.ensemble_energies(y, *args, 3, 2)  # noqa: E731
    x = aev.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))
    torch.library.opcheck(torch.ops.torchani_fast.ensemble_energies.default, (aev, *args, 3, 2),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match="molecules = 5 must be >= 1 and divide the 12 rows"):
        torch.ops.torchani_fast.ensemble_energies(aev, *args, 5, 2)
    with pytest.raises(RuntimeError, match="divisor = 0 must be >= 1"):
        torch.ops.torchani_fast.ensemble_energies(aev, *args, 3, 0)


@pytest.mark.parametrize("int_dtype", [torch.int64, torch.int32])
def test_group_atoms_is_a_stable_sort_by_element(int_dtype):
    # Without an AEV: one group per element present, atoms by element then index
    # (what a stable argsort gives); padding (-1) and indices out of range
    # belong to no group; every group reads the columns of every element present.
    g = torch.Generator().manual_seed(5)
    elem = torch.randint(-1, 5, (7, 11), generator=g).to(int_dtype)  # 4 = out of range for S = 4
    elem[elem == 2] = 1  # element 2 absent
    atoms, groups = torch.ops.torchani_fast.group_atoms(elem, 4)
    flat = elem.flatten().long()
    in_range = (flat >= 0) & (flat < 4)
    expected = torch.argsort(torch.where(in_range, flat, 4), stable=True)[: int(in_range.sum())]
    assert torch.equal(atoms, expected)
    assert groups.tolist() == [[e, 0b1011, int((flat == e).sum())] for e in (0, 1, 3)]
    atoms, groups = torch.ops.torchani_fast.group_atoms(torch.full((2, 3), -1, dtype=int_dtype), 4)
    assert atoms.shape == (0,) and groups.shape == (0, 3)
    with pytest.raises(RuntimeError, match="aev must be"):
        torch.ops.torchani_fast.group_atoms(elem, 4, torch.zeros(5, 64), 16, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sizes", [[70, 5, 130], [2, 1, 9]], ids=["blocks", "one-two-rows"])
def test_zero_chunks(sizes, dtype, isa):
    # AEV rows with 16-column chunks of zeros (of the columns a group reads): the
    # panel kernels (float32 and float64, each instruction set) skip a chunk in a tile of rows when it is 0 in all of
    # them. The values are those of the reference (and do not depend on the
    # flag). J is the reference's unless zero_blocks_exact: then it is 0 in the
    # chunks skipped, and still the reference's wherever the row's chunk is not 0.
    # (Only the panel kernels skip chunks: the portable path, cpu_isa "none",
    # computes them, which the flag allows.)
    skips = isa != "none"
    members = 3
    aev, atoms, sizes, columns, first, packs, layers, mlps = make_groups(
        dtype, members, [32, 16, 16], [48, 32, 64], sizes)
    g = torch.Generator().manual_seed(3)
    dead = []  # per group: a chunk that is 0 in all its rows
    for atoms_g, cols in zip(atoms.split(sizes), columns):
        n_chunks = cols.shape[0] // 16
        zero = torch.rand(len(atoms_g), n_chunks, generator=g) < 0.4
        zero[:, n_chunks - 1] = True
        zero[0] = True  # a row with no nonzero chunk at all
        for r, a in enumerate(atoms_g.tolist()):
            for c in zero[r].nonzero().flatten().tolist():
                aev[a, cols[16 * c: 16 * c + 16]] = 0
        dead.append(n_chunks - 1)
    panels = panels_of(first, packs, layers, members)
    v_ref, j_ref = reference(aev, atoms, sizes, columns, mlps)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    v0, j0 = op(aev, atoms, sizes, columns, first, packs, panels, layers, members, True, False)
    v1, j1 = op(aev, atoms, sizes, columns, first, packs, panels, layers, members, True, True)
    torch.testing.assert_close(v0, v_ref, **tol)
    assert torch.equal(v0, v1)
    torch.testing.assert_close(j0, j_ref, **tol)
    off = 0
    for atoms_g, cols, c in zip(atoms.split(sizes), columns, dead):
        k = cols.shape[0]
        j1_g, jr_g = j1[off: off + len(atoms_g) * k].view(-1, k), j_ref[off: off + len(atoms_g) * k].view(-1, k)
        off += len(atoms_g) * k
        assert (jr_g[:, 16 * c: 16 * c + 16] != 0).any()
        if skips:
            assert (j1_g[:, 16 * c: 16 * c + 16] == 0).all()
        nonzero = (aev[atoms_g][:, cols].view(len(atoms_g), -1, 16) != 0).any(2).repeat_interleave(16, 1)
        torch.testing.assert_close(j1_g[nonzero], jr_g[nonzero], **tol)
