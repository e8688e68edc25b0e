"""The plain-PyTorch oracle of the fused networks ops, shared by their tests.

`make_groups` draws random AEV rows, element groups and weights in the packed
layouts that torchani_fast.nn hands the ops; `reference_values` evaluates each
member's MLP from the unpacked weights with torch.nn.functional only, and
`reference` adds J (each atom's input gradient) by autograd. Nothing of
torchani_fast.nn is used, so the ops are checked against an independent
evaluation.
"""
import torch

# The draws of each activation's tests: CELU's inputs are AEV-like (in [0, 0.4));
# GELU's are centred and larger, so that both of its tails are reached.
_SCALES = {  # activation: (AEV, weights, biases)
    "celu": (0.4, 1.0, 0.1),
    "gelu": (0.5, 1.5, 0.3),
}


def make_groups(dtype, members, widths, cols_per_group, sizes, features=64, seed=0,
                activation="celu", bias=True):
    """Random AEV rows, groups and packed weights in the layouts of torchani_fast.nn.

    Returns aev (rows, features), atoms (the grouped rows), sizes, columns (each
    group's AEV columns), first (layer-1 weights (K, members * d1)), packs (b1,
    then W and b of each later layer), layers, and mlps (each group's per-member
    weights and biases, the reference's layout; biases None where ``bias`` is
    False, zeros in the packs)."""
    aev_scale, w_scale, b_scale = _SCALES[activation]
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes) + 3
    if activation == "celu":
        aev = torch.rand(n, features, generator=g, dtype=dtype) * aev_scale
    else:
        aev = torch.randn(n, features, generator=g, dtype=dtype) * aev_scale
    atoms = torch.randperm(n, generator=g)[: sum(sizes)]
    columns, first, packs, layers, mlps = [], [], [], [], []
    for k_cols in cols_per_group:
        cols = torch.sort(torch.randperm(features, generator=g)[:k_cols]).values
        dims = [k_cols] + widths + [1]
        ws = [torch.randn(members, dims[i], dims[i + 1], generator=g, dtype=dtype) * w_scale / dims[i] ** 0.5
              for i in range(len(dims) - 1)]
        bs = [torch.randn(members, dims[i + 1], generator=g, dtype=dtype) * b_scale if bias else None
              for i in range(len(dims) - 1)]
        packed = [torch.zeros(members, dims[i + 1], dtype=dtype) if b is None else b for i, b in enumerate(bs)]
        columns.append(cols)
        first.append(ws[0].permute(1, 0, 2).reshape(k_cols, -1).contiguous())  # (K, members * d1)
        packs.append(packed[0].reshape(-1))
        for w, b in zip(ws[1:], packed[1:]):
            packs += [w.contiguous(), b.unsqueeze(1).contiguous()]
        layers.append(len(dims) - 1)
        mlps.append((ws, bs))
    return aev, atoms, list(sizes), columns, first, packs, layers, mlps


def panels_of(first, packs, layers, members):
    """float32 panel copies (W and W^T as 16-column panels) of every hidden layer."""
    out, p = [], 0
    for w1, nl in zip(first, layers):
        ws = [w1.view(w1.shape[0], members, -1).transpose(0, 1)]
        ws += [packs[p + 2 * l - 1] for l in range(1, nl - 1)]
        for w in ws:
            k, d_in, d_out = w.shape
            out.append(w.reshape(k, d_in, d_out // 16, 16).permute(0, 2, 1, 3).contiguous())
            out.append(w.reshape(k, d_in // 16, 16, d_out).permute(0, 1, 3, 2).contiguous())
        p += 2 * nl - 1
    return out


def reference_values(x, atoms, sizes, columns, mlps, activation="celu"):
    """Values (members, rows of x) as a differentiable function of x: plain
    torch.nn.functional, CELU(0.1) or GELU, biases only where given."""
    act = (lambda h: torch.nn.functional.celu(h, 0.1)) if activation == "celu" else torch.nn.functional.gelu
    out = x.new_zeros((mlps[0][0][0].shape[0], x.shape[0]))
    for atoms_g, cols, (ws, bs) in zip(atoms.split(sizes), columns, mlps):
        outs = []
        for m in range(ws[0].shape[0]):
            h = x[atoms_g][:, cols]
            for l, (w, b) in enumerate(zip(ws, bs)):
                h = h @ w[m] if b is None else h @ w[m] + b[m]
                if l + 1 < len(ws):
                    h = act(h)
            outs.append(h[:, 0])
        out = out.index_copy(1, atoms_g, torch.stack(outs))
    return out


def reference(aev, atoms, sizes, columns, mlps, activation="celu"):
    """Values (members, rows of aev): each atom's in its own column, 0 elsewhere; J flat."""
    x = aev.clone().requires_grad_(True)
    values = reference_values(x, atoms, sizes, columns, mlps, activation)
    (grad,) = torch.autograd.grad(values.sum(), x)  # an atom's values depend on its own row only
    jac = [grad[atoms_g][:, cols].flatten() for atoms_g, cols in zip(atoms.split(sizes), columns)]
    return values.detach(), torch.cat(jac)
