"""Energy + forces of one fixed system, for MD and optimisation loops.

A patched model accepts any batch at every call, so each call finds out which
elements are present and how many neighbour pairs there are: a few host
synchronisations, which rule out CUDA graphs. In an MD or optimisation loop
the atoms never change, only their positions. :class:`EnergyForcesStep` fixes
the species (and the cell and pbc) once, and then each call

- finds the neighbours with a fixed-capacity list (``max_pairs``; no sync),
- evaluates the model's own composition of its energy
  (:class:`torchani_fast.core.ModelCore`: AEV, fused networks, repulsion and
  dispersion of ANI-2xr, ANI-2dr, ... on the CPU, self energies) on that list,
  without the per-call input checks (done once, at construction): the same
  bits as a model call. On CUDA the networks use the element groups found at
  construction (no sync); on the CPU, groups found from each call's AEVs, as a
  model call finds them,

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

An eager step (always on the CPU) reads the model's weights and self-energies
at every call, so changes made in place (an optimizer step,
``load_state_dict``) are seen. A CUDA-graph step replays the weights it
captured (it keeps them alive): build a new one after changing them. Build a
new step after changing the model's dtype, device or active members.
"""
import threading
import typing as tp

import numpy as np
import torch
from torch import Tensor

from . import core, ops
from ._device_paths import host_path
from .aev import AEVComputer, NeighborList
from .core import Workspace, forces_of, require_tensors
from .nn import FusedEnsemble, FusedNetworks
from .patch import is_patched, kept_parts, nnp_of
from .potentials import FastDispersionD3, FastRepulsionXTB, UnboundedNeighborList
from .validation import check_periodic_work

__all__ = ["EnergyForcesStep", "GrowingStep"]


def _room(num_pairs: int) -> int:
    """A neighbour list's capacity for a geometry with ``num_pairs`` pairs (1.3x + 64)."""
    return int(1.3 * num_pairs) + 64


def _extra_potentials(model: torch.nn.Module) -> tp.Dict[str, torch.nn.Module]:
    """The model's enabled potentials other than ANI's own, by name."""
    return {k: p for k, p in model.potentials.items() if k != "nnp" and p._enabled}


def _unsupported(model: torch.nn.Module, device: torch.device) -> tp.Optional[Exception]:
    """Why :class:`EnergyForcesStep` cannot evaluate ``model`` on ``device`` (the
    error its constructor raises), or ``None`` if it can."""
    if isinstance(model, torch.jit.ScriptModule) or not is_patched(model):
        return TypeError("EnergyForcesStep needs a model patched by torchani_fast.patch() (eager, not scripted)")
    extra = _extra_potentials(model)
    kept = [k for k, p in extra.items() if not isinstance(p, (FastRepulsionXTB, FastDispersionD3))]
    if kept:
        return NotImplementedError(
            f"EnergyForcesStep evaluates the ANI potential and torchani_fast's repulsion and "
            f"dispersion; this model also has {kept} (evaluate it with model.energies_forces "
            "or the ASE calculator)")
    if extra and device.type != "cpu":
        return NotImplementedError(
            f"EnergyForcesStep on {device.type} supports models with only the ANI "
            f"potential; this model also has {list(extra)} (pair potentials run in the step "
            "on the CPU only; on the GPU use model.energies_forces)")
    nnp = nnp_of(model)
    if not isinstance(nnp.aev_computer, AEVComputer):
        return NotImplementedError(
            "EnergyForcesStep needs torchani_fast's AEV; this model keeps TorchANI's "
            f"({kept_parts(model).get('AEV computer', type(nnp.aev_computer).__name__)})")
    if not isinstance(nnp.neural_networks, (FusedEnsemble, FusedNetworks)):
        return TypeError("EnergyForcesStep needs the fused networks of a patched model")
    return None


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
        require_tensors(species=species, coords=coords, cell=cell, pbc=pbc)
        unsupported = _unsupported(model, coords.device)
        if unsupported is not None:
            raise unsupported
        nnp = nnp_of(model)
        nets = nnp.neural_networks
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
        self.elem = elem
        self.model = model
        # The model's dtype and device as built for (a step refuses to run after .double(), .to()...).
        self._model_kind = self._kind_of(model)
        if max_pairs is None:
            max_pairs = _room(num_pairs)
        if max_pairs <= 0:
            raise ValueError(f"max_pairs must be > 0, got {max_pairs}")
        self.max_pairs = max_pairs
        self.neighborlist = search(model.neighborlist.strategy).to(coords.device)
        # The pair count of the last call (a tensor written by the search; after a
        # CUDA graph replay, the replay's): read by check().
        self.num_pairs = torch.full((), -1, dtype=torch.long, device=coords.device)
        self.networks = nets
        # On the CPU the groups follow each call's geometry, as a model call finds
        # them (layer 1 then skips the neighbour blocks that tiles of atoms lack:
        # 1hz5's networks 37 ms instead of 43 on one thread with fixed groups); a
        # CUDA graph needs them fixed: found once, here, and pinned at each call.
        self.groups = None if host_path(coords) else nets.fixed_groups(elem)
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
        reuses = Workspace.reuses(coords.shape[0] * coords.shape[1], nnp.aev_computer.out_dim, coords.dtype)
        self._workspace = Workspace() if reuses else None
        use_graph = coords.device.type == "cuda" if cuda_graph is None else cuda_graph
        # What a copy is built from (__reduce__): the lock, graph and workspace are not copied.
        self._made_from = (model, species, cell, pbc, dict(max_pairs=max_pairs, cuda_graph=cuda_graph,
                                                           check_every=check_every))
        self._warm_up(coords, use_graph and coords.device.type == "cuda")

    def __reduce__(self):
        """``copy.deepcopy`` and ``pickle``: a new step built from the same model,
        species, cell, pbc and options (and the warm-up geometry), with its own
        lock, buffers and (on CUDA) graph."""
        model, species, cell, pbc, kwargs = self._made_from
        return (_rebuilt_step, (type(self), model, species, self._static_x.detach(), cell, pbc, kwargs))

    @staticmethod
    def _kind_of(model: torch.nn.Module) -> tp.Tuple[torch.dtype, torch.device]:
        energies = model.energy_shifter.self_energies
        return energies.dtype, energies.device

    @staticmethod
    def supports(model: torch.nn.Module, device: tp.Union[str, torch.device] = "cpu") -> bool:
        """Whether a step can be built for ``model`` with inputs on ``device``
        (what the constructor would otherwise refuse: an unpatched or scripted
        model, parts kept TorchANI's, potentials other than repulsion and
        dispersion)."""
        return _unsupported(model, torch.device(device)) is None

    def _eager(self, x: Tensor) -> tp.Tuple[Tensor, Tensor]:
        if self._workspace is None:
            return self._evaluate(x)
        with self._workspace:  # the AEV and its gradient reuse the last call's memory (CPU)
            return self._evaluate(x)

    def _evaluate(self, x: Tensor) -> tp.Tuple[Tensor, Tensor]:
        # The model's own composition (core.ModelCore) on the fixed-capacity list.
        found, self.num_pairs = core.neighbors(self.model, self.elem, x, self.cell, self.pbc, self.max_pairs,
                                               search=self.neighborlist)
        with self.networks.pinned(self.groups):
            energies = self.model._energies_from_neighbors(self.elem, x, found)
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
            kind = self._kind_of(self.model)
            if kind != self._model_kind:
                raise ValueError(
                    f"the model moved to {kind[0]} on {kind[1]} since this step was built for "
                    f"{self._model_kind[0]} on {self._model_kind[1]}: build a new step")
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


def _rebuilt_step(cls, model, species, coords, cell, pbc, kwargs):
    return cls(model, species, coords, cell, pbc, **kwargs)


class GrowingStep:
    """An :class:`EnergyForcesStep` that makes room when a geometry has more pairs than it holds.

    ``step(coords) -> (energies, forces)`` like the step itself, for callers
    that cannot bound the pair count in advance (an MD run that compresses, an
    optimisation): when a call's neighbour list overflows ``max_pairs``, the
    step is rebuilt with 1.3x the pairs found (+64) and the call recomputed, so
    no pair is ever dropped and no error reaches the caller. Non-finite
    coordinates or a singular cell still raise (:meth:`EnergyForcesStep.check`).

    ``cell`` and ``pbc`` are kept by reference: a caller that changes the cell
    in place (a barostat) moves every later call, rebuilt steps included, to
    the new box. So is ``coords``, the input that :meth:`host_call` fills.
    ``step_kwargs`` go to :class:`EnergyForcesStep` (not ``check_every``: every
    call is checked here, at one host read of the count).
    """

    def __init__(self, model: torch.nn.Module, species: Tensor, coords: Tensor,
                 cell: tp.Optional[Tensor] = None, pbc: tp.Optional[Tensor] = None,
                 *, max_pairs: tp.Optional[int] = None, **step_kwargs):
        if "check_every" in step_kwargs:
            raise TypeError("GrowingStep checks every call itself; check_every is not an argument")
        self._inputs = (model, species, cell, pbc)
        self.coords = coords
        self._kwargs = step_kwargs
        self.builds = 0  # steps built: the first, then one per overflow
        self.step = self._build(coords, max_pairs)

    def _build(self, coords: Tensor, max_pairs: tp.Optional[int]) -> EnergyForcesStep:
        model, species, cell, pbc = self._inputs
        step = EnergyForcesStep(model, species, coords, cell, pbc, max_pairs=max_pairs,
                                check_every=0, **self._kwargs)
        self.builds += 1
        return step

    def __call__(self, coords: Tensor) -> tp.Tuple[Tensor, Tensor]:
        energies, forces = self.step(coords)
        num_pairs = int(self.step.num_pairs)
        if num_pairs > self.step.max_pairs:  # a denser geometry: more room, the same call again
            self.step = self._build(coords, _room(num_pairs))
            energies, forces = self.step(coords)
            num_pairs = int(self.step.num_pairs)
        if num_pairs < 0 or num_pairs > self.step.max_pairs:
            self.step.check()  # raises, naming the problem (non-finite coordinates, a singular cell)
        return energies, forces

    def host_call(self, positions: np.ndarray, *, angstrom_per_unit: float = 1.0,
                  energy_per_hartree: float = 1.0) -> tp.Tuple[np.ndarray, np.ndarray]:
        """The call for host positions, in a host program's units (ASE, OpenMM).

        ``positions`` (float64 NumPy, ``coords``' shape or without its molecule
        axis) times ``angstrom_per_unit`` are copied into ``coords`` (on the CPU
        in one NumPy call, nothing allocated); returns energies (M,) times
        ``energy_per_hartree`` and forces (M, A, 3) in that energy per unit of
        length, as float64 NumPy arrays (one device -> host copy off the CPU).
        """
        x = self.coords
        force_unit = energy_per_hartree * angstrom_per_unit
        if x.device.type == "cpu":
            np.multiply(positions, angstrom_per_unit, out=x.numpy(), casting="same_kind")
            energies, forces = (t.numpy() for t in self(x))
        else:
            x.copy_(torch.from_numpy(np.multiply(positions, angstrom_per_unit)))
            energies, forces = self(x)
            flat = torch.cat([energies.reshape(-1), forces.reshape(-1)]).cpu().numpy()
            energies, forces = flat[:energies.numel()], flat[energies.numel():].reshape(forces.shape)
        return (np.multiply(energies, energy_per_hartree, dtype=np.float64),
                np.multiply(forces, force_unit, dtype=np.float64))
