"""TorchANI's pair potentials (xTB repulsion, D3(BJ) dispersion) on fewer operations.

:func:`torchani_fast.patch` turns a model's ``RepulsionXTB`` and
``TwoBodyDispersionD3`` into the subclasses below (the class of the module is
swapped in place): the buffers, the state dict, ``.to()`` and ``isinstance``
checks stay TorchANI's, and only ``compute_from_neighbors`` is evaluated
differently, from the same neighbour pairs (the model's one list, narrowed to
the potential's cutoff as TorchANI does) and with the same formulas:

- repulsion: the per-pair constants are read through one species-pair index
  instead of three 2-D gathers, and ``d ** k`` is ``d * sqrt(d)`` where
  ``k = 1.5`` and ``d`` where ``k = 1`` (TorchANI's exponents) instead of ``pow``;
- dispersion: TorchANI interpolates C6 per pair over the 5 x 5 reference
  coordination numbers with 25 exponentials,
  ``exp(-4 ((cn_i - a)^2 + (cn_j - b)^2))``. The reference grid is a product
  (``a`` depends only on atom i's element, ``b`` on atom j's: checked by
  :func:`d3_unsupported_reason`), so the Gaussian factorises into
  ``u_i[a] v_j[b]`` with 5 + 5 exponentials per *atom*, and the sums over the
  grid become ``sum_b (u_i C)[s_j, b] v_j[b]`` with ``u_i C`` formed once per
  atom and partner element. The result differs from TorchANI's by rounding only.

On the CPU both run as one C++ op each (``ops.repulsion_xtb``,
``ops.dispersion_d3``, csrc/pairpot), with C++ autograd: forces and stress
(through the pair vectors) from per-pair factors kept by the forward, second
derivatives (Hessians, ``create_graph=True``) through a differentiable ATen form
of the gradient. Other devices (and envelopes other than TorchANI's smooth,
cosine and none) run the ATen code below; both work in TorchScript and survive
``torch.jit.save``.
"""
import typing as tp

import torch
from torch import Tensor
from torchani.cutoffs import CutoffCosine, CutoffDummy, CutoffSmooth
from torchani.neighbors import Neighbors
from torchani.potentials import RepulsionXTB, TwoBodyDispersionD3
from torchani.tuples import EnergiesScalars

from . import ops
from .aev import NeighborList

__all__ = ["FastRepulsionXTB", "FastDispersionD3", "UnboundedNeighborList", "d3_unsupported_reason",
           "fast_unsupported_reason", "runs_op", "set_fast_cutoff"]


def _sum_pairs(pair_energies: Tensor, elem_idxs: Tensor, neighbors: Neighbors, atomic: bool,
               ghost_flags: tp.Optional[Tensor]) -> EnergiesScalars:
    """TorchANI's ``BasePairPotential.compute_from_neighbors`` after the pair energies."""
    if ghost_flags is not None:
        ghost12 = ghost_flags.view(-1)[neighbors.indices]
        ghost_mask = torch.logical_or(ghost12[0], ghost12[1])
        pair_energies = torch.where(ghost_mask, pair_energies * 0.5, pair_energies)
    molecs_num, atoms_num = elem_idxs.shape
    if atomic:
        energies = neighbors.distances.new_zeros(molecs_num * atoms_num)
        half = pair_energies / 2
        energies.index_add_(0, neighbors.indices[0], half)
        energies.index_add_(0, neighbors.indices[1], half)
        return EnergiesScalars(energies.view(molecs_num, atoms_num))
    energies = neighbors.distances.new_zeros(molecs_num)
    molecs_idxs = torch.div(neighbors.indices[0], atoms_num, rounding_mode="floor")
    energies.index_add_(0, molecs_idxs, pair_energies)
    return EnergiesScalars(energies)


def _check(elem_idxs: Tensor, neighbors: Neighbors, ghost_flags: tp.Optional[Tensor]) -> None:
    # TorchANI's _pair_energies_wrapper asserts and raises these.
    assert elem_idxs.ndim == 2, "species should be 2 dimensional"
    assert neighbors.distances.ndim == 1, "distances should be 1 dimensional"
    assert neighbors.indices.ndim == 2, "atom_index12 should be 2 dimensional"
    assert neighbors.distances.shape[0] == neighbors.indices.shape[1]
    if ghost_flags is not None and not ghost_flags.numel() == elem_idxs.numel():
        raise ValueError("ghost_flags and species should have the same number of elements")


def _cutoff_args(cutoff_fn: torch.nn.Module) -> tp.Tuple[int, int, float]:
    """The ops' (cutoff_kind, cutoff_order, cutoff_eps) of a potential's envelope;
    kind -1 for one the ops do not have (the ATen code then runs)."""
    if type(cutoff_fn) is CutoffSmooth:
        return ops.PAIR_CUTOFF_SMOOTH, int(cutoff_fn.order), float(cutoff_fn.eps)
    if type(cutoff_fn) is CutoffCosine:
        return ops.PAIR_CUTOFF_COSINE, 2, 1e-10
    if type(cutoff_fn) is CutoffDummy:
        return ops.PAIR_CUTOFF_NONE, 2, 1e-10
    return -1, 2, 1e-10


def runs_op(kind: int, neighbors: Neighbors) -> bool:
    """Whether a pair potential with the ops' envelope ``kind`` runs its C++ op on
    ``neighbors`` (CPU, float32 or float64); the op skips the pairs beyond its
    cutoff, so it reads the model's whole list."""
    d = neighbors.distances
    return kind >= 0 and d.device.type == "cpu" and (d.dtype == torch.float32 or d.dtype == torch.float64)


class FastRepulsionXTB(RepulsionXTB):
    """``torchani.potentials.RepulsionXTB`` evaluated with fewer operations (same values)."""

    # The envelope as the op's arguments (set by set_fast_cutoff; kind -1: the ATen code).
    fast_cutoff_kind: int
    fast_cutoff_order: int
    fast_cutoff_eps: float

    def compute_from_neighbors(
        self,
        elem_idxs: Tensor,
        coords: Tensor,
        neighbors: Neighbors,
        charge: int = 0,
        atomic: bool = False,
        ensemble_values: bool = False,
        ghost_flags: tp.Optional[Tensor] = None,
    ) -> EnergiesScalars:
        _check(elem_idxs, neighbors, ghost_flags)
        if runs_op(self.fast_cutoff_kind, neighbors):
            energies, _ = ops.repulsion_xtb(
                elem_idxs, neighbors.indices, neighbors.distances, ghost_flags, atomic,
                self.y_ab, self.sqrt_alpha_ab, self.k_rep_ab, self.ANGSTROM_TO_BOHR, self.cutoff,
                self.fast_cutoff_kind, self.fast_cutoff_order, self.fast_cutoff_eps,
            )
            return EnergiesScalars(energies)
        num_elem = self.y_ab.shape[0]
        flat = elem_idxs.view(-1)
        pair = flat[neighbors.indices[0]] * num_elem + flat[neighbors.indices[1]]
        d = self.clamp(neighbors.distances) * self.ANGSTROM_TO_BOHR
        y = self.y_ab.view(-1)[pair]
        sqrt_alpha = self.sqrt_alpha_ab.view(-1)[pair]
        k = self.k_rep_ab.view(-1)[pair]
        # d ** k: d * sqrt(d) for k = 1.5 (equal to rounding), d for k = 1 (TorchANI's
        # only exponents); pow for any other table.
        if bool(((self.k_rep_ab == 1.5) | (self.k_rep_ab == 1.0)).all()):
            dk = torch.where(k == 1.0, d, d * d.sqrt())
        else:
            dk = d.pow(k)
        e = (y / d) * torch.exp(-sqrt_alpha * dk)
        e = e * self.cutoff_fn(neighbors.distances, self.cutoff)
        return _sum_pairs(e, elem_idxs, neighbors, atomic, ghost_flags)


class FastDispersionD3(TwoBodyDispersionD3):
    """``torchani.potentials.TwoBodyDispersionD3`` with the C6 interpolation factorised per atom."""

    fast_cutoff_kind: int  # as for FastRepulsionXTB
    fast_cutoff_order: int
    fast_cutoff_eps: float

    def compute_from_neighbors(
        self,
        elem_idxs: Tensor,
        coords: Tensor,
        neighbors: Neighbors,
        charge: int = 0,
        atomic: bool = False,
        ensemble_values: bool = False,
        ghost_flags: tp.Optional[Tensor] = None,
    ) -> EnergiesScalars:
        _check(elem_idxs, neighbors, ghost_flags)
        if runs_op(self.fast_cutoff_kind, neighbors):
            damp = self._damp_fn
            energies, _ = ops.dispersion_d3(
                elem_idxs, neighbors.indices, neighbors.distances, ghost_flags, atomic,
                self.precalc_coeff6, self.precalc_coordnums_a, self.precalc_coordnums_b,
                self.covalent_radii, self.sqrt_charge_ab, damp.cutoff_radii, self._s6, self._s8,
                damp._a1, damp._a2, float(self._k1), self._k2, float(self._k3), self._eps,
                self.ANGSTROM_TO_BOHR, self.cutoff, self.fast_cutoff_kind, self.fast_cutoff_order,
                self.fast_cutoff_eps,
            )
            return EnergiesScalars(energies)
        flat = elem_idxs.view(-1)
        n = flat.shape[0]
        num_elem = self.precalc_coeff6.shape[0]
        i, j = neighbors.indices[0], neighbors.indices[1]
        si, sj = flat[i], flat[j]
        pair = si * num_elem + sj
        d = self.ANGSTROM_TO_BOHR * neighbors.distances

        # Coordination numbers (TorchANI's _coordnums).
        rcov = self.covalent_radii[si] + self.covalent_radii[sj]
        count = 1 / (1 + torch.exp(-self._k1 * (self._k2 * rcov / d - 1)))
        cn = d.new_zeros(n)
        cn.index_add_(0, i, count)
        cn.index_add_(0, j, count)

        # Per-element reference coordination numbers along each axis of the grid
        # (the diagonal of the (T, T, 5, 5) tables; d3_unsupported_reason checks that
        # it holds for every partner). Padding atoms (-1) index the last element:
        # their rows are never read.
        ref_a = self.precalc_coordnums_a.diagonal(0, 0, 1)[:, 0, :].t()  # (T, 5)
        ref_b = self.precalc_coordnums_b.diagonal(0, 0, 1)[0, :, :].t()  # (T, 5)
        c6_ref = self.precalc_coeff6.to(d.dtype)
        weights = (c6_ref > 0.0).to(d.dtype)
        # (T, T, 2, 5, 5): the masked C6 values and the mask (TorchANI's masked_fill).
        tables = torch.stack([c6_ref * weights, weights], 2)
        u = torch.exp(-self._k3 * (cn.unsqueeze(1) - ref_a[flat]) ** 2)  # (N, 5)
        v = torch.exp(-self._k3 * (cn.unsqueeze(1) - ref_b[flat]) ** 2)  # (N, 5)
        # sum_a u_i[a] table[s_i, t, :, a, b] for every atom i and partner element t.
        ut = torch.einsum("na,ntkab->ntkb", u, tables[flat])
        # index_select (backward: index_add) rather than indexing (backward: index_put).
        ut_pair = ut.reshape(n * num_elem, -1).index_select(0, i * num_elem + sj).view(-1, 2, ut.shape[-1])
        zw = (ut_pair * v.index_select(0, j).unsqueeze(1)).sum(-1) + self._eps
        c6 = zw[:, 0] / zw[:, 1]
        c8 = 3 * c6 * self.sqrt_charge_ab.view(-1)[pair]

        r0 = self._damp_fn.cutoff_radii.view(-1)[pair]
        damp = self._damp_fn._a1 * r0 + self._damp_fn._a2
        d2 = d * d
        d6 = d2 * d2 * d2
        damp2 = damp * damp
        damp6 = damp2 * damp2 * damp2
        e6 = self._s6 * c6 / (d6 + damp6)
        e8 = self._s8 * c8 / (d6 * d2 + damp6 * damp2)
        e = -(e6 + e8) * self.cutoff_fn(neighbors.distances, self.cutoff)
        return _sum_pairs(e, elem_idxs, neighbors, atomic, ghost_flags)


class UnboundedNeighborList(NeighborList):
    """:class:`~torchani_fast.aev.NeighborList` that also takes ``cutoff=inf``.

    Models whose repulsion has no cutoff (ANIr2s: ``repulsion_cutoff=False``)
    search neighbours at an infinite cutoff, i.e. every pair of a molecule, as
    TorchANI's all-pairs list does. Such a search is refused for periodic
    input (an infinite sum over images); for a molecule it runs at a finite
    cutoff just longer than the molecule's diameter, which gives every pair.
    """

    def _search_cutoff(self, cutoff: float, elem_idxs: Tensor, coords: Tensor,
                       pbc: tp.Optional[Tensor]) -> float:
        if cutoff == float("inf"):
            if pbc is not None and bool(pbc.any()):
                axes: tp.List[bool] = pbc.tolist()
                raise ValueError(
                    "this model has a potential without cutoff (cutoff=inf), which is not defined "
                    "for periodic systems: pbc must be None or all False, got " + str(axes))
            real = (elem_idxs >= 0).unsqueeze(-1)
            c = coords.detach()
            if bool(real.any()):
                hi = c.masked_fill(~real, float("-inf")).amax(dim=(0, 1))
                lo = c.masked_fill(~real, float("inf")).amin(dim=(0, 1))
                cutoff = float((hi - lo).norm()) * 1.001 + 1.0
            else:
                cutoff = 1.0
        return cutoff


def d3_unsupported_reason(pot: TwoBodyDispersionD3) -> tp.Optional[str]:
    """``None`` if the reference grid of ``pot`` is a product grid (what
    :class:`FastDispersionD3` relies on), otherwise why it is not."""
    c6, cn_a, cn_b = pot.precalc_coeff6, pot.precalc_coordnums_a, pot.precalc_coordnums_b
    if c6.dim() != 4 or cn_a.shape != c6.shape or cn_b.shape != c6.shape:
        return "the C6 reference tables are not (elements, elements, refs, refs)"
    t = c6.shape[0]
    diag = torch.arange(t)
    ref_a = cn_a[diag, diag, :, 0]
    ref_b = cn_b[diag, diag, 0, :]
    valid = c6 > 0
    exp_a = ref_a.view(t, 1, -1, 1).expand_as(c6)
    exp_b = ref_b.view(1, t, 1, -1).expand_as(c6)
    if not bool(((cn_a == exp_a) | ~valid).all()) or not bool(((cn_b == exp_b) | ~valid).all()):
        return "its reference coordination numbers are not a product grid"
    return None


def fast_unsupported_reason(pot: torch.nn.Module) -> tp.Optional[str]:
    """Why ``pot`` (TorchANI's ``RepulsionXTB`` or ``TwoBodyDispersionD3``) keeps
    TorchANI's class, or None when the faster subclass reproduces it."""
    if isinstance(pot, TwoBodyDispersionD3):
        return d3_unsupported_reason(pot)
    return None


def set_fast_cutoff(pot: torch.nn.Module) -> None:
    """Store the ops' envelope arguments on a :class:`FastRepulsionXTB` or
    :class:`FastDispersionD3` (again after patching twice: cheap)."""
    pot.fast_cutoff_kind, pot.fast_cutoff_order, pot.fast_cutoff_eps = _cutoff_args(pot.cutoff_fn)
