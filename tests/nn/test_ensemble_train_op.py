"""torchani_fast::ensemble_train (the networks while their weights require grad)
against plain PyTorch, and its first, second and third derivatives by
gradcheck / gradgradcheck in float64.

The reference evaluates each member's MLP with torch.nn.functional
(support_networks.reference_values); the op's backward formulas (the weight
gradients, the force loss's second derivatives, the recorded fallbacks) are
checked against finite differences and against autograd through that reference.
"""
import pytest
import torch

import torchani_fast  # noqa: F401  (loads the op)
from support_networks import make_groups, reference_values

op = torch.ops.torchani_fast.ensemble_train

# widths, AEV columns per group, atoms per group (small: gradcheck differentiates every input)
CASES = {
    "two-groups": ([5, 4], [6, 3], [4, 3]),
    "one-layer": ([], [4, 5], [2, 3]),  # a single Linear: J = W^T
    "deep": ([4, 3, 3], [5], [5]),
}


def setup(case, members=2, activation=0, features=7, seed=0):
    widths, cols, sizes = CASES[case]
    aev, atoms, sizes, columns, first, packs, layers, mlps = make_groups(
        torch.float64, members, widths, cols, sizes, features=features, seed=seed)
    return aev, atoms, sizes, columns, first, packs, layers, mlps


def as_leaves(tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def call(aev, atoms, sizes, columns, first, packs, layers, members, small=0, activation=0):
    return op(aev, atoms, sizes, columns, first, packs, layers, members, small, activation)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("small", [0, 100], ids=["addmm", "baddbmm"])
def test_values_and_gradients_match_pytorch(case, small):
    aev, atoms, sizes, columns, first, packs, layers, mlps = setup(case)
    members = mlps[0][0][0].shape[0]
    x = aev.clone().requires_grad_(True)
    ref = reference_values(x, atoms, sizes, columns, mlps)
    got = call(x, atoms, sizes, columns, first, packs, layers, members, small)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)
    g = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (gr,) = torch.autograd.grad(ref, x, g)
    (gg,) = torch.autograd.grad(got, x, g)
    torch.testing.assert_close(gg, gr, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("case", list(CASES))
def test_first_layer_weight_gradient_matches_pytorch(case):
    """d(sum g * values)/dW1 by the op against autograd through the reference
    (whose weights are the same numbers in the reference's per-member layout)."""
    aev, atoms, sizes, columns, first, packs, layers, mlps = setup(case)
    members = mlps[0][0][0].shape[0]
    w1 = as_leaves(first)
    got = call(aev, atoms, sizes, columns, w1, packs, layers, members)
    g = torch.randn(got.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad(got, w1, g)
    leaves = [ws[0].detach().clone().requires_grad_(True) for ws, _ in mlps]
    ref_mlps = [([leaf] + ws[1:], bs) for leaf, (ws, bs) in zip(leaves, mlps)]
    ref = reference_values(aev, atoms, sizes, columns, ref_mlps)
    ref_grads = torch.autograd.grad(ref, leaves, g)
    for got_g, ref_g in zip(grads, ref_grads):  # (K, members * d1) against (members, K, d1)
        torch.testing.assert_close(got_g, ref_g.permute(1, 0, 2).reshape(got_g.shape),
                                   rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("activation", [0, 1], ids=["celu", "gelu"])
@pytest.mark.parametrize("case", list(CASES))
def test_gradcheck_and_gradgradcheck(case, activation):
    """First and second derivatives in the AEV and every weight: the second
    derivatives run InputGrad's written-out backward for the AEV gradient and
    the recorded fallback for the weight gradients under create_graph."""
    aev, atoms, sizes, columns, first, packs, layers, mlps = setup(case, seed=3)
    members = mlps[0][0][0].shape[0]
    nf = len(first)
    inputs = as_leaves([aev] + first + packs)

    def f(*ts):
        return call(ts[0], atoms, sizes, columns, list(ts[1:1 + nf]), list(ts[1 + nf:]), layers,
                    members, 0, activation)

    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("activation", [0, 1], ids=["celu", "gelu"])
def test_force_loss_path_gradients(activation):
    """A force loss as training runs it: the AEV gradient under create_graph
    (only the AEV asked for: InputGrad), then one backward of an energy + force
    loss to the weights and the AEV, both halves of the second derivative
    meeting in one TrainFunction backward. Against gradcheck of the whole loss
    (finite differences) and against the reference's autograd."""
    aev, atoms, sizes, columns, first, packs, layers, mlps = setup("two-groups", seed=4)
    members = mlps[0][0][0].shape[0]
    nf = len(first)
    gen = torch.Generator().manual_seed(5)
    target = torch.randn(aev.shape, dtype=torch.float64, generator=gen)

    def loss(*ts):
        x = ts[0]
        v = call(x, atoms, sizes, columns, list(ts[1:1 + nf]), list(ts[1 + nf:]), layers,
                 members, 0, activation)
        e = v.sum()
        (gx,) = torch.autograd.grad(e, x, create_graph=True)
        return e ** 2 + ((gx - target) ** 2).sum()

    inputs = as_leaves([aev] + first + packs)
    assert torch.autograd.gradcheck(loss, inputs)
    if activation == 0:  # the reference is CELU: the same loss through plain PyTorch
        x = aev.clone().requires_grad_(True)
        w1 = as_leaves(first)
        got = torch.autograd.grad(loss(x, *w1, *packs), [x] + w1)
        leaves = [ws[0].detach().clone().requires_grad_(True) for ws, _ in mlps]
        ref_mlps = [([leaf] + ws[1:], bs) for leaf, (ws, bs) in zip(leaves, mlps)]
        xr = aev.clone().requires_grad_(True)
        e = reference_values(xr, atoms, sizes, columns, ref_mlps).sum()
        (gx,) = torch.autograd.grad(e, xr, create_graph=True)
        ref = torch.autograd.grad(e ** 2 + ((gx - target) ** 2).sum(), [xr] + leaves)
        torch.testing.assert_close(got[0], ref[0], rtol=1e-11, atol=1e-13)
        for got_g, ref_g in zip(got[1:], ref[1:]):
            torch.testing.assert_close(got_g, ref_g.permute(1, 0, 2).reshape(got_g.shape),
                                       rtol=1e-11, atol=1e-13)


def test_third_derivatives():
    """gradgradcheck of the AEV gradient: InputGrad's backward under
    create_graph (the recorded fallback) and TrainFunction's backward with
    gradients of its pre-activations under create_graph."""
    aev, atoms, sizes, columns, first, packs, layers, mlps = setup("two-groups", seed=6)
    members = mlps[0][0][0].shape[0]
    nf = len(first)

    def grad_of(*ts):
        x = ts[0]
        v = call(x, atoms, sizes, columns, list(ts[1:1 + nf]), list(ts[1 + nf:]), layers, members)
        (gx,) = torch.autograd.grad((v * v).sum(), x, create_graph=True)
        return gx

    inputs = as_leaves([aev] + first + packs[:3])
    fixed = packs[3:]

    def g(*ts):
        return grad_of(*ts, *fixed)

    assert torch.autograd.gradcheck(g, inputs)
    assert torch.autograd.gradgradcheck(g, inputs)


def test_float32_matches_float64():
    aev, atoms, sizes, columns, first, packs, layers, mlps = setup("two-groups", seed=7)
    members = mlps[0][0][0].shape[0]
    v64 = call(aev, atoms, sizes, columns, first, packs, layers, members)
    v32 = call(aev.float(), atoms, sizes, columns, [t.float() for t in first],
               [t.float() for t in packs], layers, members)
    assert v32.dtype == torch.float32
    torch.testing.assert_close(v32.double(), v64, rtol=1e-5, atol=1e-6)


def test_no_grad_and_unused_rows():
    """Without grad mode the op is a plain evaluation; rows of the AEV in no
    group (padding) get 0 values and a 0 gradient."""
    aev, atoms, sizes, columns, first, packs, layers, mlps = setup("two-groups", seed=8)
    members = mlps[0][0][0].shape[0]
    with torch.no_grad():
        v = call(aev, atoms, sizes, columns, first, packs, layers, members)
    assert not v.requires_grad
    unused = torch.ones(aev.shape[0], dtype=torch.bool)
    unused[atoms] = False
    assert unused.any() and (v[:, unused] == 0).all()
    x = aev.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(call(x, atoms, sizes, columns, first, packs, layers, members).sum(), x)
    assert (g[unused] == 0).all()


def test_bad_arguments_are_named():
    aev, atoms, sizes, columns, first, packs, layers, mlps = setup("two-groups")
    with pytest.raises(RuntimeError, match="ensemble_train: layers .* need 10 packs, got 9"):
        call(aev, atoms, sizes, columns, first, packs[:-1], layers, 2)
    with pytest.raises(RuntimeError, match="the sizes add up to 7 atoms, but atoms has 6"):
        call(aev, atoms[:-1], sizes, columns, first, packs, layers, 2)
    with pytest.raises(RuntimeError, match="activation must be 0 .* got 3"):
        call(aev, atoms, sizes, columns, first, packs, layers, 2, 0, 3)
    with pytest.raises(RuntimeError, match=r"first\[1\] must be \(3, members"):
        call(aev, atoms, sizes, columns, [first[0], first[0]], packs, layers, 2)
    # An atom in two groups: its AEV gradient row is one group's columns or the
    # other's, never both (the CPU backward writes each group's rows whole).
    twice = atoms.clone()
    twice[-1] = twice[0]
    x = aev.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match=rf"atoms must be distinct rows of the AEV \(in \[0, {aev.shape[0]}\)\); "
                                           rf"atom {int(twice[0])} is repeated"):
        torch.autograd.grad(call(x, twice, sizes, columns, first, packs, layers, 2).sum(), x)
    # Rows and columns outside the AEV (the CPU forward gathers them itself).
    far = atoms.clone()
    far[1] = aev.shape[0] + 3
    with pytest.raises(RuntimeError, match=rf"atom {aev.shape[0] + 3} is not a row of the AEV "
                                           rf"\({aev.shape[0]} rows\)"):
        call(aev, far, sizes, columns, first, packs, layers, 2)
    wide = [c.clone() for c in columns]
    g = next(i for i, c in enumerate(wide) if c.numel() < aev.shape[1])
    wide[g][-1] = aev.shape[1]
    with pytest.raises(RuntimeError, match=rf"column {aev.shape[1]} is not a column of the AEV "
                                           rf"\({aev.shape[1]} features\)"):
        call(aev, atoms, sizes, wide, first, packs, layers, 2)


def _flushes_denormals_everywhere():
    """Whether float32 arithmetic flushes denormal results here, on the caller
    (a single product) and on OpenMP's team (a product split across threads)."""
    tiny = torch.finfo(torch.float32).tiny
    one = torch.tensor([tiny], dtype=torch.float32) * 0.01
    many = torch.full((1 << 18,), tiny, dtype=torch.float32) * 0.01
    return bool(one[0] == 0), bool((many == 0).all()), bool((many == 0).any())


def test_float32_denormals_flushed_inside_and_mode_restored():
    """float32 CPU calls run with denormals flushed on the caller and OpenMP's
    team (common/parallel.h, TeamFlushDenormals): a layer-1 weight gradient
    whose products all fall below float32's smallest normal is exactly 0 (the
    same gradient through the PyTorch reference is denormal and nonzero), the
    other rows match the reference, and afterwards every thread's own mode is
    back, whether it flushed before or not."""
    aev, atoms, sizes, columns, first, packs, layers, mlps = setup("two-groups", seed=11)
    members = mlps[0][0][0].shape[0]
    col = int(columns[0][0])  # group 0's first AEV column (row 0 of its W1)
    aev = aev.float()
    aev[:, col] *= 1e-30
    first32 = as_leaves([t.float() for t in first])
    packs32 = [t.float() for t in packs]
    assert _flushes_denormals_everywhere() == (False, False, False)
    got = call(aev, atoms, sizes, columns, first32, packs32, layers, members)
    g = 1e-10 * torch.randn(got.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(got, first32, g)
    assert _flushes_denormals_everywhere() == (False, False, False)
    leaves = [ws[0].detach().float().clone().requires_grad_(True) for ws, _ in mlps]
    ref_mlps = [([leaf] + [w.float() for w in ws[1:]], [b.float() for b in bs])
                for leaf, (ws, bs) in zip(leaves, mlps)]
    ref = reference_values(aev, atoms, sizes, columns, ref_mlps)
    ref_grads = torch.autograd.grad(ref, leaves, g)
    tiny = torch.finfo(torch.float32).tiny
    ref0 = ref_grads[0].permute(1, 0, 2).reshape(grads[0].shape)
    assert (ref0[0] != 0).any() and (ref0[0].abs() < tiny).all()  # the reference's row: denormal
    assert (grads[0][0] == 0).all()
    ref1 = ref_grads[1].permute(1, 0, 2).reshape(grads[1].shape)
    for got_rows, ref_rows in ((grads[0][1:], ref0[1:]), (grads[1], ref1)):  # float32 sums
        torch.testing.assert_close(got_rows, ref_rows, rtol=1e-4, atol=1e-6 * float(ref_rows.abs().max()))
    # A caller that flushes already keeps flushing after the op.
    torch.set_flush_denormal(True)
    try:
        call(aev, atoms, sizes, columns, first32, packs32, layers, members).sum().backward()
        assert _flushes_denormals_everywhere()[0]
    finally:
        torch.set_flush_denormal(False)
    assert not _flushes_denormals_everywhere()[0]
