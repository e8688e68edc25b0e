"""Energy + forces of one fixed system, for MD and optimisation loops.

A patched model accepts any batch at every call, so each call finds out which
elements are present and how many neighbour pairs there are: a few host
synchronisations, which rule out CUDA graphs. In an MD or optimisation loop
the atoms never change, only their positions. :class:`EnergyForcesStep` fixes
the species (and the cell and pbc) once, and then each call

- finds the neighbours with a fixed-capacity list (``max_pairs``; no sync),
- computes the AEVs and the fused networks with the element groups found at
  construction (no sync),
- adds the model's repulsion and dispersion (ANI-2xr, ANI-2dr, ...) from the
  same neighbour list, on the CPU,

so on CUDA the whole step, forces included, is captured once in a CUDA graph
and replayed. Each call then checks the pair count (one sync, ~10 us), which
raises if the capacity overflowed or the coordinates were not finite, so a
wrong energy is never returned silently; ``check_every=n`` checks only every
n-th call (faster, but up to n-1 results may be wrong before the error).

One step may be shared by threads: its buffers (the neighbour list's pair
count, the captured graph's inputs and outputs, the :class:`Workspace` whose
memory the CPU ops reuse from one call to the next) belong to the object, so each
call holds the step's lock from the input copy to the pair-count check, and
the calls run one after another. A pair count read by a call is always that
call's own.

The step uses the model's parameters as they are when it is built (packed
weights are kept alive by the step): build a new step after changing the
model (weights, dtype, device, active members).
"""
import threading
import typing as tp

import torch
from torch import Tensor

from . import ops
from .aev import AEVComputer, NeighborList
from .nn import FusedEnsemble, FusedNetworks
from .evaluate import Workspace, forces_of, require_tensors
from .patch import is_patched, kept_parts, nnp_of
from .potentials import FastDispersionD3, FastRepulsionXTB, UnboundedNeighborList
from .validation import check_periodic_work

__all__ = ["EnergyForcesStep"]


class EnergyForcesStep:
    """``step(coords) -> (energies (M,), forces (M, A, 3))`` for fixed species, cell and pbc.

    Parameters
    ----------
    model : a patched TorchANI ANI model (eager, not scripted)
    species : Tensor (M, A)
        Atomic numbers (or element indices if the model has
        ``periodic_table_index=False``), -1 for padding; fixed for the step's life.
    coords : Tensor (M, A, 3)
        A representative geometry: validates the inputs, sizes the neighbour
        list and warms up (and on CUDA, captures) the step.
    cell, pbc : optional, as for the model; fixed.
    max_pairs : int, optional
        Capacity of the neighbour list. Default: 1.3 x the pairs of ``coords`` + 64.
    cuda_graph : bool, optional
        Capture the step in a CUDA graph (default: True on CUDA; ignored on the CPU).
    check_every : int
        Check the pair count every this many calls (1: every call; 0: never,
        call :meth:`check` yourself).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        species: Tensor,
        coords: Tensor,
        cell: tp.Optional[Tensor] = None,
        pbc: tp.Optional[Tensor] = None,
        *,
        max_pairs: tp.Optional[int] = None,
        cuda_graph: tp.Optional[bool] = None,
        check_every: int = 1,
    ):
        if not is_patched(model):
            raise TypeError("EnergyForcesStep needs a model patched by torchani_fast.patch()")
        extra = {k: p for k, p in model.potentials.items() if k != "nnp" and p._enabled}
        kept = [k for k, p in extra.items() if not isinstance(p, (FastRepulsionXTB, FastDispersionD3))]
        if kept:
            raise NotImplementedError(
                f"EnergyForcesStep evaluates the ANI potential and torchani_fast's repulsion and "
                f"dispersion; this model also has {kept} (evaluate it with model.energies_forces "
                "or the ASE calculator)")
        if extra and coords.device.type != "cpu":
            raise NotImplementedError(
                f"EnergyForcesStep on {coords.device.type} supports models with only the ANI "
                f"potential; this model also has {list(extra)} (pair potentials run in the step "
                "on the CPU only; on the GPU use model.energies_forces)")
        nnp = nnp_of(model)
        if not isinstance(nnp.aev_computer, AEVComputer):
            raise NotImplementedError(
                "EnergyForcesStep needs torchani_fast's AEV; this model keeps TorchANI's "
                f"({kept_parts(model).get('AEV computer', type(nnp.aev_computer).__name__)})")
        nets = nnp.neural_networks
        if not isinstance(nets, (FusedEnsemble, FusedNetworks)):
            raise TypeError("EnergyForcesStep needs the fused networks of a patched model")
        require_tensors(species=species, coords=coords, cell=cell, pbc=pbc)
        if check_every < 0:
            raise ValueError(f"check_every must be >= 0, got {check_every}")
        if pbc is not None and not bool(pbc.any()):
            cell, pbc = None, None  # all-False pbc: not periodic, as in the model
        # Validation of everything, once, by the model itself (names the bad argument).
        model._check_inputs(species, coords, 0)
        check_periodic_work(species, coords, cell, pbc, float(model.cutoff), values=True)
        # One neighbour list at the model's cutoff: the AEV reads the pairs within its
        # own cutoff, each pair potential those within its own (an infinite one, all pairs).
        self.cutoff = float(model.cutoff)
        search = UnboundedNeighborList if self.cutoff == float("inf") else NeighborList
        with torch.no_grad():
            elem = model.species_converter(species, nop=not model.periodic_table_index)
            num_pairs = search(model.neighborlist.strategy)(self.cutoff, elem, coords, cell, pbc).indices.shape[1]
            self.shift = model.energy_shifter(elem).detach() if model.energy_shifter._enabled \
                else coords.new_zeros(coords.shape[0])
        if max_pairs is None:
            max_pairs = int(1.3 * num_pairs) + 64
        if max_pairs <= 0:
            raise ValueError(f"max_pairs must be > 0, got {max_pairs}")
        self.max_pairs = max_pairs
        self.neighborlist = search(model.neighborlist.strategy).to(coords.device)
        # The pair count of the last call (a tensor written by the search; after a
        # CUDA graph replay, the replay's): read by check().
        self.num_pairs = torch.full((), -1, dtype=torch.long, device=coords.device)
        self.potentials = list(extra.values())
        self.aev_computer = AEVComputer(nnp.aev_computer.radial, nnp.aev_computer.angular,
                                        nnp.aev_computer.num_species, nnp.aev_computer.triu_index,
                                        self.neighborlist)
        self.networks = nets
        self.groups = nets.fixed_groups(elem)
        self.elem = elem
        self.cell = cell
        self.pbc = pbc
        self.shape = tuple(coords.shape)
        self.dtype = coords.dtype
        self.device = coords.device
        self.check_every = check_every
        self.calls = 0
        self._graph = None
        # The pair count, the static graph buffers and ``calls`` are shared by
        # every caller of this object: one call at a time (see the module doc).
        self._lock = threading.Lock()
        reuses = Workspace.reuses(coords.shape[0] * coords.shape[1], self.aev_computer.out_dim, coords.dtype)
        self._workspace = Workspace() if reuses else None
        use_graph = coords.device.type == "cuda" if cuda_graph is None else cuda_graph
        self._warm_up(coords, use_graph and coords.device.type == "cuda")

    def _eager(self, x: Tensor) -> tp.Tuple[Tensor, Tensor]:
        if self._workspace is None:
            return self._evaluate(x)
        with self._workspace:  # the AEV and its gradient reuse the last call's memory (CPU)
            return self._evaluate(x)

    def _evaluate(self, x: Tensor) -> tp.Tuple[Tensor, Tensor]:
        neighbors, self.num_pairs = self.neighborlist.padded(self.cutoff, self.elem, x, self.cell,
                                                             self.pbc, self.max_pairs)
        aev = self.aev_computer.compute_from_neighbors(self.elem, x, neighbors)
        energies = self.networks.energies_fixed(self.elem, aev, self.groups) + self.shift
        for pot in self.potentials:
            energies = energies + pot.compute_from_neighbors(self.elem, x, neighbors).energies
        return energies.detach(), forces_of(energies, x)

    def _warm_up(self, coords: Tensor, capture: bool) -> None:
        self._static_x = coords.detach().clone().requires_grad_(True)
        if not capture:
            self._eager(self._static_x)
            self.check()
            # Keep the packed weights the step uses alive (see the module doc).
            self._keep = self.networks.packed_weights()
            return
        side = torch.cuda.Stream(device=coords.device)
        side.wait_stream(torch.cuda.current_stream(coords.device))
        with torch.cuda.stream(side):  # warm-up outside the capture, as torch requires
            for _ in range(2):
                self._eager(self._static_x)
        torch.cuda.current_stream(coords.device).wait_stream(side)
        self.check()
        self._keep = self.networks.packed_weights()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._static_out = self._eager(self._static_x)
        self._graph = graph

    def check(self) -> int:
        """Number of neighbour pairs of the last call; raises if the list overflowed
        ``max_pairs`` or the coordinates were not finite (synchronises)."""
        with self._lock:
            return ops.check_num_pairs(self.num_pairs, self.max_pairs)

    def __call__(self, coords: Tensor) -> tp.Tuple[Tensor, Tensor]:
        require_tensors(coords=coords)
        if tuple(coords.shape) != self.shape:
            raise ValueError(f"coords must have the step's shape {self.shape}, got {tuple(coords.shape)}")
        if coords.dtype != self.dtype or coords.device != self.device:
            raise ValueError(
                f"coords must be {self.dtype} on {self.device} like the step's, "
                f"got {coords.dtype} on {coords.device}"
            )
        with self._lock:
            if self._graph is not None:
                with torch.no_grad():
                    self._static_x.copy_(coords)
                self._graph.replay()
                energies, forces = self._static_out[0].clone(), self._static_out[1].clone()
            else:
                energies, forces = self._eager(coords.detach().requires_grad_(True))
            self.calls += 1
            if self.check_every and self.calls % self.check_every == 0:
                ops.check_num_pairs(self.num_pairs, self.max_pairs)
        return energies, forces
