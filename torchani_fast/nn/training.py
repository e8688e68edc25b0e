"""The weights of a training call: packed with few differentiable ops, never cached.

While a parameter requires grad the fused networks evaluate in ATen ops
(recompute.py) on weights packed from the live parameters on every call, so
that the weight gradients are exact and an optimizer step is seen by the next
call. The packs are views (one member) or one ``cat``/``stack`` per layer
(ensembles), not one copy per member and layer: an ensemble's backward then has
one node per layer, not one per member, and a single member's packs cost no
copies at all. They need not be contiguous (the C++ op, which does need it,
never runs in training); the cached packs of ``_FusedBase`` are these, made
contiguous.
"""
import typing as tp

import torch
from torch import Tensor


def first_layer_weights(ws: tp.List[tp.List[tp.List[Tensor]]], act: tp.List[int], elem: int) -> Tensor:
    """``elem``'s layer-1 weights of the members ``act``, all AEV columns:
    (k*d1, K_all), member i in rows i*d1 .. (i+1)*d1 (a view for one member)."""
    if len(act) == 1:
        return ws[act[0]][elem][0]  # (d1, K_all)
    return torch.cat([ws[j][elem][0] for j in act], 0)


def select_columns(w: Tensor, cols: Tensor, full: bool) -> Tensor:
    """(K, k*d1): the AEV columns ``cols`` (all with ``full``) of ``first_layer_weights``."""
    return (w if full else w.index_select(1, cols)).t()


def first_layer_pack(ws: tp.List[tp.List[tp.List[Tensor]]], act: tp.List[int], elem: int,
                     cols: Tensor, full: bool) -> Tensor:
    """``elem``'s layer-1 weights of the members ``act`` at AEV columns ``cols``
    (all columns with ``full``): (K, k*d1), member i in columns i*d1 .. (i+1)*d1."""
    return select_columns(first_layer_weights(ws, act, elem), cols, full)


def element_packs(ws: tp.List[tp.List[tp.List[Tensor]]], act: tp.List[int], e: int,
                  num_layers: int, layer_biases: tp.List[bool], output_row: int) -> tp.List[Tensor]:
    """Element ``e``'s layer-1 bias (k*d1,), then W_l (k, d_in, d_out) and b_l
    (k, 1, d_out) for l = 2..L (zeros for a layer without bias; the last layer's
    row ``output_row`` only when it is >= 0)."""
    out: tp.List[Tensor] = []
    k = len(act)
    w1 = ws[act[0]][e][0]
    if layer_biases[0]:
        if k == 1:
            out.append(ws[act[0]][e][1])
        else:
            out.append(torch.cat([ws[j][e][1] for j in act]))
    else:
        out.append(w1.new_zeros([k * w1.shape[0]]))
    last = num_layers - 1
    for l in range(1, num_layers):
        row = output_row if l == last and output_row >= 0 else -1
        weights: tp.List[Tensor] = []
        biases: tp.List[Tensor] = []
        for j in act:
            wl = ws[j][e][2 * l]
            weights.append((wl if row < 0 else wl.narrow(0, row, 1)).t())
            if layer_biases[l]:
                bl = ws[j][e][2 * l + 1]
                biases.append(bl if row < 0 else bl.narrow(0, row, 1))
        out_dim = weights[0].shape[1]
        if k == 1:
            out.append(weights[0].unsqueeze(0))
        else:
            out.append(torch.stack(weights))
        if len(biases) == 0:
            out.append(w1.new_zeros([k, 1, out_dim]))
        elif k == 1:
            out.append(biases[0].view(1, 1, out_dim))
        else:
            out.append(torch.stack(biases).view(k, 1, out_dim))
    return out


def hidden_packs(ws: tp.List[tp.List[tp.List[Tensor]]], act: tp.List[int], num_species: int,
                 num_layers: tp.List[int], layer_biases: tp.List[tp.List[bool]],
                 output_row: int) -> tp.List[Tensor]:
    """``element_packs`` of every element, one after another."""
    out: tp.List[Tensor] = []
    for e in range(num_species):
        out.extend(element_packs(ws, act, e, num_layers[e], layer_biases[e], output_row))
    return out
