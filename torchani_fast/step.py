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
and replayed. There, for a model of the ANI potential alone, the step applies
the chain rule itself: the networks op returns the energy's gradient with
respect to the AEVs with the energies, and the forces are that gradient through
the AEV's and the pair vectors' backward ops (13 kernels and 5 other launches
for a 46-atom ANI-2x step; the same bits as autograd). Each call then checks
the pair count (one sync, ~10 us), which
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
from torchani.potentials import NNPotential

from . import core, ops
from ._device_paths import host_path
from .aev import AEVComputer, NeighborList, Neighbors
from .core import Workspace, forces_of, require_tensors
from .nn import FusedEnsemble, FusedNetworks
from .patch import is_patched, kept_parts, nnp_of
from .potentials import FastDispersionD3, FastRepulsionXTB, UnboundedNeighborList
from .validation import check_periodic_work

__all__ = ["EnergyForcesStep", "GraphedSteps", "GrowingStep"]


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
        # The device path's chain rule by hand (_energies_forces_by_hand) serves
        # models with the ANI potential alone (energies: networks + self energies;
        # not ANImbis' charges); its self energies, and their version.
        self._ani_only = (isinstance(model, core.ModelCore) and type(nnp) is NNPotential and nnp._enabled
                          and not _extra_potentials(model))
        self._shift: tp.Optional[Tensor] = None
        self._shift_version: tp.Optional[tp.Tuple[int, bool]] = None
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
        weights = self._chain_rule(x)
        if weights is not None:
            return self._energies_forces_by_hand(x, found, weights)
        with self.networks.pinned(self.groups):
            energies = self.model._energies_from_neighbors(self.elem, x, found)
        return energies.detach(), forces_of(energies, x)

    def _chain_rule(self, x: Tensor) -> tp.Optional[tuple]:
        """The ensemble_dense weights (last layer negated) with which this call takes the
        device path's chain rule by hand (:meth:`_energies_forces_by_hand`), or None:
        the ANI potential alone, its networks the ensemble_dense op, with the members'
        mean folded into it exactly."""
        if not (self._ani_only and x.dtype == self._model_kind[0] and self.networks.dense_serves(x)):
            return None
        weights = self.networks.dense_weights(negate=True)
        return weights[:3] if weights[3] == 1 else None

    def _energies_forces_by_hand(self, x: Tensor, found: Neighbors, weights: tuple) -> tp.Tuple[Tensor, Tensor]:
        """Energies and forces of the ANI potential as the model composes them, with
        the chain rule applied here rather than by autograd (the device path).

        The networks op returns the gradient of the atoms' values with respect to
        their AEVs with the values (its weights' last layer negated and divided by
        the members: exact), so forces are that gradient through the AEV's
        backward (with the forward's edges) and the pair vectors' backward: no
        seed, sum, product or negation. The self energies of the fixed species
        are one tensor (:meth:`_self_energies`). Energies and forces are those of
        the autograd path to the bit.
        """
        nnp = nnp_of(self.model)
        diff = found.diff_vectors.detach()  # (one tensor: the AEV's edges are kept for it)
        consts = nnp.aev_computer.op_constants()
        with torch.no_grad():
            aevs, edges = ops.aev_with_edges(self.elem, found.indices, diff, *consts)
            neg_values, neg_grad = ops.ensemble_dense_jacobian(aevs.flatten(0, 1), self.elem.flatten(), *weights,
                                                               self.networks.activation)
            energies = torch.sub(self._self_energies(), neg_values.view(self.elem.shape).sum(1))
            neg_grad_diff = ops.aev_backward_edges(neg_grad.view(aevs.shape), edges, self.elem, found.indices,
                                                   diff, *consts)
        (forces,) = torch.autograd.grad(found.diff_vectors, x, neg_grad_diff)  # (the pair vectors' backward)
        return energies, forces

    def _self_energies(self) -> Tensor:
        """The model's self energies of the step's species, (M,): computed again
        only when they changed in place (their version counter), into the same
        tensor, so that a captured graph reads the new values."""
        shifter = self.model.energy_shifter
        version = (shifter.self_energies._version, shifter._enabled)
        if version != self._shift_version:
            with torch.no_grad():
                shift = self.model._shifted(self.elem.new_zeros(self.elem.shape[0], dtype=self.dtype),
                                            self.elem, False)
            if self._shift is None:
                self._shift = shift
            else:
                self._shift.copy_(shift)
            self._shift_version = version
        return self._shift

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
                if self._shift is not None:
                    self._self_energies()  # (refreshed if changed in place)
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
        return self._settled(coords, energies, forces, int(self.step.num_pairs))

    def _settled(self, coords: Tensor, energies: Tensor, forces: Tensor,
                 num_pairs: int) -> tp.Tuple[Tensor, Tensor]:
        """The call's results, given its pair count read on the host: recomputed
        by a step with room if the list overflowed; raises for bad input."""
        if num_pairs > self.step.max_pairs:  # a denser geometry: more room, the same call again
            self.step = self._build(coords, _room(num_pairs))
            energies, forces = self.step(coords)
            num_pairs = int(self.step.num_pairs)
        if num_pairs < 0 or num_pairs > self.step.max_pairs:
            self.step.check()  # raises, naming the problem (non-finite coordinates, a singular cell)
        return energies, forces

    @staticmethod
    def _to_host(num_pairs: Tensor, energies: Tensor, forces: Tensor) -> Tensor:
        """[pair count, energies..., forces...] as one float64 host tensor (one copy)."""
        return torch.cat([num_pairs.reshape(1).double(), energies.reshape(-1).double(),
                          forces.reshape(-1).double()]).cpu()

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
        if host_path(x):
            np.multiply(positions, angstrom_per_unit, out=x.numpy(), casting="same_kind")
            energies, forces = (t.numpy() for t in self(x))
        else:
            x.copy_(torch.from_numpy(np.multiply(positions, angstrom_per_unit)))
            energies, forces = self.step(x)
            # The pair count travels with the results: one device -> host copy
            # (float64 holds any count exactly), then the count is checked here.
            flat = self._to_host(self.step.num_pairs, energies, forces)
            if not 0 <= int(flat[0]) <= self.step.max_pairs:  # (rare: more room, or an error)
                energies, forces = self._settled(x, energies, forces, int(flat[0]))
                flat = self._to_host(self.step.num_pairs, energies, forces)
            m = energies.numel()
            energies, forces = flat[1:1 + m].numpy(), flat[1 + m:].numpy().reshape(forces.shape)
        return (np.multiply(energies, energy_per_hartree, dtype=np.float64),
                np.multiply(forces, force_unit, dtype=np.float64))


class GraphedSteps:
    """The step of a front end's current system, captured in a CUDA graph on first use.

    The ASE calculator, the OpenMM force and ``torchani-fast md`` evaluate one
    system call after call. This object keeps a :class:`GrowingStep` for the
    system it last saw, keyed by what the caller says identifies it (the
    species and pbc, as host values: no device read), and decides per call:

    - **capture** (a new step in a CUDA graph) on the first call of a system,
      when ``cuda_graphs`` is on and the inputs are on a GPU;
    - **replay** while the key is the same; the positions (and, through the
      caller's cell tensor, a changed box) are copied into the step's static
      inputs;
    - **re-capture** when the key changes (other atoms, other pbc), when the
      model's weights changed in place (the graph replays the weights it
      captured; the networks' pack epoch says when), or when a denser geometry
      overflows the neighbour list's capacity (:class:`GrowingStep`: more room,
      the call recomputed);
    - **eager** (no graph) when ``cuda_graphs`` is off, on the CPU, after a
      capture failed (a warning says why), or once a system's capacity has
      overflowed ``max_recaptures`` times (each capture costs more than the
      calls it speeds up then).

    ``events`` lists the decisions, oldest first, as ``(action, reason)``
    (the last 100). The decisions follow :func:`torchani_fast._device_paths.host_path`,
    so the test suite exercises them on the CPU with ``_device_paths.on_cpu()``:
    the steps then run eagerly where a GPU would capture.
    """

    MAX_EVENTS = 100

    def __init__(self, model: torch.nn.Module, cuda_graphs: bool = True, max_recaptures: int = 4):
        self.model = model
        self.cuda_graphs = bool(cuda_graphs)
        self.max_recaptures = max_recaptures
        self.events: tp.List[tp.Tuple[str, str]] = []
        self.step: tp.Optional[GrowingStep] = None
        self._key: tp.Optional[tuple] = None
        self._graphed = False  # whether self.step captures
        self._captures = 0  # captures of the current system (the first, then one per overflow)
        self._failed: tp.Optional[str] = None  # why capture failed (then eager from there on)
        self._eager_keys: tp.Set[tp.Hashable] = set()  # systems that overflowed too often

    def _log(self, action: str, reason: str) -> None:
        self.events.append((action, reason))
        del self.events[:-self.MAX_EVENTS]

    def wants_graph(self) -> bool:
        """Whether a new step would be captured (graphs on, the model on a GPU, no failed capture)."""
        return self.cuda_graphs and not host_path(core.model_float(self.model)) and self._failed is None

    def _weights(self) -> int:
        """The networks' pack epoch (-1: packs built at every call, inside the graph too)."""
        epoch = getattr(nnp_of(self.model).neural_networks, "_weights_epoch", None)
        return -1 if epoch is None else int(epoch())

    def get(self, system: tp.Hashable,
            inputs: tp.Callable[[], tp.Tuple[Tensor, Tensor, tp.Optional[Tensor], tp.Optional[Tensor]]]
            ) -> GrowingStep:
        """The step for ``system`` (a host key: the species and pbc); if there is
        none for it yet, or the one there is must be re-captured, one built from
        ``inputs()``: species, coords (a geometry; the tensor the step's calls
        are copied into), cell and pbc (kept by reference: a cell changed in
        place moves every later call, replays included, to the new box)."""
        graph = self.wants_graph() and system not in self._eager_keys
        key = (system, self._weights() if graph else None)
        if self.step is not None and key == self._key and graph == self._graphed:
            return self.step  # replay (or the eager step)
        if self.step is None or self._key is None:
            reason = "first use"
        elif system != self._key[0]:
            reason = "the species or pbc changed"
        elif graph != self._graphed:
            reason = "graphs turned " + ("on" if graph else "off")
        else:
            reason = "the weights changed in place"
        self._key, self._graphed, self._captures = key, graph, 1
        self.step = self._build(*inputs(), graph, reason)
        if self._graphed:  # (the epoch as the capture left it: building packs may move it)
            self._key = (system, self._weights())
        return self.step

    def _build(self, species: Tensor, coords: Tensor, cell: tp.Optional[Tensor], pbc: tp.Optional[Tensor],
               graph: bool, reason: str) -> GrowingStep:
        if not graph:
            self._log("eager", reason)
            return GrowingStep(self.model, species, coords, cell, pbc, cuda_graph=False)
        try:
            step = GrowingStep(self.model, species, coords, cell, pbc, cuda_graph=True)
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            if "capture" not in str(exc).lower() and "graph" not in str(exc).lower():
                raise  # bad input: the eager step would raise the same
            import warnings

            self._failed = str(exc)
            warnings.warn(f"torchani_fast: CUDA graph capture failed ({exc}); running eagerly "
                          "(pass cuda_graphs=False to skip the attempt)")
            self._graphed = False
            self._key = (self._key[0], None)
            self._log("eager", "capture failed")
            return GrowingStep(self.model, species, coords, cell, pbc, cuda_graph=False)
        self._log("capture", reason)
        return step

    def host_call(self, positions: np.ndarray, **units) -> tp.Tuple[np.ndarray, np.ndarray]:
        """:meth:`GrowingStep.host_call` of the current step, noting re-captures on overflow
        (and going eager for this system after ``max_recaptures``)."""
        step = self.step
        assert step is not None, "GraphedSteps.get first"
        builds = step.builds
        out = step.host_call(positions, **units)
        if step.builds != builds:
            if not self._graphed:
                self._log("eager", "the neighbour list overflowed: more room")
            elif self._captures < self.max_recaptures:
                self._captures += 1
                self._log("capture", "the neighbour list overflowed: more room")
            else:
                system = self._key[0]
                self._eager_keys.add(system)
                self._log("eager", "the neighbour list overflowed {} times".format(self._captures))
                model, species, cell, pbc = step._inputs
                self.step = GrowingStep(model, species, step.coords, cell, pbc,
                                        max_pairs=step.step.max_pairs, cuda_graph=False)
                self._key, self._graphed = (system, None), False
        return out
