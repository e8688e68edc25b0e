"""Lindh's model Hessian: a starting Hessian for quasi-Newton relaxation of molecules.

R. Lindh, A. Bernhardsson, G. Karlström, P.-Å. Malmqvist, Chem. Phys. Lett. 241,
423 (1995): a sum of stretch, bend and torsion terms over every pair, triple and
quadruple of atoms, each weighted by how bonded its atoms are,
``rho_ij = exp(alpha_ij (r_ref,ij^2 - r_ij^2))`` (the parameters by row of the
periodic table). The terms are the outer products of the internal coordinates'
gradients, so the matrix is positive semi-definite; a constant ``shift`` times the
identity makes it definite (translations, rotations, and loose modes).

Starting :class:`torchani_fast.batched.BFGS` from it instead of ASE's
``70 eV/Å² x I`` takes fewer steps on flexible molecules (docs/batched.md).
"""
import typing as tp

import torch
from torch import Tensor

BOHR = 0.529177210903  # Å
HARTREE = 27.211386245988  # eV
# Lindh's parameters in atomic units, by the rows of the periodic table (1: H-He,
# 2: Li-Ne, 3: Na-Ar and beyond): alpha (bohr^-2) and r_ref (bohr) per pair of rows,
# and the force constants of the stretch, bend and torsion terms (Hartree/bohr^2).
_ALPHA = ((1.0000, 0.3949, 0.3949), (0.3949, 0.2800, 0.2800), (0.3949, 0.2800, 0.2800))
_R_REF = ((1.35, 2.10, 2.53), (2.10, 2.87, 3.40), (2.53, 3.40, 3.40))
K_STRETCH, K_BEND, K_TORSION = 0.45, 0.15, 0.005
# Bends and torsions whose weight (the product of their rho) is below these are
# left out (force constants below 2e-3 eV/Å², against a shift of several eV/Å²);
# a neighbour enters the bends' and torsions' lists above these rho.
_BEND_WEIGHT, _TORSION_WEIGHT = 1e-4, 1e-3
_BEND_RHO, _TORSION_RHO = 1e-4, 1e-2


def lindh_hessian(numbers: Tensor, positions: Tensor, shift: float = 10.0, torsions: bool = True) -> Tensor:
    """Model Hessians (B, 3W, 3W) in eV/Å² of B molecules padded to W atoms.

    Parameters
    ----------
    numbers : Tensor (B, W)
        Atomic numbers, -1 for padding (padding atoms get ``shift`` x identity alone).
    positions : Tensor (B, W, 3)
        Positions in Å (float64 recommended).
    shift : float
        Added to the diagonal (eV/Å², > 0): the matrix is then positive definite.
    torsions : bool
        Include the torsion terms (the weakest; about half the cost).
    """
    if numbers.dim() != 2 or positions.shape != (*numbers.shape, 3):
        raise ValueError(f"numbers (B, W) and positions (B, W, 3) must agree, got "
                         f"{tuple(numbers.shape)} and {tuple(positions.shape)}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0 (eV/Å²), got {shift}")
    count, width = numbers.shape
    x = positions / BOHR
    real = numbers >= 0
    rows = (numbers > 2).long() + (numbers > 10).long()
    alpha = torch.tensor(_ALPHA, dtype=x.dtype, device=x.device)[rows[:, :, None], rows[:, None, :]]
    r_ref = torch.tensor(_R_REF, dtype=x.dtype, device=x.device)[rows[:, :, None], rows[:, None, :]]
    d = x[:, :, None, :] - x[:, None, :, :]  # (B, W, W, 3): x_i - x_j
    r2 = (d * d).sum(3)
    pair = real[:, :, None] & real[:, None, :] & ~torch.eye(width, dtype=torch.bool, device=x.device)
    rho = torch.where(pair, torch.exp(alpha * (r_ref * r_ref - r2)), 0.0)
    r = torch.where(pair, r2, 1.0).sqrt()

    h = torch.zeros((count, width, 3, width, 3), dtype=x.dtype, device=x.device)
    # Stretches: k rho (u u^T) on the two atoms' diagonal blocks, minus it off the diagonal.
    u = d / r[..., None]
    block = (K_STRETCH * rho)[..., None, None] * (u[..., :, None] * u[..., None, :])  # (B, W, W, 3, 3)
    h -= block.permute(0, 1, 3, 2, 4)
    idx = torch.arange(width, device=x.device)
    h[:, idx, :, idx, :] += block.sum(2).permute(1, 0, 2, 3)
    _bends(h, x, rho, r, _neighbours(rho, _BEND_RHO))
    if torsions:
        _torsions(h, x, rho, _neighbours(rho, _TORSION_RHO))
    h = h.reshape(count, 3 * width, 3 * width) * (HARTREE / BOHR ** 2)
    h = (h + h.transpose(1, 2)) * 0.5  # (exactly symmetric: the sums' order differs above and below)
    return h + shift * torch.eye(3 * width, dtype=x.dtype, device=x.device)


def _neighbours(rho: Tensor, least: float) -> tp.Tuple[Tensor, Tensor]:
    """Each atom's neighbours with rho above ``least``: indices (B, W, D) and validity."""
    near = rho > least
    most = int(near.sum(2).max()) if near.numel() else 0
    weight, index = torch.topk(torch.where(near, rho, -1.0), max(most, 1), dim=2)
    return index, weight > 0


def _add_terms(h: Tensor, b: Tensor, atoms: Tensor, grads: Tensor, k: Tensor) -> None:
    """h[b] += k g g^T for terms over ``atoms`` (T, m) with gradients ``grads`` (T, m, 3)."""
    if b.numel() == 0:
        return
    n = h.shape[1] * 3  # h is (B, W, 3, W, 3): 3W rows of 3W
    dof = (3 * atoms[:, :, None] + torch.arange(3, device=h.device)).reshape(b.shape[0], -1)  # (T, 3m)
    flat = (b[:, None, None] * n + dof[:, :, None]) * n + dof[:, None, :]
    g = grads.reshape(b.shape[0], -1)
    outer = k[:, None, None] * g[:, :, None] * g[:, None, :]
    h.view(-1).index_add_(0, flat.reshape(-1), outer.reshape(-1))


def _bends(h: Tensor, x: Tensor, rho: Tensor, r: Tensor, nbrs: tp.Tuple[Tensor, Tensor]) -> None:
    """Angles i-j-k at each centre j over pairs of its neighbours (i < k in the list)."""
    index, valid = nbrs
    count, width, most = index.shape
    first = torch.triu(torch.ones(most, most, dtype=torch.bool, device=x.device), diagonal=1)
    ok = valid[:, :, :, None] & valid[:, :, None, :] & first
    b, j, p, q = ok.nonzero().unbind(1)
    i, k = index[b, j, p], index[b, j, q]
    w = rho[b, i, j] * rho[b, j, k]
    u = (x[b, i] - x[b, j]) / r[b, i, j, None]
    v = (x[b, k] - x[b, j]) / r[b, k, j, None]
    cos = (u * v).sum(1)
    sin = (1 - cos * cos).clamp(min=0).sqrt()
    keep = ((w > _BEND_WEIGHT) & (sin > 1e-3)).nonzero().squeeze(1)  # (linear: no bend gradient)
    b, i, j, k, u, v, cos, sin, w = (t[keep] for t in (b, i, j, k, u, v, cos, sin, w))
    gi = -(v - cos[:, None] * u) / (r[b, i, j] * sin)[:, None]
    gk = -(u - cos[:, None] * v) / (r[b, k, j] * sin)[:, None]
    _add_terms(h, b, torch.stack([i, j, k], 1), torch.stack([gi, -gi - gk, gk], 1), K_BEND * w)


def _torsions(h: Tensor, x: Tensor, rho: Tensor, nbrs: tp.Tuple[Tensor, Tensor]) -> None:
    """Dihedrals i-j-k-l about each bond j-k (j < k) with i a neighbour of j, l of k."""
    index, valid = nbrs
    count, width, most = index.shape
    b, j, p = (valid & (index > torch.arange(width, device=x.device)[None, :, None])).nonzero().unbind(1)
    k = index[b, j, p]  # the central bonds j < k
    i, l = index[b, j][:, :, None], index[b, k][:, None, :]  # (E, D, 1), (E, 1, D)
    ok = valid[b, j][:, :, None] & valid[b, k][:, None, :] & (i != k[:, None, None]) \
        & (l != j[:, None, None]) & (i != l)
    e, p, q = ok.nonzero().unbind(1)
    b, j, k, i, l = b[e], j[e], k[e], index[b[e], j[e], p], index[b[e], k[e], q]
    w = rho[b, i, j] * rho[b, j, k] * rho[b, k, l]
    f, g, t = x[b, i] - x[b, j], x[b, j] - x[b, k], x[b, l] - x[b, k]
    a, c = torch.cross(f, g, dim=1), torch.cross(t, g, dim=1)
    a2, c2 = (a * a).sum(1), (c * c).sum(1)
    keep = ((w > _TORSION_WEIGHT) & (a2 > 1e-8) & (c2 > 1e-8)).nonzero().squeeze(1)  # (collinear: none)
    b, i, j, k, l, f, g, t, a, c, a2, c2, w = (
        v[keep] for v in (b, i, j, k, l, f, g, t, a, c, a2, c2, w))
    gn = g.norm(dim=1)
    fg, tg = (f * g).sum(1), (t * g).sum(1)
    ga = a * (gn / a2)[:, None]
    gc = c * (gn / c2)[:, None]
    sa = a * (fg / (a2 * gn))[:, None]
    sc = c * (tg / (c2 * gn))[:, None]
    grads = torch.stack([-ga, ga + sa - sc, -gc - sa + sc, gc], 1)
    _add_terms(h, b, torch.stack([i, j, k, l], 1), grads, K_TORSION * w)
