"""The AEV featurizer: a drop-in replacement for ``torchani.aev.AEVComputer``.

It keeps TorchANI's ``radial`` (ANIRadial) and ``angular`` (ANIAngular) modules,
so the constants stay buffers under the same state-dict keys and move with
``.to()``, and computes the AEV with the ``torchani_fast::aev`` op.
"""
import typing as tp

import torch
from torch import Tensor
from torch.jit import Final
try:
    from torchani.neighbors import Neighbors
except ImportError:  # TorchANI 2.2.4: torchani_fast.legacy uses NeighborList with this stand-in
    class Neighbors(tp.NamedTuple):
        """``torchani.neighbors.Neighbors`` of TorchANI >= 2.7."""

        indices: Tensor
        distances: Tensor
        diff_vectors: Tensor

from . import ops
from .validation import InputError, check_periodic_work

__all__ = ["AEVComputer", "NeighborList"]

# Below this many atoms per molecule testing every pair is cheaper than binning.
CELL_LIST_MIN_ATOMS = 256
# The first capacity per atom of NeighborList.checked's search.
PAIRS_PER_ATOM = 64


class NeighborList(torch.nn.Module):
    """Neighbour search with the ``torchani_fast::neighbor_pairs`` op.

    Called like TorchANI's neighbour lists, ``nl(cutoff, elem_idxs, coords, cell, pbc)``,
    and returns a ``torchani.neighbors.Neighbors``. Unlike TorchANI's ``AllPairs``
    it is right for batches of periodic molecules, and unlike its ``CellList`` it
    handles batches, partial pbc and cells smaller than the cutoff.

    Parameters
    ----------
    strategy : {"auto", "all_pairs", "cell_list"}
        "auto" bins atoms (O(N)) from ``CELL_LIST_MIN_ATOMS`` atoms per molecule on.

    The exact list's length depends on the data (on CUDA that costs one host
    sync per call, to learn it). :meth:`padded` is the fixed-capacity search
    with no host sync, for loops that capture a step in a CUDA graph
    (:class:`~torchani_fast.EnergyForcesStep`): it also returns the pair count,
    which the caller checks (``ops.check_num_pairs``, a sync) every so often,
    as an MD code checks its Verlet list.
    """

    strategy: str
    cell_list_min_atoms: Final[int]
    pairs_per_atom: int

    def __init__(self, strategy: str = "auto"):
        super().__init__()
        self.strategy = "auto"
        self.cell_list_min_atoms = CELL_LIST_MIN_ATOMS
        # The capacity per atom of the list that :meth:`checked` searches into
        # (about twice the half list of liquid water at 5.2 Å; grows on overflow).
        self.pairs_per_atom = PAIRS_PER_ATOM
        self.set_strategy(strategy)

    def __setstate__(self, state):
        # Lists pickled by an older torchani_fast get the attributes added since.
        state.setdefault("pairs_per_atom", PAIRS_PER_ATOM)
        super().__setstate__(state)

    @torch.jit.export
    def set_strategy(self, strategy: str) -> None:
        if strategy not in ["auto", "all_pairs", "cell_list"]:
            raise ValueError(
                "neighbour list strategy must be 'auto', 'all_pairs' or 'cell_list', got '"
                + strategy + "'"
            )
        self.strategy = strategy

    def forward(
        self,
        cutoff: float,
        elem_idxs: Tensor,
        coords: Tensor,
        cell: tp.Optional[Tensor] = None,
        pbc: tp.Optional[Tensor] = None,
    ) -> Neighbors:
        return self._search(self._search_cutoff(cutoff, elem_idxs, coords, pbc), elem_idxs,
                            coords, cell, pbc, 0)[0]

    @torch.jit.export
    def padded(
        self,
        cutoff: float,
        elem_idxs: Tensor,
        coords: Tensor,
        cell: tp.Optional[Tensor],
        pbc: tp.Optional[Tensor],
        max_pairs: int,
    ) -> tp.Tuple[Neighbors, Tensor]:
        """The neighbours in a list of ``max_pairs`` slots, and the pair count.

        Unused slots hold the pair (-1, -1) (their vectors read atom 0; the AEV
        op skips them). The count is a tensor (no host sync): more than
        ``max_pairs`` means pairs were dropped, and -1 / -2 / -3 mean non-finite
        coordinates / a singular cell / a cell too small for the cutoff; read it
        with ``ops.check_num_pairs(count, max_pairs)``, which raises for these.
        """
        if max_pairs <= 0:
            raise ValueError("max_pairs must be > 0, got " + str(max_pairs))
        neighbors, count = self._search(self._search_cutoff(cutoff, elem_idxs, coords, pbc),
                                        elem_idxs, coords, cell, pbc, max_pairs)
        assert count is not None
        return neighbors, count

    @torch.jit.export
    def checked(
        self,
        cutoff: float,
        elem_idxs: Tensor,
        coords: Tensor,
        cell: tp.Optional[Tensor],
        pbc: tp.Optional[Tensor],
        bad: Tensor,
    ) -> tp.Tuple[Neighbors, bool]:
        """The exact list, as :meth:`forward` gives it, of inputs whose value
        checks are still on the device, in one host read.

        ``bad`` (a 0-dim bool tensor) is the callers' checks: True where one of
        them failed. It is read back together with the pair count, the read that
        sizing the exact list needs anyway: the search runs into a list of
        ``pairs_per_atom`` slots per atom (every pair of a molecule, if fewer), is
        cut to the count, and searches again into the exact size if it overflowed
        (no further read; the capacity then grows for the next call). Returns the
        list and True; or an empty list and False where ``bad`` or the search
        flagged the input (non-finite coordinates, a singular or too small cell),
        and the caller runs the checks that word the error. ``cell`` and ``pbc``
        must have passed ``check_cell_pbc(..., values=False)``, whose shapes
        ``bad`` does not cover. Bad input is kept from the search (no atoms,
        a harmless cell) so that the search raises nothing and does no more work
        than for good input.
        """
        search_cutoff = self._search_cutoff(cutoff, elem_idxs, coords, pbc)
        species = torch.where(bad, -1, elem_idxs)
        search_cell: tp.Optional[Tensor] = None
        if cell is not None:
            big = torch.eye(3, dtype=cell.dtype, device=cell.device) * (2.0 * search_cutoff + 1.0)
            search_cell = torch.where(bad, big, cell.detach())
        use_cells = self._use_cells(elem_idxs.shape[1])
        molecules, atoms = elem_idxs.shape[0], elem_idxs.shape[1]
        capacity = molecules * atoms * self.pairs_per_atom
        if pbc is None:  # (no periodic images: at most every pair of each molecule)
            capacity = min(capacity, molecules * (atoms * (atoms - 1) // 2))
        pairs, images, count = ops.neighbor_pairs_padded(
            species, coords.detach(), search_cell, pbc, search_cutoff, use_cells, capacity)
        num_pairs = int(torch.where(bad, -1, count))  # the one read
        if num_pairs < 0:
            return Neighbors(pairs[:, :0], coords.new_zeros(0), coords.new_zeros((0, 3))), False
        if num_pairs > capacity:
            self.pairs_per_atom = max(self.pairs_per_atom, (num_pairs + num_pairs // 4) // (molecules * atoms) + 1)
            pairs, images, count = ops.neighbor_pairs_padded(
                species, coords.detach(), search_cell, pbc, search_cutoff, use_cells, num_pairs)
        pairs = pairs[:, :num_pairs].contiguous()
        diff, distances = ops.pair_vectors(coords.reshape(-1, 3), pairs,
                                           None if cell is None else images[:num_pairs], cell)
        return Neighbors(pairs, distances, diff), True

    def _use_cells(self, atoms: int) -> bool:
        """Whether the search bins atoms in cells (else it tests every pair)."""
        return self.strategy == "cell_list" or (self.strategy == "auto" and atoms >= self.cell_list_min_atoms)

    def _search_cutoff(self, cutoff: float, elem_idxs: Tensor, coords: Tensor,
                       pbc: tp.Optional[Tensor]) -> float:
        """The cutoff the search runs at (subclasses may map one they take)."""
        return cutoff

    def _search(self, cutoff: float, elem_idxs: Tensor, coords: Tensor,
                cell: tp.Optional[Tensor], pbc: tp.Optional[Tensor],
                max_pairs: int) -> tp.Tuple[Neighbors, tp.Optional[Tensor]]:
        # The sync-free search (max_pairs > 0) reads no data here either.
        check_periodic_work(elem_idxs, coords, cell, pbc, cutoff, values=max_pairs == 0)
        use_cells = self._use_cells(elem_idxs.shape[1])
        count: tp.Optional[Tensor] = None
        if max_pairs > 0:
            pairs, images, count = ops.neighbor_pairs_padded(
                elem_idxs, coords.detach(), None if cell is None else cell.detach(), pbc,
                cutoff, use_cells, max_pairs,
            )
            # Unused slots (-1) read atom 0; the AEV op skips them by their index.
            safe = pairs.clamp(min=0)
        else:
            pairs, images = ops.neighbor_pairs(
                elem_idxs, coords.detach(), None if cell is None else cell.detach(), pbc,
                cutoff, use_cells,
            )
            safe = pairs
        diff, distances = ops.pair_vectors(coords.reshape(-1, 3), safe,  # (a copy for expanded coords)
                                           None if cell is None else images, cell)
        return Neighbors(pairs, distances, diff), count


class AEVComputer(torch.nn.Module):
    """ANI AEVs with torchani_fast's compiled kernels.

    Build it from a TorchANI ``AEVComputer`` (``AEVComputer.from_torchani``); the
    ``radial`` and ``angular`` term modules are shared, not copied. Their
    ``cutoff_fn`` (``CutoffCosine`` or ``CutoffSmooth``, the same for both
    terms) becomes the ops' ``cutoff_kind``, ``cutoff_order`` and ``cutoff_eps``.

    ``zero_block_exact`` says whether an AEV block (the columns of one
    neighbour element or element pair) is exactly 0 only when the atom has no
    such neighbour, which the fused networks' skipping of zero blocks relies
    on. True for the cosine cutoff (the kernels keep its accurate tail, see
    docs/design.md); False for the smooth cutoff, which underflows to 0 inside
    the cutoff (float32: beyond 0.994 rc for order 2; float64: beyond 0.9993 rc).
    """

    num_species: Final[int]
    num_species_pairs: Final[int]
    radial_len: Final[int]
    angular_len: Final[int]
    out_dim: Final[int]
    cutoff_kind: Final[int]
    cutoff_order: Final[int]
    cutoff_eps: Final[float]
    zero_block_exact: Final[bool]
    _strategy: str

    def __init__(self, radial: torch.nn.Module, angular: torch.nn.Module, num_species: int,
                 triu_index: Tensor, neighborlist: tp.Optional[NeighborList] = None):
        super().__init__()
        self.radial = radial
        self.angular = angular
        self.num_species = num_species
        self.num_species_pairs = num_species * (num_species + 1) // 2
        self.register_buffer("triu_index", triu_index)
        self.neighborlist = neighborlist if neighborlist is not None else NeighborList()
        self.radial_len = int(radial.num_feats) * num_species
        self.angular_len = int(angular.num_feats) * self.num_species_pairs
        self.out_dim = self.radial_len + self.angular_len
        self.cutoff_kind, self.cutoff_order, self.cutoff_eps = cutoff_constants(radial, angular)
        self.zero_block_exact = self.cutoff_kind == ops.CUTOFF_COSINE
        self._strategy = "torchani_fast"

    @classmethod
    def from_torchani(cls, aev_computer: torch.nn.Module,
                      neighborlist: tp.Optional[NeighborList] = None) -> "AEVComputer":
        """Wrap the terms of a ``torchani.aev.AEVComputer`` (raises if unsupported)."""
        check_supported(aev_computer)
        return cls(aev_computer.radial, aev_computer.angular, aev_computer.num_species,
                   aev_computer.triu_index, neighborlist)

    @property
    def strategy(self) -> str:
        return self._strategy

    @torch.jit.export
    def set_strategy(self, strat: str) -> None:
        # TorchANI's strategies select its own implementations ('pyaev', 'cuaev',
        # ...). A patched model always uses torchani_fast's kernels, which give the
        # same AEVs, so every TorchANI strategy name is accepted.
        if strat not in ["auto", "pyaev", "cuaev", "cuaev-fused", "cuaev-interface",
                         "torchani_fast"]:
            raise ValueError("Unknown compute strategy '" + strat + "'")

    def forward(
        self,
        elem_idxs: Tensor,
        coords: tp.Optional[Tensor] = None,
        cell: tp.Optional[Tensor] = None,
        pbc: tp.Optional[Tensor] = None,
    ) -> Tensor:
        """AEVs (M, A, out_dim) of a batch; see ``torchani.aev.AEVComputer.forward``."""
        if coords is None:
            raise ValueError("coords is required")
        # TorchANI's AEVComputer asserts these (InputError is also an AssertionError).
        if elem_idxs.dim() != 2:
            raise InputError("species must have shape (molecules, atoms), got {}".format(list(elem_idxs.shape)))
        if coords.shape != (elem_idxs.shape[0], elem_idxs.shape[1], 3):
            raise InputError("coords must have shape (molecules, atoms, 3) = {} to match species, got {}".format(
                [elem_idxs.shape[0], elem_idxs.shape[1], 3], list(coords.shape)))
        neighbors = self.neighborlist(float(self.radial.cutoff), elem_idxs, coords, cell, pbc)
        return self._aev(elem_idxs, neighbors.indices, neighbors.diff_vectors)

    @torch.jit.export
    def compute_from_neighbors(self, elem_idxs: Tensor, coords: Tensor,
                               neighbors: Neighbors) -> Tensor:
        """AEVs from an existing neighbour list.

        Only ``neighbors.indices`` and ``neighbors.diff_vectors`` are read (the
        distances are recomputed from the vectors), and the result is
        differentiable with respect to ``diff_vectors``, which is how ASE stress
        and external neighbour lists get their gradients.
        """
        return self._aev(elem_idxs, neighbors.indices, neighbors.diff_vectors)

    @torch.jit.unused
    def op_constants(self) -> tuple:
        """The AEV ops' arguments after (species, pairs, diff_vectors), as :meth:`_aev`
        passes them (eager callers of ``aev_with_edges``, ``aev_backward_edges``...)."""
        radial, angular = self.radial, self.angular
        return (radial.eta, radial.shifts, angular.eta, angular.zeta, angular.shifts, angular.sections,
                float(radial.cutoff), float(angular.cutoff), self.num_species,
                self.cutoff_kind, self.cutoff_order, self.cutoff_eps)

    def _aev(self, elem_idxs: Tensor, pairs: Tensor, diff_vectors: Tensor) -> Tensor:
        if diff_vectors.dtype != self.radial.eta.dtype:
            # float32 coords into a float64 model: promoted as TorchANI does
            # (validation.DTYPE_RULE; the other way round is refused before).
            diff_vectors = diff_vectors.to(self.radial.eta.dtype)
        return ops.aev(
            elem_idxs, pairs, diff_vectors,
            self.radial.eta, self.radial.shifts,
            self.angular.eta, self.angular.zeta, self.angular.shifts, self.angular.sections,
            float(self.radial.cutoff), float(self.angular.cutoff), self.num_species,
            self.cutoff_kind, self.cutoff_order, self.cutoff_eps,
        )


def _cutoff_constants(cutoff_fn: torch.nn.Module, name: str) -> tp.Tuple[int, int, float]:
    from torchani.cutoffs import CutoffCosine, CutoffSmooth

    if type(cutoff_fn) is CutoffCosine:
        return ops.CUTOFF_COSINE, 2, 1e-10
    if type(cutoff_fn) is CutoffSmooth:
        order, eps = cutoff_fn.order, cutoff_fn.eps
        if isinstance(order, bool) or not isinstance(order, int) or not 1 <= order <= 64:
            raise TypeError(
                f"torchani_fast supports CutoffSmooth with an integer order in [1, 64], but the "
                f"{name} terms use order={order!r}"
            )
        if not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise TypeError(
                f"torchani_fast supports CutoffSmooth with 0 < eps < 1, but the {name} terms "
                f"use eps={eps!r}"
            )
        return ops.CUTOFF_SMOOTH, int(order), float(eps)
    raise TypeError(
        f"torchani_fast supports the cosine cutoff (CutoffCosine) and the smooth cutoff "
        f"(CutoffSmooth), but the {name} terms use {type(cutoff_fn).__name__}"
    )


def cutoff_constants(radial: torch.nn.Module, angular: torch.nn.Module) -> tp.Tuple[int, int, float]:
    """The AEV ops' ``(cutoff_kind, cutoff_order, cutoff_eps)`` for these terms'
    ``cutoff_fn``; raises ``TypeError`` naming the term if it is not supported or
    if the two terms use different cutoff functions."""
    r = _cutoff_constants(radial.cutoff_fn, "radial")
    a = _cutoff_constants(angular.cutoff_fn, "angular")
    if r != a:
        raise TypeError(
            f"torchani_fast needs the same cutoff function for both terms, but the radial terms "
            f"use {radial.cutoff_fn!r} and the angular terms {angular.cutoff_fn!r}"
        )
    return r


def check_supported(aev_computer: torch.nn.Module) -> None:
    """Raise ``TypeError`` naming what torchani_fast cannot reproduce exactly."""
    from torchani.aev import AEVComputer as TorchaniAEV
    from torchani.aev._terms import ANIAngular, ANIRadial

    if not isinstance(aev_computer, TorchaniAEV):
        raise TypeError(
            f"torchani_fast supports torchani.aev.AEVComputer, got {type(aev_computer).__name__}"
        )
    radial, angular = aev_computer.radial, aev_computer.angular
    if type(radial) is not ANIRadial or type(angular) is not ANIAngular:
        raise TypeError(
            "torchani_fast supports ANIRadial + ANIAngular terms, got "
            f"{type(radial).__name__} + {type(angular).__name__}"
        )
    cutoff_constants(radial, angular)
    if not angular.cutoff <= radial.cutoff:
        raise TypeError(
            f"angular cutoff {angular.cutoff} must not exceed the radial cutoff {radial.cutoff}"
        )
