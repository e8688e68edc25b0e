"""Typed wrappers over ``torch.ops.torchani_fast`` and the fake (meta) kernels.

The C++ side (``csrc/registration.cpp``) declares the schemas and the CPU,
CUDA and autograd kernels (``ensemble_dense``'s autograd and its reference
CPU kernel are here). The fake kernels here let ``torch.compile``,
``torch.export`` and ``torch.library.opcheck`` trace the ops without data.
"""
import os
import typing as tp

import torch
from torch import Tensor

from ._device_paths import host_path

# TORCHANI_FAST_CUDA_NEIGHBORS=old|new (read at every call; unset: new) picks the
# CUDA neighbour search (the C++ side reads it too) and, here, whether the pair
# vectors off the CPU are the pair_vectors op (new: one kernel, and a backward
# without float atomics, so forces repeat bit for bit) or ATen ops (old).
def cuda_neighbors_switch() -> str:
    """``TORCHANI_FAST_CUDA_NEIGHBORS``: ``"new"`` (unset or empty) or ``"old"``."""
    value = os.environ.get("TORCHANI_FAST_CUDA_NEIGHBORS", "") or "new"
    if value not in ("new", "old"):
        raise ValueError("TORCHANI_FAST_CUDA_NEIGHBORS must be 'new' or 'old' (or unset: new), got "
                         + repr(value))
    return value


@torch.jit.unused
def _switched_op(t: Tensor) -> bool:
    return t.device.type in ("cuda", "cpu") and cuda_neighbors_switch() == "new"


def _pair_vectors_op(t: Tensor) -> bool:
    """Whether pair_vectors on ``t``'s device is the op (scripted code: always on CPU and CUDA)."""
    if torch.jit.is_scripting():
        return t.device.type == "cuda" or t.device.type == "cpu"
    return _switched_op(t)

__all__ = [
    "neighbor_pairs", "neighbor_pairs_padded", "check_num_pairs", "pair_vectors", "aev", "aev_backward",
    "aev_jvp", "aev_double_backward", "aev_local_derivatives", "ensemble_dense",
    "aev_with_edges", "aev_backward_edges", "ensemble_dense_jacobian",
]


def neighbor_pairs(
    species: Tensor,
    coords: Tensor,
    cell: tp.Optional[Tensor],
    pbc: tp.Optional[Tensor],
    cutoff: float,
    cell_list: bool,
) -> tp.Tuple[Tensor, Tensor]:
    """Pairs of atoms closer than ``cutoff`` (each unordered pair once).

    Parameters
    ----------
    species : Tensor, int64 or int32, shape (M, A)
        Element indices; -1 marks padding atoms, which never appear in a pair.
    coords : Tensor, float32 or float64, shape (M, A, 3)
        Cartesian coordinates in Å; need not be wrapped into the cell.
    cell : Tensor, shape (3, 3), optional
        Lattice vectors as rows (one cell for the whole batch).
    pbc : Tensor, bool, shape (3,), optional
        Periodicity of each lattice vector; given together with ``cell``.
    cutoff : float
        Cutoff radius in Å.
    cell_list : bool
        Bin atoms into cells (O(N)) instead of testing every pair of a molecule.

    Returns
    -------
    pairs : Tensor, int64, shape (2, P)
        Indices into the flattened ``M * A`` atoms, ``pairs[0] <= pairs[1]``.
    images : Tensor, coords dtype, shape (P, 3)
        Integer lattice translations: the pair's difference vector is
        ``coords[pairs[0]] - coords[pairs[1]] + images @ cell``.
    """
    return torch.ops.torchani_fast.neighbor_pairs(species, coords, cell, pbc, cutoff, cell_list)


def neighbor_pairs_padded(
    species: Tensor,
    coords: Tensor,
    cell: tp.Optional[Tensor],
    pbc: tp.Optional[Tensor],
    cutoff: float,
    cell_list: bool,
    max_pairs: int,
) -> tp.Tuple[Tensor, Tensor, Tensor]:
    """:func:`neighbor_pairs` into a fixed-capacity list, without a host sync.

    Output shapes depend only on ``max_pairs``, and on CUDA nothing is read
    back to the host, so the call can be captured in a CUDA graph (and traced
    by ``torch.compile`` without a data-dependent size). The price is that an
    overflow is not raised: check ``num_pairs`` (see :func:`check_num_pairs`,
    a sync) whenever convenient, e.g. every few hundred MD steps.

    Parameters
    ----------
    species, coords, cell, pbc, cutoff, cell_list
        As for :func:`neighbor_pairs`.
    max_pairs : int
        Capacity of the list (>= 0).

    Returns
    -------
    pairs : Tensor, int64, shape (2, max_pairs)
        The pairs grouped by their first atom in ascending order (on CUDA each
        atom's partners are sorted by (j, image), so runs repeat bit for bit),
        then ``-1`` in every unused slot, which :func:`aev` ignores.
    images : Tensor, coords dtype, shape (max_pairs, 3)
        Lattice translations as for :func:`neighbor_pairs`; 0 in unused slots.
    num_pairs : Tensor, int64, shape ()
        How many pairs exist. ``num_pairs > max_pairs`` means the list
        overflowed and the pairs beyond the capacity were dropped. On CUDA an
        invalid input that the CPU would raise for is reported here instead:
        -1 for non-finite coordinates, -2 for a singular cell, -3 for a cell
        too small for the cutoff (no pairs then).
    """
    return torch.ops.torchani_fast.neighbor_pairs_padded(
        species, coords, cell, pbc, cutoff, cell_list, max_pairs
    )


def check_num_pairs(num_pairs: Tensor, max_pairs: int) -> int:
    """Raise if a fixed-capacity neighbour list overflowed or saw bad input.

    This reads ``num_pairs`` back to the host, so it synchronises the stream:
    call it outside captured regions, as often as the safety margin requires.
    Returns the number of pairs.
    """
    n = int(num_pairs.item())
    if n == -1:
        raise RuntimeError("torchani_fast::neighbor_pairs_padded: coords must be finite")
    if n == -2:
        raise RuntimeError("torchani_fast::neighbor_pairs_padded: cell is singular")
    if n == -3:
        raise RuntimeError("torchani_fast::neighbor_pairs_padded: the cell is too small for the "
                           "cutoff: the search around each atom would visit more than 1e6 "
                           "periodic images or bins (or 1e5 along one lattice vector)")
    if n > max_pairs:
        raise RuntimeError(
            "torchani_fast::neighbor_pairs_padded: " + str(n) + " pairs do not fit in "
            "max_pairs=" + str(max_pairs) + "; the pairs beyond the capacity were dropped. "
            "Raise max_pairs (e.g. to " + str(n + n // 4 + 64) + ") and recompute."
        )
    return n


def pair_vectors(
    coords: Tensor,
    pairs: Tensor,
    images: tp.Optional[Tensor],
    cell: tp.Optional[Tensor],
) -> tp.Tuple[Tensor, Tensor]:
    """The pairs' difference vectors and their lengths, differentiable w.r.t. coords and cell.

    One pass over the pairs (a CPU or CUDA kernel; ATen on other devices, or
    on CUDA with ``TORCHANI_FAST_CUDA_NEIGHBORS=old``) instead of two gathers,
    a subtraction, a matrix product and a norm. Its backward on CUDA sums each
    atom's pairs in pair order without floating-point atomics, so forces are
    the same bits on every run.

    Parameters
    ----------
    coords : Tensor, float, shape (N, 3)
        The flattened coordinates.
    pairs : Tensor, int64, shape (2, P)
        Indices into ``coords``.
    images, cell : Tensor, coords dtype, shapes (P, 3) and (3, 3), optional
        Lattice translations of the pairs (as :func:`neighbor_pairs` returns
        them) and the cell, both or neither.

    Returns
    -------
    diff_vectors : Tensor, shape (P, 3)
        ``coords[pairs[0]] - coords[pairs[1]] (+ images @ cell)``.
    distances : Tensor, shape (P,)
        Their lengths.
    """
    if host_path(coords) or _pair_vectors_op(coords):
        return torch.ops.torchani_fast.pair_vectors(coords, pairs, images, cell)
    diff = coords.index_select(0, pairs[0]) - coords.index_select(0, pairs[1])
    if cell is not None and images is not None:
        diff = diff + images @ cell
    return diff, diff.norm(2, -1)


# cutoff_kind of the AEV ops (aev_math::CutoffFn in csrc/aev/second_derivs.h).
CUTOFF_COSINE = 0
CUTOFF_SMOOTH = 1


def aev(
    species: Tensor,
    pairs: Tensor,
    diff_vectors: Tensor,
    radial_eta: Tensor,
    radial_shifts: Tensor,
    angular_eta: Tensor,
    angular_zeta: Tensor,
    angular_shifts: Tensor,
    angular_sections: Tensor,
    radial_cutoff: float,
    angular_cutoff: float,
    num_species: int,
    cutoff_kind: int = 0,
    cutoff_order: int = 2,
    cutoff_eps: float = 1e-10,
) -> Tensor:
    """ANI atomic environment vectors from a half neighbour list.

    Parameters
    ----------
    species : Tensor, int64 or int32, shape (M, A)
        Element indices (0 .. num_species-1); -1 marks padding (zero AEV row).
    pairs : Tensor, int64, shape (2, P)
        Atom pairs, indices into the flattened ``M * A`` atoms. Pairs with a
        negative index (unused slots), pairs that touch
        padding or are farther apart than ``radial_cutoff`` are ignored.
    diff_vectors : Tensor, float32 or float64, shape (P, 3)
        ``coords[pairs[0]] - coords[pairs[1]]`` (+ lattice shift), in Å. The AEV
        is computed in this dtype and is differentiable with respect to it.
    radial_eta, radial_shifts, angular_eta, angular_zeta, angular_shifts, angular_sections : Tensor
        ``ANIRadial`` / ``ANIAngular`` constants (eta/zeta of size 1 or one per
        shift/section).
    radial_cutoff, angular_cutoff : float
        Cutoff radii in Å (angular <= radial).
    num_species : int
        Number of elements the AEV distinguishes.
    cutoff_kind, cutoff_order, cutoff_eps : int, int, float
        The cutoff function of both terms: ``CUTOFF_COSINE`` (0, the default:
        ``0.5 cos(pi r / rc) + 0.5``, TorchANI's ``CutoffCosine``) or
        ``CUTOFF_SMOOTH`` (1: ``exp(1 - 1 / max(eps, 1 - (r / rc)^order))``,
        TorchANI's ``CutoffSmooth(order, eps)``); order and eps are read for the
        smooth kind only.

    Returns
    -------
    Tensor, shape (M, A, F)
        F = S*R + S(S+1)/2 * A*Z, in TorchANI's layout.
    """
    return torch.ops.torchani_fast.aev(
        species, pairs, diff_vectors, radial_eta, radial_shifts, angular_eta, angular_zeta,
        angular_shifts, angular_sections, radial_cutoff, angular_cutoff, num_species,
        cutoff_kind, cutoff_order, cutoff_eps,
    )


def aev_backward(grad_aev: Tensor, *args: tp.Any) -> Tensor:
    """Gradient of ``sum(grad_aev * aev(*args))`` with respect to ``diff_vectors`` (P, 3)."""
    return torch.ops.torchani_fast.aev_backward(grad_aev, *args)


def aev_with_edges(*args: tp.Any) -> tp.Tuple[Tensor, Tensor]:
    """:func:`aev` (not differentiable), and a handle of the half edges it found, which
    :func:`aev_backward_edges` reuses (a (0,) uint8 tensor; empty where none is kept)."""
    return torch.ops.torchani_fast.aev_with_edges(*args)


def aev_backward_edges(grad_aev: Tensor, edges: Tensor, *args: tp.Any) -> Tensor:
    """:func:`aev_backward` given the handle that :func:`aev_with_edges` returned for
    the same ``args`` (the edges are found again if it does not match them)."""
    return torch.ops.torchani_fast.aev_backward_edges(grad_aev, edges, *args)


def aev_jvp(tangent: Tensor, *args: tp.Any) -> Tensor:
    """Directional derivative of ``aev(*args)`` along ``tangent`` (P, 3) on ``diff_vectors``.

    This is ``J @ tangent`` with ``J = d aev / d diff_vectors`` (shape of the
    AEV): the derivative of ``aev_backward`` with respect to ``grad_aev``, which
    force training needs. Differentiable with respect to ``tangent`` and
    ``diff_vectors``.
    """
    return torch.ops.torchani_fast.aev_jvp(tangent, *args)


def aev_double_backward(grad_aev: Tensor, tangent: Tensor, *args: tp.Any) -> Tensor:
    """Gradient of ``sum(tangent * aev_backward(grad_aev, *args))`` w.r.t. ``diff_vectors``.

    Equals ``(sum_f grad_aev_f * d2 aev_f / d diff_vectors2) @ tangent`` (P, 3):
    the derivative of ``aev_backward`` with respect to ``diff_vectors``, which
    Hessians need. Differentiable with respect to ``tangent`` only (further
    derivatives would be third derivatives of the AEV).
    """
    return torch.ops.torchani_fast.aev_double_backward(grad_aev, tangent, *args)


def aev_local_derivatives(grad_aev: Tensor, columns: Tensor,
                          *args: tp.Any) -> tp.Tuple[Tensor, Tensor, Tensor]:
    """Per-atom derivatives from which whole Hessians are assembled (not differentiable).

    For each centre atom ``i`` (flattened), over the ``K`` slots of the atoms its
    AEV depends on (slot 0 is ``i`` itself, then its distinct neighbours).
    ``grad_aev`` has the AEV's shape; ``columns`` (int64, increasing) are the AEV
    columns the Jacobian keeps; ``args`` are :func:`aev`'s arguments.

    Returns
    -------
    local_atoms : Tensor, int64, (N, K)
        Flattened atom index of each slot; -1 where unused.
    jacobian : Tensor, (N, K, 3, len(columns))
        ``d aev_i[columns] / d x_slot``.
    curvature : Tensor, (N, K, 3, K, 3)
        ``sum_f grad_aev[i, f] * d2 aev_if / (d x_slot d x_slot')``.
    """
    return torch.ops.torchani_fast.aev_local_derivatives(grad_aev, columns, *args)


def _aev_length(radial_shifts: Tensor, angular_shifts: Tensor, angular_sections: Tensor,
                num_species: int) -> int:
    s = num_species
    return (s * radial_shifts.numel()
            + s * (s + 1) // 2 * angular_shifts.numel() * angular_sections.numel())


@torch.library.register_fake("torchani_fast::neighbor_pairs")
def _neighbor_pairs_fake(species, coords, cell, pbc, cutoff, cell_list):
    torch._check(species.dim() == 2, lambda: "species must be (M, A)")
    torch._check(coords.shape == (*species.shape, 3), lambda: "coords must be (M, A, 3)")
    num_pairs = torch.library.get_ctx().new_dynamic_size()
    pairs = species.new_empty((2, num_pairs), dtype=torch.long)
    images = coords.new_empty((num_pairs, 3))
    return pairs, images


@torch.library.register_fake("torchani_fast::neighbor_pairs_padded")
def _neighbor_pairs_padded_fake(species, coords, cell, pbc, cutoff, cell_list, max_pairs):
    torch._check(species.dim() == 2, lambda: "species must be (M, A)")
    torch._check(coords.shape == (*species.shape, 3), lambda: "coords must be (M, A, 3)")
    torch._check(max_pairs >= 0, lambda: f"max_pairs must be >= 0, got {max_pairs}")
    pairs = species.new_empty((2, max_pairs), dtype=torch.long)
    images = coords.new_empty((max_pairs, 3))
    num_pairs = species.new_empty((), dtype=torch.long)
    return pairs, images, num_pairs


@torch.library.register_fake("torchani_fast::pair_vectors")
def _pair_vectors_fake(coords, pairs, images, cell):
    return coords.new_empty((pairs.shape[1], 3)), coords.new_empty((pairs.shape[1],))


@torch.library.register_fake("torchani_fast::pair_vectors_backward")
def _pair_vectors_backward_fake(grad, pairs, num_atoms):
    return grad.new_empty((num_atoms, 3))


@torch.library.register_fake("torchani_fast::aev")
def _aev_fake(species, pairs, diff_vectors, radial_eta, radial_shifts, angular_eta,
              angular_zeta, angular_shifts, angular_sections, radial_cutoff, angular_cutoff,
              num_species, cutoff_kind=0, cutoff_order=2, cutoff_eps=1e-10):
    torch._check(pairs.dim() == 2 and pairs.shape[0] == 2, lambda: "pairs must be (2, P)")
    torch._check(diff_vectors.shape == (pairs.shape[1], 3), lambda: "diff_vectors must be (P, 3)")
    length = _aev_length(radial_shifts, angular_shifts, angular_sections, num_species)
    return diff_vectors.new_empty((*species.shape, length))


@torch.library.register_fake("torchani_fast::aev_with_edges")
def _aev_with_edges_fake(species, pairs, diff_vectors, *rest):
    # (the handle of the half edges is always a (0,) uint8 tensor: ops.h)
    return _aev_fake(species, pairs, diff_vectors, *rest), diff_vectors.new_empty(0, dtype=torch.uint8)


@torch.library.register_fake("torchani_fast::aev_backward_edges")
def _aev_backward_edges_fake(grad_aev, edges, species, pairs, diff_vectors, *rest):
    return _aev_backward_fake(grad_aev, species, pairs, diff_vectors)


@torch.library.register_fake("torchani_fast::aev_backward")
def _aev_backward_fake(grad_aev, species, pairs, diff_vectors, *rest):
    torch._check(diff_vectors.shape == (pairs.shape[1], 3), lambda: "diff_vectors must be (P, 3)")
    return torch.empty_like(diff_vectors)


@torch.library.register_fake("torchani_fast::aev_jvp")
def _aev_jvp_fake(tangent, species, pairs, diff_vectors, radial_eta, radial_shifts, angular_eta,
                  angular_zeta, angular_shifts, angular_sections, radial_cutoff, angular_cutoff,
                  num_species, cutoff_kind=0, cutoff_order=2, cutoff_eps=1e-10):
    torch._check(diff_vectors.shape == (pairs.shape[1], 3), lambda: "diff_vectors must be (P, 3)")
    torch._check(tangent.shape == diff_vectors.shape, lambda: "tangent must be (P, 3)")
    length = _aev_length(radial_shifts, angular_shifts, angular_sections, num_species)
    return diff_vectors.new_empty((*species.shape, length))


@torch.library.register_fake("torchani_fast::aev_double_backward")
def _aev_double_backward_fake(grad_aev, tangent, species, pairs, diff_vectors, *rest):
    torch._check(diff_vectors.shape == (pairs.shape[1], 3), lambda: "diff_vectors must be (P, 3)")
    torch._check(tangent.shape == diff_vectors.shape, lambda: "tangent must be (P, 3)")
    return torch.empty_like(diff_vectors)


@torch.library.register_fake("torchani_fast::aev_local_derivatives")
def _aev_local_derivatives_fake(grad_aev, columns, species, pairs, diff_vectors, *rest):
    torch._check(diff_vectors.shape == (pairs.shape[1], 3), lambda: "diff_vectors must be (P, 3)")
    torch._check(columns.dim() == 1, lambda: "columns must be 1-D")
    n = species.numel()
    k = torch.library.get_ctx().new_dynamic_size(min=1)
    local_atoms = species.new_empty((n, k), dtype=torch.long)
    jacobian = diff_vectors.new_empty((n, k, 3, columns.shape[0]))
    curvature = diff_vectors.new_empty((n, k, 3, k, 3))
    return local_atoms, jacobian, curvature


@torch.library.register_fake("torchani_fast::ensemble_mlp")
def _ensemble_mlp_fake(aev, atoms, sizes, columns, first, packs, panels, layers, members, input_grad,
                       zero_blocks_exact=False, activation=0):
    torch._check(aev.dim() == 2, lambda: "aev must be (atoms, features)")
    torch._check(len(columns) == len(sizes), lambda: "columns needs one entry per group")
    jac = sum(n * c.shape[0] for n, c in zip(sizes, columns)) if input_grad else 0
    return aev.new_empty((members, aev.shape[0])), aev.new_empty((jac,))


@torch.library.register_fake("torchani_fast::ensemble_atomic")
def _ensemble_atomic_fake(aev, atoms, sizes, columns, first, packs, panels, layers, members,
                          zero_blocks_exact=False, activation=0):
    torch._check(aev.dim() == 2, lambda: "aev must be (atoms, features)")
    torch._check(len(columns) == len(sizes), lambda: "columns needs one entry per group")
    return aev.new_empty((members, aev.shape[0]))


@torch.library.register_fake("torchani_fast::ensemble_energies")
def _ensemble_energies_fake(aev, atoms, sizes, columns, first, packs, panels, layers, members,
                            molecules, divisor, zero_blocks_exact=False, activation=0):
    torch._check(aev.dim() == 2, lambda: "aev must be (atoms, features)")
    torch._check(len(columns) == len(sizes), lambda: "columns needs one entry per group")
    return aev.new_empty((molecules,))


@torch.library.register_fake("torchani_fast::simd_activation")
def _simd_activation_fake(x, activation):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.register_fake("torchani_fast::simd_erf")
def _simd_erf_fake(x):
    return torch.empty_like(x)


@torch.library.register_fake("torchani_fast::group_atoms")
def _group_atoms_fake(elem_idxs, num_species, aev=None, radial_sublen=0, split_min_atoms=0):
    ctx = torch.library.get_ctx()
    atoms = elem_idxs.new_empty((ctx.new_dynamic_size(),), dtype=torch.long)
    return atoms, elem_idxs.new_empty((ctx.new_dynamic_size(), 3), dtype=torch.long)


# -- pair potentials (csrc/pairpot) ----------------------------------------------------------
__all__ += ["repulsion_xtb", "dispersion_d3", "pair_energies_backward"]

# cutoff_kind of the pair-potential ops: the potential's envelope (csrc/pairpot/pairpot.h).
PAIR_CUTOFF_COSINE = 0
PAIR_CUTOFF_SMOOTH = 1
PAIR_CUTOFF_NONE = 2


def repulsion_xtb(
    elem_idxs: Tensor,
    pairs: Tensor,
    distances: Tensor,
    ghost_flags: tp.Optional[Tensor],
    atomic: bool,
    y_ab: Tensor,
    sqrt_alpha_ab: Tensor,
    k_rep_ab: Tensor,
    angstrom_to_bohr: float,
    cutoff: float,
    cutoff_kind: int,
    cutoff_order: int = 2,
    cutoff_eps: float = 1e-10,
    derivatives: bool = False,
) -> tp.Tuple[Tensor, Tensor]:
    """TorchANI's xTB repulsion (``RepulsionXTB``) summed over neighbour pairs (CPU).

    Parameters
    ----------
    elem_idxs : Tensor, int64 or int32, shape (M, A)
        Element indices; -1 marks padding (its pairs are ignored).
    pairs : Tensor, int64, shape (2, P)
        Indices into the flattened ``M * A`` atoms; pairs with a negative index
        (unused slots) are ignored.
    distances : Tensor, float32 or float64, shape (P,)
        The pairs' distances in Å; differentiable (first and second derivatives).
        Pairs farther apart than ``cutoff`` are ignored.
    ghost_flags : Tensor, bool, (M, A), optional
        A pair touching a ghost atom counts half (TorchANI's convention).
    atomic : bool
        Return atomic energies (each pair's energy split evenly between its atoms).
    y_ab, sqrt_alpha_ab, k_rep_ab : Tensor, (T, T)
        The potential's buffers.
    angstrom_to_bohr : float
        TorchANI's conversion factor (the potential works in bohr).
    cutoff, cutoff_kind, cutoff_order, cutoff_eps
        The potential's own cutoff and envelope: ``PAIR_CUTOFF_COSINE``,
        ``PAIR_CUTOFF_SMOOTH`` (``CutoffSmooth(order, eps)``) or
        ``PAIR_CUTOFF_NONE`` (``CutoffDummy``, for ``cutoff=inf``).
    derivatives : bool
        Also return the per-pair factors of the gradient (what the backward reads).

    Returns
    -------
    energies : Tensor, (M,) or with ``atomic`` (M, A), in Hartree
    derivs : Tensor, (P, 1) with ``derivatives``, else (0, 1)
    """
    return torch.ops.torchani_fast.repulsion_xtb(
        elem_idxs, pairs, distances, ghost_flags, atomic, y_ab, sqrt_alpha_ab, k_rep_ab,
        angstrom_to_bohr, cutoff, cutoff_kind, cutoff_order, cutoff_eps, derivatives,
    )


def dispersion_d3(
    elem_idxs: Tensor,
    pairs: Tensor,
    distances: Tensor,
    ghost_flags: tp.Optional[Tensor],
    atomic: bool,
    coeff6: Tensor,
    coordnums_a: Tensor,
    coordnums_b: Tensor,
    covalent_radii: Tensor,
    sqrt_charge_ab: Tensor,
    cutoff_radii: Tensor,
    s6: float,
    s8: float,
    a1: float,
    a2: float,
    k1: float,
    k2: float,
    k3: float,
    eps: float,
    angstrom_to_bohr: float,
    cutoff: float,
    cutoff_kind: int,
    cutoff_order: int = 2,
    cutoff_eps: float = 1e-10,
    derivatives: bool = False,
) -> tp.Tuple[Tensor, Tensor]:
    """TorchANI's two-body D3(BJ) dispersion (``TwoBodyDispersionD3``) over neighbour pairs (CPU).

    ``elem_idxs``, ``pairs``, ``distances``, ``ghost_flags``, ``atomic``,
    ``angstrom_to_bohr``, the cutoff arguments and ``derivatives`` are as for
    :func:`repulsion_xtb`; the coordination numbers count the pairs given
    (within ``cutoff``), without envelope, as TorchANI does.

    Parameters
    ----------
    coeff6, coordnums_a, coordnums_b : Tensor, (T, T, R, R)
        ``precalc_coeff6``, ``precalc_coordnums_a`` and ``precalc_coordnums_b``;
        the reference grid must be a product grid
        (:func:`torchani_fast.potentials.d3_unsupported_reason`).
    covalent_radii : Tensor, (T,)
        In bohr, as the potential keeps them.
    sqrt_charge_ab, cutoff_radii : Tensor, (T, T)
        ``sqrt_charge_ab`` and ``_damp_fn.cutoff_radii``.
    s6, s8, a1, a2, k1, k2, k3, eps : float
        The functional's and D3's constants (``_s6``, ``_s8``, ``_damp_fn._a1``,
        ``_damp_fn._a2``, ``_k1``, ``_k2``, ``_k3``, ``_eps``).

    Returns
    -------
    energies : Tensor, (M,) or with ``atomic`` (M, A), in Hartree
    derivs : Tensor, (P, 4) with ``derivatives``, else (0, 4)
    """
    return torch.ops.torchani_fast.dispersion_d3(
        elem_idxs, pairs, distances, ghost_flags, atomic, coeff6, coordnums_a, coordnums_b,
        covalent_radii, sqrt_charge_ab, cutoff_radii, s6, s8, a1, a2, k1, k2, k3, eps,
        angstrom_to_bohr, cutoff, cutoff_kind, cutoff_order, cutoff_eps, derivatives,
    )


def pair_energies_backward(grad_energies: Tensor, derivs: Tensor, pairs: Tensor, elem_idxs: Tensor,
                           atomic: bool) -> Tensor:
    """Gradient (P,) w.r.t. the distances of ``sum(grad_energies * energies)`` from the
    ``derivs`` that :func:`repulsion_xtb` or :func:`dispersion_d3` returned (not differentiable)."""
    return torch.ops.torchani_fast.pair_energies_backward(grad_energies, derivs, pairs, elem_idxs,
                                                          atomic)


def _pair_potential_fake(elem_idxs, pairs, distances, atomic, derivatives, columns):
    torch._check(elem_idxs.dim() == 2, lambda: "elem_idxs must be (M, A)")
    torch._check(pairs.dim() == 2 and pairs.shape[0] == 2, lambda: "pairs must be (2, P)")
    torch._check(distances.shape == (pairs.shape[1],), lambda: "distances must be (P,)")
    shape = tuple(elem_idxs.shape) if atomic else (elem_idxs.shape[0],)
    return distances.new_empty(shape), distances.new_empty(
        (pairs.shape[1] if derivatives else 0, columns))


@torch.library.register_fake("torchani_fast::repulsion_xtb")
def _repulsion_xtb_fake(elem_idxs, pairs, distances, ghost_flags, atomic, y_ab, sqrt_alpha_ab,
                        k_rep_ab, angstrom_to_bohr, cutoff, cutoff_kind, cutoff_order, cutoff_eps,
                        derivatives=False):
    return _pair_potential_fake(elem_idxs, pairs, distances, atomic, derivatives, 1)


@torch.library.register_fake("torchani_fast::dispersion_d3")
def _dispersion_d3_fake(elem_idxs, pairs, distances, ghost_flags, atomic, coeff6, coordnums_a,
                        coordnums_b, covalent_radii, sqrt_charge_ab, cutoff_radii, s6, s8, a1, a2,
                        k1, k2, k3, eps, angstrom_to_bohr, cutoff, cutoff_kind, cutoff_order,
                        cutoff_eps, derivatives=False):
    return _pair_potential_fake(elem_idxs, pairs, distances, atomic, derivatives, 4)


@torch.library.register_fake("torchani_fast::pair_energies_backward")
def _pair_energies_backward_fake(grad_energies, derivs, pairs, elem_idxs, atomic):
    torch._check(derivs.shape[0] == pairs.shape[1], lambda: "derivs must be (P, K)")
    return derivs.new_empty((pairs.shape[1],))


# -- the networks' and the input checks' ops (csrc/ensemble, csrc/validate) ------------------
# Thin typed wrappers: TorchScript compiles them into the patched model's code, so
# that this module stays the one caller of torch.ops.torchani_fast.


def ensemble_atomic(aev: Tensor, atoms: Tensor, sizes: tp.List[int], columns: tp.List[Tensor],
                    first: tp.List[Tensor], packs: tp.List[Tensor], panels: tp.List[Tensor],
                    layers: tp.List[int], members: int, zero_blocks_exact: bool = False,
                    activation: int = 0) -> Tensor:
    """Atomic energies (members, N) of every element group and member (CPU; C++ autograd)."""
    return torch.ops.torchani_fast.ensemble_atomic(aev, atoms, sizes, columns, first, packs, panels, layers,
                                                   members, zero_blocks_exact, activation)


def ensemble_energies(aev: Tensor, atoms: Tensor, sizes: tp.List[int], columns: tp.List[Tensor],
                      first: tp.List[Tensor], packs: tp.List[Tensor], panels: tp.List[Tensor],
                      layers: tp.List[int], members: int, molecules: int, divisor: int,
                      zero_blocks_exact: bool = False, activation: int = 0) -> Tensor:
    """Energies (molecules,): the members' sum over each molecule's atoms over ``divisor``."""
    return torch.ops.torchani_fast.ensemble_energies(aev, atoms, sizes, columns, first, packs, panels, layers,
                                                     members, molecules, divisor, zero_blocks_exact, activation)


def ensemble_train(aev: Tensor, atoms: Tensor, sizes: tp.List[int], columns: tp.List[Tensor],
                   first: tp.List[Tensor], packs: tp.List[Tensor], layers: tp.List[int], members: int,
                   small: int, activation: int = 0) -> Tensor:
    """Atomic energies for training: differentiable in the weights (ATen on any device)."""
    return torch.ops.torchani_fast.ensemble_train(aev, atoms, sizes, columns, first, packs, layers, members,
                                                  small, activation)


def ensemble_dense(aev: Tensor, elem_idxs: Tensor, weights: tp.List[Tensor], weights_t: tp.List[Tensor],
                   biases: tp.List[Tensor], activation: int = 0) -> Tensor:
    """Each atom's network outputs summed over the members, (N,), differentiable in ``aev``.

    The networks of every element and member in one op (CUDA: two or three
    launches, no host synchronisation, csrc/ensemble/ensemble_cuda.cu), with the
    weights stacked per layer and zero-padded to the widest element:
    ``weights[l]`` (S, members, d_in, d_out), ``weights_t[l]`` the same transposed
    (S, members, d_out, d_in), ``biases[l]`` (S, members, d_out); layer 1 reads
    all of ``aev``'s (N, F) columns, the last layer has one output.
    ``elem_idxs`` (N,): each atom's element, -1 for padding (value 0); others
    outside [-1, S) give NaN. ``activation``: 0 CELU(0.1), 1 GELU.
    With grad, the op also returns d(value)/d(aev) (N, F), and the backward is
    ``grad[:, None] * jacobian``; under ``create_graph=True`` the backward
    recomputes the networks in ATen ops instead, so Hessians work (slower).
    """
    input_grad = aev.requires_grad and torch.is_grad_enabled()
    return torch.ops.torchani_fast.ensemble_dense(aev, elem_idxs, weights, weights_t, biases, activation,
                                                  input_grad)[0]


def ensemble_dense_jacobian(aev: Tensor, elem_idxs: Tensor, weights: tp.List[Tensor],
                            weights_t: tp.List[Tensor], biases: tp.List[Tensor],
                            activation: int = 0) -> tp.Tuple[Tensor, Tensor]:
    """:func:`ensemble_dense`'s values (N,) and their gradient d(value)/d(aev) (N, F),
    both from the forward (for callers that apply the chain rule themselves)."""
    out = torch.ops.torchani_fast.ensemble_dense(aev, elem_idxs, weights, weights_t, biases, activation, True)
    return out[0], out[1]


def _dense_reference(aev: Tensor, elem_idxs: Tensor, weights: tp.List[Tensor], biases: tp.List[Tensor],
                     activation: int, input_grad: bool) -> tp.Tuple[Tensor, Tensor]:
    """ensemble_dense's outputs in differentiable ATen ops: every element's networks on
    every atom, kept where the atom has that element (S times the work); the
    jacobian by hand (PyTorch's activation backwards), (0, F) without input_grad."""
    from .nn.recompute import _activate, _activation_backward

    n, s_num, k = aev.shape[0], weights[0].shape[0], weights[0].shape[1]
    out = aev.new_zeros((n,))
    jac = aev.new_zeros((n if input_grad else 0, aev.shape[1]))
    for e in range(s_num):
        h = aev.unsqueeze(0).expand(k, n, aev.shape[1])
        pre: tp.List[Tensor] = []
        for l in range(len(weights)):
            h = torch.baddbmm(biases[l][e].unsqueeze(1), h, weights[l][e])
            if l + 1 < len(weights):
                pre.append(h)
                h = _activate(h, activation)
        mine = (elem_idxs == e).unsqueeze(1)
        out = torch.where(mine[:, 0], h.squeeze(-1).sum(0), out)
        if input_grad:
            g = weights[-1][e].transpose(1, 2).expand(k, n, weights[-1].shape[2])
            for l in range(len(weights) - 2, -1, -1):
                g = torch.bmm(_activation_backward(g, pre[l], activation), weights[l][e].transpose(1, 2))
            jac = torch.where(mine, g.sum(0), jac)
    bad = (elem_idxs < -1) | (elem_idxs >= s_num)
    out = torch.where(bad, torch.full_like(out, float("nan")), out)
    if input_grad:
        jac = torch.where(bad.unsqueeze(1), torch.full_like(jac, float("nan")), jac)
    return out, jac


@torch.library.impl("torchani_fast::ensemble_dense", "cpu")
def _ensemble_dense_cpu(aev, elem_idxs, weights, weights_t, biases, activation=0, input_grad=False):
    # The reference on CPU tensors (the device paths run on the CPU, _device_paths.on_cpu).
    return _dense_reference(aev, elem_idxs, weights, biases, activation, input_grad)


@torch.library.register_fake("torchani_fast::ensemble_dense")
def _ensemble_dense_fake(aev, elem_idxs, weights, weights_t, biases, activation=0, input_grad=False):
    torch._check(aev.dim() == 2, lambda: "aev must be (atoms, features)")
    torch._check(elem_idxs.shape == aev.shape[:1], lambda: "elem_idxs must be (atoms,)")
    return aev.new_empty((aev.shape[0],)), aev.new_empty((aev.shape[0] if input_grad else 0, aev.shape[1]))


def _ensemble_dense_setup(ctx, inputs, output) -> None:
    aev, elem_idxs, weights, weights_t, biases, activation, input_grad = inputs
    ctx.save_for_backward(aev, elem_idxs, output[1])
    ctx.weights, ctx.biases, ctx.activation, ctx.input_grad = weights, biases, activation, input_grad
    # The jacobian output is never differentiated: no zeros of its shape for its gradient.
    ctx.set_materialize_grads(False)


def _ensemble_dense_backward(ctx, grad_atomic, grad_jacobian):
    aev, elem_idxs, jac = ctx.saved_tensors
    none = [None] * len(ctx.weights)  # (the weights are constants)
    if grad_atomic is None:
        return None, None, none, none, none, None, None
    if torch.is_grad_enabled():
        # create_graph=True (Hessians, force training): the jacobian again, as ATen
        # ops of aev, so that the gradient can be differentiated.
        jac = _dense_reference(aev, elem_idxs, ctx.weights, ctx.biases, ctx.activation, True)[1]
        grad = grad_atomic.unsqueeze(1) * jac
    else:
        torch._check(ctx.input_grad, lambda: "torchani_fast::ensemble_dense was called with input_grad=False: "
                     "no jacobian for its backward (call ops.ensemble_dense)")
        grad = grad_atomic.unsqueeze(1) * jac
    return grad, None, none, none, none, None, None


torch.library.register_autograd("torchani_fast::ensemble_dense", _ensemble_dense_backward,
                                setup_context=_ensemble_dense_setup)


def group_atoms(elem_idxs: Tensor, num_species: int, aev: tp.Optional[Tensor] = None, radial_sublen: int = 0,
                split_min_atoms: int = 0) -> tp.Tuple[Tensor, Tensor]:
    """Atoms ordered by group, and one (element, block mask, size, ...) row per group."""
    return torch.ops.torchani_fast.group_atoms(elem_idxs, num_species, aev, radial_sublen, split_min_atoms)


def first_invalid_atom(species: Tensor, coords: Tensor) -> int:
    """-1 if every species is >= -1 and every real atom's coordinates are finite,
    else the flat index of the first atom that is not (CPU, one pass)."""
    return torch.ops.torchani_fast.first_invalid_atom(species, coords)


def valid_cell(cell: Tensor, pbc: Tensor) -> bool:
    """Whether ``cell`` is finite and, if any axis is periodic, non-singular (CPU)."""
    return torch.ops.torchani_fast.valid_cell(cell, pbc)


def convert_species(atomic_nums: Tensor, conv: Tensor) -> tp.Tuple[Tensor, int]:
    """Element indices of atomic numbers, and -1 or the flat index of the first
    unsupported or out-of-range one (CPU, one pass)."""
    return torch.ops.torchani_fast.convert_species(atomic_nums, conv)


# -- the input checks, their fakes, and their form for traced graphs --------------------------
# first_invalid_atom, valid_cell and convert_species answer with a host value that the caller
# branches on; traced, that value is data-dependent (an unbacked symbol), so the validation
# (validation.py) does not call them under torch.compile / torch.export. It calls the checking
# ops below instead: ops with no output, marked side-effectful (never removed as dead code),
# whose implementation runs when the compiled graph runs, reads the real values and raises
# the eager error with its message (they are defined in validation.py, beside the checks
# they run). Their fakes do nothing. (On CUDA each reads the inputs back: one host
# synchronisation per check, as the eager checks.)
@torch.library.register_fake("torchani_fast::first_invalid_atom")
def _first_invalid_atom_fake(species, coords):
    return torch.library.get_ctx().new_dynamic_size(min=-1)


@torch.library.register_fake("torchani_fast::valid_cell")
def _valid_cell_fake(cell, pbc):
    return torch.library.get_ctx().new_dynamic_size(min=0, max=1) == 1


@torch.library.register_fake("torchani_fast::convert_species")
def _convert_species_fake(atomic_nums, conv):
    return torch.empty_like(atomic_nums, dtype=torch.long), torch.library.get_ctx().new_dynamic_size(min=-1)


def check_input_values(species: Tensor, coords: Tensor) -> None:
    """Raise, when the graph runs, the eager error for species < -1 or non-finite
    coordinates of real atoms (traced input checks; validation.check_input_values)."""
    torch.ops.torchani_fast.check_input_values(species, coords)


def check_species_values(atomic_nums: Tensor, conv: Tensor, element_indices: bool) -> None:
    """Raise, when the graph runs, the eager error for an unknown or unsupported element."""
    torch.ops.torchani_fast.check_species_values(atomic_nums, conv, element_indices)


def check_cell_values(species: Tensor, coords: Tensor, cell: Tensor, pbc: Tensor, cutoff: float) -> None:
    """Raise, when the graph runs, the eager error for a non-finite, singular or too small cell."""
    torch.ops.torchani_fast.check_cell_values(species, coords, cell, pbc, cutoff)
