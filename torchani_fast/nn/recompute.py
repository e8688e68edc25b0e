"""The networks in differentiable ATen ops: the path off the C++ op.

Used on other devices, for training (parameters that require grad) and for
backward passes the C++ op's input gradient does not cover (per-member values,
QBCs, ``create_graph=True``). ``_Recompute`` keeps no activations for backward
and recomputes them a chunk of atoms at a time.
"""
import struct
import typing as tp

import torch
from torch import Tensor

RECOMPUTE_MIN_BYTES = 64 * 1024 * 1024  # CPU: activations above this are not kept for backward
RECOMPUTE_MIN_BYTES_GPU = -1  # the same on other devices; -1: an eighth of the device's memory
RECOMPUTE_FALLBACK_BYTES = 1024 * 1024 * 1024  # for -1 where the memory size is not known
RECOMPUTE_CHUNK_ATOMS = 1024  # atoms per chunk: temporaries of a few MB, which glibc reuses without growing the heap
CELU_ALPHA = 0.1
ACTIVATION_GELU = 1  # the op's ``activation`` codes (layout.py): 0 CELU(0.1), 1 GELU


def _first_layer(x: Tensor, w1: Tensor, b1: Tensor, k: int, small: int) -> Tensor:
    """Layer 1 of all ``k`` members, (k, n, d1), from x (n, K), w1 (K, k*d1), b1 (k*d1,)."""
    n = x.shape[0]
    in_dim = x.shape[1]
    if n <= small:
        return torch.baddbmm(b1.view(k, 1, -1), x.unsqueeze(0).expand(k, n, in_dim),
                             w1.view(in_dim, k, -1).transpose(0, 1))
    return torch.addmm(b1, x, w1).view(n, k, -1).transpose(0, 1)  # a view


def _gather(aev: Tensor, atoms: Tensor, cols: tp.Optional[Tensor]) -> Tensor:
    x = aev.index_select(0, atoms)
    return x if cols is None else x.index_select(1, cols)


def _activate(h: Tensor, activation: int) -> Tensor:
    """The activation between layers, as TorchANI's modules compute it."""
    if activation == 1:  # ACTIVATION_GELU (a literal for TorchScript)
        return torch.nn.functional.gelu(h)
    return torch.nn.functional.celu(h, 0.1)


def _mlp_values(
    x: Tensor, w1: Tensor, packs: tp.List[Tensor], k: int, small: int, activation: int = 0
) -> tp.Tuple[Tensor, tp.List[Tensor]]:
    """Outputs (k, n) of one group's networks and the pre-activations (k, n, d) of the hidden layers.

    ``packs`` = [b1 (k*d1,), W2 (k, d1, d2), b2 (k, 1, d2), ...] as in ``_pack_hidden``
    (zero biases for layers without), ``activation`` the op's code (CELU(0.1) or GELU).
    CELU is not applied in place: the in-place backward recovers exp(x/alpha) from
    the output, which does not reproduce TorchANI's float64 forces to 1e-9.
    """
    n = x.shape[0]
    h = _first_layer(x, w1, packs[0], k, small)
    pre: tp.List[Tensor] = []
    for l in range(1, (len(packs) + 1) // 2):
        pre.append(h)
        h = torch.baddbmm(packs[2 * l], _activate(h, activation), packs[2 * l - 1])
    return h.reshape(k, n), pre


# PyTorch's CELU backward (derivatives.yaml: elu_backward(..., 1.0 / alpha.toFloat(), ...))
# scales by 1 / float32(alpha) even in float64: alpha c exp(c h) with c = 9.99999985
# instead of exp(10 h). TorchANI's float64 forces carry that 1.5e-8 relative error;
# calling the same kernel gives TorchANI's forces bit for bit (and it is differentiable).
_CELU_INPUT_SCALE = 1.0 / struct.unpack("f", struct.pack("f", CELU_ALPHA))[0]


def _celu_backward(grad: Tensor, pre: Tensor) -> Tensor:
    return torch.ops.aten.elu_backward(grad, CELU_ALPHA, 1.0, _CELU_INPUT_SCALE, False, pre)


def _activation_backward(grad: Tensor, pre: Tensor, activation: int) -> Tensor:
    if activation == ACTIVATION_GELU:
        return torch.ops.aten.gelu_backward(grad, pre)  # approximate="none", differentiable
    return _celu_backward(grad, pre)


def _mlp_input_grad(
    grad: Tensor, w1: Tensor, packs: tp.List[Tensor], pre: tp.List[Tensor], k: int, small: int,
    activation: int = 0,
) -> Tensor:
    """d(sum grad * outputs) / dx for the outputs of ``_mlp_values``: (n, K)."""
    n = grad.shape[1]
    in_dim = w1.shape[0]
    g = grad.unsqueeze(2)  # (k, n, 1)
    for l in range(len(pre), 0, -1):
        g = _activation_backward(torch.bmm(g, packs[2 * l - 1].transpose(1, 2)), pre[l - 1],
                                 activation)  # (k, n, d_l)
    if n <= small:
        return torch.bmm(g, w1.view(in_dim, k, -1).permute(1, 2, 0)).sum(0)
    return g.transpose(0, 1).reshape(n, -1).mm(w1.t())


def _per_group(args: tp.Tuple, features: int) -> tp.List:
    """Per group (AEV columns or None for all, layer-1 weights, later packs), from
    the op's arguments (columns, first, packs, panels, layers)."""
    columns, first, packs, _, layers = args
    out = []
    p = 0
    for cols, w1, nl in zip(columns, first, layers):
        out.append((None if cols.shape[0] == features else cols, w1, packs[p:p + 2 * nl - 1]))
        p += 2 * nl - 1
    return out


class _Recompute(torch.autograd.Function):
    """Atomic energies (k, atoms) of all groups without keeping the activations for backward.

    For inputs whose activations would exceed the memory budget where the C++
    op does not run (other devices, ``native_cpu = False``). ``atoms`` (grouped,
    runs of ``sizes``) are the evaluated rows of ``aev``; ``args`` are the
    groups' weights as ``ensemble_mlp`` takes them (columns, layer-1 weights
    (K, k*d1), the other packs, panels, layers), constants here (the path is
    only taken when they need no grad), ``activation`` the op's code. The backward recomputes the activations
    a chunk of atoms at a time, differentiably under ``create_graph=True``.
    """

    @staticmethod
    def forward(ctx, aev: Tensor, atoms: Tensor, sizes: tp.List[int], args: tp.Tuple, k: int,
                small: int, activation: int = 0) -> Tensor:
        ctx.atoms = atoms
        ctx.sizes = sizes
        ctx.args = args
        ctx.k = k
        ctx.small = small
        ctx.activation = activation
        ctx.save_for_backward(aev)
        outs = []
        for atoms_g, (cols, w1, packs) in zip(atoms.split(sizes), _per_group(args, aev.shape[1])):
            for chunk in atoms_g.split(RECOMPUTE_CHUNK_ATOMS):
                outs.append(_mlp_values(_gather(aev, chunk, cols), w1, packs, k, small, activation)[0])
        return aev.new_zeros((k, aev.shape[0])).index_copy_(1, atoms, torch.cat(outs, 1))

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (aev,) = ctx.saved_tensors
        # Grad mode is on here only under create_graph=True: then the backward is
        # recorded (out-of-place writes) and can be differentiated again.
        differentiable = torch.is_grad_enabled()
        grad = aev.new_zeros(aev.shape)
        for atoms_g, (cols, w1, packs) in zip(ctx.atoms.split(ctx.sizes), _per_group(ctx.args, aev.shape[1])):
            for chunk in atoms_g.split(RECOMPUTE_CHUNK_ATOMS):
                pre = _mlp_values(_gather(aev, chunk, cols), w1, packs, ctx.k, ctx.small, ctx.activation)[1]
                gx = _mlp_input_grad(grad_out.index_select(1, chunk), w1, packs, pre, ctx.k, ctx.small,
                                     ctx.activation)
                index = (chunk,) if cols is None else (chunk.unsqueeze(1), cols.unsqueeze(0))
                grad = grad.index_put(index, gx) if differentiable else grad.index_put_(index, gx)
        return grad, None, None, None, None, None, None


_DEVICE_BUDGETS: tp.Dict[str, int] = {}


def _device_budget(device: torch.device) -> int:
    """An eighth of a CUDA device's memory, asked once per device; 1 GiB elsewhere."""
    if device.type != "cuda":
        return RECOMPUTE_FALLBACK_BYTES
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = "cuda:" + str(index)
    if key not in _DEVICE_BUDGETS:
        _DEVICE_BUDGETS[key] = int(torch.cuda.get_device_properties(index).total_memory) // 8
    return _DEVICE_BUDGETS[key]
