"""The PythonForce side: one :class:`~torchani_fast.EnergyForcesStep` per force.

OpenMM calls a ``PythonForce``'s function with a ``State`` at every force or
energy evaluation and reads back the energy and forces, without units, in
kJ/mol and kJ/mol/nm. :class:`ANIComputation` is that function. Per call it

- reads the positions (nm) once into a NumPy buffer (:class:`_StateReader`),
  wraps periodic ones into the box in float64 (so float32 models keep their
  precision far from the origin), and copies them, in Å, into a tensor kept
  between calls;
- compares the box with the previous call's (nine numbers) and, only when a
  barostat changed it, copies the new cell into the step's cell tensor in place;
- runs the step (on a GPU, a CUDA graph captured at the first call:
  :class:`~torchani_fast.step.GraphedSteps`) and converts Hartree -> kJ/mol
  and Hartree/Å -> kJ/mol/nm, reading the results back in one copy.

No tensor is built per call for the species, cell or pbc. The neighbour list
has a fixed capacity (see :class:`~torchani_fast.EnergyForcesStep`); if a
denser configuration overflows it, the step is rebuilt with more room and the
call recomputed, so no pair is ever dropped silently.
"""
import typing as tp

import numpy as np
import torch

from ... import registry

__all__ = ["ANIComputation", "HARTREE_TO_KJ_PER_MOL", "MODELS", "atomic_numbers_of",
           "create_python_force", "load_model", "resolve_device", "resolve_dtype"]

#: openmm-ml names -> model names (the registry's ``openmm`` column). openmm-ml's own
#: ``ani2x`` and ``ani1ccx`` are not reused: entry points of the same name
#: overwrite each other in load order.
MODELS = registry.openmm_names()


def _hartree_to_kj_per_mol() -> float:
    import torchani.units

    return float(torchani.units.hartree2kjoulemol(1.0))


#: TorchANI's own conversion factor (CODATA), so energies compare exactly.
HARTREE_TO_KJ_PER_MOL = _hartree_to_kj_per_mol()

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def resolve_dtype(dtype: tp.Union[str, torch.dtype, None]) -> torch.dtype:
    """``torch.float32`` (default) or ``torch.float64``, also given as a string."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    if dtype in (torch.float32, torch.float64):
        return dtype
    raise ValueError(f"dtype must be torch.float32 or torch.float64 (or 'float32', 'float64'), got {dtype!r}")


def resolve_device(device: tp.Union[str, torch.device, None]) -> torch.device:
    """The given device, or CUDA when available, else the CPU (openmm-ml's default)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}") from exc




def load_model(name: str, model_index: tp.Optional[int], dtype: torch.dtype,
               device: torch.device) -> torch.nn.Module:
    """The patched model for an openmm-ml name, built once per process and shared.

    Forces share it read-only: each keeps its own :class:`EnergyForcesStep`.
    """
    if name not in MODELS:
        raise ValueError(f"unknown torchani_fast potential {name!r}; known: {sorted(MODELS)}")
    if model_index is not None and (isinstance(model_index, bool) or not isinstance(model_index, int)
                                    or not 0 <= model_index < 8):
        raise ValueError(f"modelIndex must be an ensemble member 0-7 or None, got {model_index!r}")
    from ... import models

    return models.load(MODELS[name], model_index=model_index, dtype=dtype, device=device)


def _describe(atom) -> str:
    residue = atom.residue
    where = f"residue {residue.name} {residue.id}" if residue is not None else "no residue"
    if residue is not None and residue.chain is not None:
        where += f", chain {residue.chain.id}"
    return f"atom {atom.index} ({atom.name!r}, {where})"


def atomic_numbers_of(topology, atoms: tp.Optional[tp.Sequence[int]],
                      supported: tp.Sequence[int], name: str) -> tp.List[int]:
    """Atomic numbers of ``atoms`` (all by default) of an OpenMM ``Topology``.

    Raises
    ------
    ValueError
        Naming the first atom without an element or with one the model lacks,
        an index outside the topology, or an index given twice.
    """
    from ase.data import chemical_symbols

    every = list(topology.atoms())
    if atoms is None:
        chosen = every
    else:
        chosen = []
        seen: tp.Dict[int, int] = {}
        for k, i in enumerate(atoms):
            if not 0 <= int(i) < len(every):
                raise ValueError(f"{name}: atom index {i} is outside the topology ({len(every)} atoms)")
            if int(i) in seen:  # the atom would sit on top of itself: a meaningless energy
                raise ValueError(f"{name}: atom index {i} is given twice (entries {seen[int(i)]} and "
                                 f"{k} of the ML atoms); each atom may appear once")
            seen[int(i)] = k
            chosen.append(every[int(i)])
    if not chosen:
        raise ValueError(f"{name}: no atoms to apply the potential to")
    known = set(int(z) for z in supported)
    numbers = []
    for atom in chosen:
        if atom.element is None:
            raise ValueError(f"{name}: {_describe(atom)} has no element; the ANI models need the "
                             "element of every atom (set it in the Topology, e.g. from a PDB file "
                             "with element columns)")
        z = int(atom.element.atomic_number)
        if z not in known:
            covers = ", ".join(chemical_symbols[k] for k in supported)
            raise ValueError(f"{name}: {_describe(atom)} is {chemical_symbols[z]} (atomic number {z}), "
                             f"which this model does not support; it covers {covers}")
        numbers.append(z)
    return numbers


class _StateReader:
    """Reads a ``State``'s positions (n, 3) and box (3, 3), float64 nm, for every call.

    ``State.getPositions(asNumpy=True).value_in_unit(nanometer)`` costs ~11 us
    per call for 46 atoms (a ``dir()`` of the SWIG object, a new array, a unit
    multiplication and division), as much as the rest of the step's Python. Where
    the State has the method behind it (``_getVectorAsNumpy``: OpenMM 8.x), the
    reader fills one buffer of its own with it instead (~0.4 us; the same
    numbers, in nm); otherwise (another State-like object, or ``fast`` False)
    it takes the public path. The buffer is overwritten by the next call:
    callers copy what they keep.
    """

    def __init__(self, n: int):
        import openmm

        self._kind = openmm.State.Positions
        self.fast = hasattr(openmm.State, "_getVectorAsNumpy")
        self._buffer = np.empty((n, 3), dtype=np.float64)

    def positions(self, state) -> np.ndarray:
        fill = getattr(state, "_getVectorAsNumpy", None) if self.fast else None
        if fill is not None:
            n = state._getNumParticles()
            if n != len(self._buffer):
                raise ValueError(f"the State has {n} positions, the force {len(self._buffer)} atoms")
            fill(self._kind, self._buffer)
            return self._buffer
        from openmm import unit

        pos = np.asarray(state.getPositions(asNumpy=True).value_in_unit(unit.nanometer), dtype=np.float64)
        if pos.shape != self._buffer.shape:
            raise ValueError(f"the State has {pos.shape[0]} positions, the force {len(self._buffer)} atoms")
        return pos

    @staticmethod
    def box(state) -> np.ndarray:
        from openmm import unit

        return np.asarray(state.getPeriodicBoxVectors(asNumpy=True).value_in_unit(unit.nanometer),
                          dtype=np.float64)


class ANIComputation:
    """The function of an ``openmm.PythonForce``: ``state -> (kJ/mol, kJ/mol/nm array)``.

    Parameters
    ----------
    name : str
        One of :data:`MODELS` ("ani2x-fast", "ani1x-fast", "ani1ccx-fast", "ani2xr-fast", "ani2dr-fast").
    atomic_numbers : sequence of int
        Of the force's particles, in the order OpenMM passes them.
    periodic : bool
        Whether the force uses the State's periodic box.
    model_index : int, optional
        One ensemble member (0-7) instead of the ensemble mean.
    dtype : torch.dtype
        Of the model (``torch.float32`` or ``torch.float64``).
    device : torch.device
        Of the model.
    cuda_graphs : bool
        On a GPU, capture the step in a CUDA graph at the first call and replay
        it (default), periodic systems included (a barostat's new box is copied
        into the captured cell); re-captured when the neighbour list needs more
        room (:class:`~torchani_fast.step.GraphedSteps`). False: always eager.

    Notes
    -----
    Pickled (OpenMM's ``XmlSerializer``, ``copy.deepcopy`` of a force), it keeps
    only these arguments: the model and the step are rebuilt at the first call.
    The step is built at the first call too, sized from that geometry.
    """

    def __init__(self, name: str, atomic_numbers: tp.Sequence[int], periodic: bool,
                 model_index: tp.Optional[int] = None, dtype: torch.dtype = torch.float32,
                 device: tp.Union[str, torch.device] = "cpu", cuda_graphs: bool = True):
        self.name = name
        self.atomic_numbers = [int(z) for z in atomic_numbers]
        self.periodic = bool(periodic)
        self.model_index = model_index
        self.dtype = resolve_dtype(dtype)
        self.device = resolve_device(device)
        self.model = load_model(name, model_index, self.dtype, self.device)
        self.cuda_graphs = bool(cuda_graphs)
        self.calls = 0
        from ...step import GraphedSteps

        self._steps = GraphedSteps(self.model, cuda_graphs=self.cuda_graphs)
        self._reader = _StateReader(len(self.atomic_numbers))

    # -------------------------------------------------------------- pickling
    def __getstate__(self) -> dict:
        return {"name": self.name, "atomic_numbers": self.atomic_numbers, "periodic": self.periodic,
                "model_index": self.model_index, "dtype": str(self.dtype).split(".")[-1],
                "device": str(self.device), "cuda_graphs": self.cuda_graphs}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["name"], state["atomic_numbers"], state["periodic"],
                      state["model_index"], state["dtype"], state["device"], state.get("cuda_graphs", True))

    # ------------------------------------------------------------ evaluation
    @property
    def _step(self):
        """The current :class:`~torchani_fast.step.GrowingStep` (None before the first call)."""
        return self._steps.step

    def _inputs(self, pos_nm: np.ndarray):
        """species, coords (Å), cell and pbc of a new step, built on this geometry."""
        species = torch.tensor([self.atomic_numbers], dtype=torch.long, device=self.device)
        self._cell = self._pbc = None
        if self.periodic:
            self._cell = torch.tensor(self._box * 10.0, dtype=self.dtype, device=self.device)
            self._pbc = torch.ones(3, dtype=torch.bool, device=self.device)
        # The step reads the cell tensor at every call (a replayed graph too: the
        # search reads the cell on the device), which _set_box changes in place.
        x = torch.from_numpy(pos_nm * 10.0).to(dtype=self.dtype, device=self.device).unsqueeze(0)
        return species, x, self._cell, self._pbc

    @property
    def rebuilds(self) -> int:
        """Steps built: the first, then one per neighbour-list overflow."""
        return 0 if self._step is None else self._step.builds

    def _set_box(self, box: np.ndarray) -> None:
        self._box = np.array(box, dtype=np.float64)
        self._inv_box = np.linalg.inv(self._box)
        if self._step is not None:
            # The step reads this tensor at every call: an in-place copy moves it
            # to the new box, with nothing else to rebuild.
            self._cell.copy_(torch.from_numpy(self._box * 10.0))

    def __call__(self, state) -> tp.Tuple[float, np.ndarray]:
        try:
            return self._evaluate(state)
        except (ValueError, RuntimeError) as exc:  # OpenMM shows only the text: say whose it is
            if str(exc).startswith(self.name + ": "):
                raise
            raise type(exc)(f"{self.name}: {exc}") from exc

    def _evaluate(self, state) -> tp.Tuple[float, np.ndarray]:
        pos = self._reader.positions(state)
        if self.periodic:
            box = self._reader.box(state)
            if self._step is None or not np.array_equal(box, self._box):
                self._set_box(box)
            # Into the box, in float64: OpenMM's positions drift far from the origin.
            pos = pos - np.floor(pos @ self._inv_box) @ self._box
        # Built (sized and warmed up, captured on a GPU) on the first geometry, else replayed.
        self._steps.get(self.periodic, lambda: self._inputs(pos))
        # nm in, kJ/mol and kJ/mol/nm out (rebuilt with more room if the list overflowed)
        energies, forces = self._steps.host_call(pos, angstrom_per_unit=10.0,
                                                energy_per_hartree=HARTREE_TO_KJ_PER_MOL)
        self.calls += 1
        return float(energies[0]), forces[0]


def create_python_force(name: str, topology, atoms: tp.Optional[tp.Sequence[int]] = None, *,
                        periodic: tp.Optional[bool] = None, force_group: int = 0,
                        model_index: tp.Optional[int] = None,
                        dtype: tp.Union[str, torch.dtype, None] = None,
                        device: tp.Union[str, torch.device, None] = None, cuda_graphs: bool = True):
    """An ``openmm.PythonForce`` computing a torchani_fast model on ``atoms`` of ``topology``.

    Parameters
    ----------
    name : str
        One of :data:`MODELS`.
    topology : openmm.app.Topology
        Gives the elements (every atom of the force must have one the model covers).
    atoms : sequence of int, optional
        The particles the force applies to (``PythonForce.setParticles``); all by default.
    periodic : bool, optional
        Default: whether the topology has a periodic box.
    force_group : int
        The OpenMM force group (0-31).
    model_index, dtype, device
        As for :class:`ANIComputation` (dtype default float32; device default
        CUDA if available, else CPU).
    cuda_graphs : bool
        As for :class:`ANIComputation`: on a GPU, capture the step in a CUDA
        graph (default); False runs it eagerly.

    Returns
    -------
    openmm.PythonForce
    """
    import openmm

    dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    model = load_model(name, model_index, dtype, device)
    numbers = atomic_numbers_of(topology, atoms, model.atomic_numbers.tolist(), name)
    if periodic is None:
        periodic = topology.getPeriodicBoxVectors() is not None
    compute = ANIComputation(name, numbers, periodic, model_index, dtype, device, cuda_graphs)
    force = openmm.PythonForce(compute)
    force.setName(f"torchani_fast {name}")
    force.setForceGroup(int(force_group))
    force.setUsesPeriodicBoundaryConditions(bool(periodic))
    if atoms is not None:
        force.setParticles([int(i) for i in atoms])
    return force
