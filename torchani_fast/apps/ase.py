"""ASE calculator for (patched) TorchANI models.

>>> from torchani_fast.models import ANI2x
>>> atoms.calc = ANI2x(dtype=torch.float64).ase()       # or Calculator(model)
>>> atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()

Unlike ``torchani.ase.Calculator``, which runs the model once per property that
ASE asks for, each new geometry is evaluated once: the energy, the forces and
(for periodic systems) the stress come out of one forward and one backward pass
and are all cached, so ``get_potential_energy()`` followed by ``get_forces()``
and ``get_stress()`` costs one evaluation. The species, cell and pbc tensors are
built once and reused while the atoms keep their elements and cell; molecules
(no periodic axis) of an eager patched model run through a
:class:`~torchani_fast.step.GrowingStep` kept for those atoms, whose input
tensor each new geometry is copied into; on a GPU that step is captured in a
CUDA graph and replayed (``cuda_graphs=False`` turns it off; see
:class:`~torchani_fast.step.GraphedSteps`). Results are those of TorchANI's
calculator: eV, eV/Å and eV/Å³.

One calculator may be shared by threads: ASE's calculators keep the atoms and
results of the last call on the object, so every entry point here holds the
calculator's lock from the check of the atoms to the copy of the result (the
calls run one after another, each with its own atoms' numbers). Periodic input
goes through :func:`torchani_fast.validation.check_periodic_work`: ``pbc=True``
with ASE's default zero cell, a singular cell and cells that would make the
neighbour search unbounded (a cell in nm) raise ``ValueError``.
"""
import contextlib
import threading
import typing as tp
import warnings

import numpy as np
import torch
from torch import Tensor

import ase
import ase.units
from ase.calculators.calculator import Calculator as _AseCalculator
from ase.calculators.calculator import PropertyNotImplementedError, all_changes
from ase.stress import full_3x3_to_voigt_6_stress

from .. import core
from ..compat import LEGACY
from ..core import STRESS_KINDS, model_float
from ..validation import check_elements, check_periodic_work
from ..workspace import Workspace

__all__ = ["Calculator", "periodic_cell"]



def periodic_cell(atoms: ase.Atoms) -> np.ndarray:
    """The (3, 3) cell of periodic ``atoms`` as the model takes it, in Å.

    ``atoms.cell.complete()`` fills every zero lattice vector with a unit
    vector, which would turn ASE's default zero cell with ``pbc=True`` into a
    1 Å cube (and a number for water 5 times too low). Only the vectors of
    non-periodic axes are completed here; a zero periodic vector stays zero
    and :func:`~torchani_fast.validation.check_periodic_work` refuses it.
    """
    full = atoms.cell.complete().array.copy()
    periodic = np.asarray(atoms.pbc, dtype=bool)
    full[periodic] = atoms.cell.array[periodic]
    return full


def _same(a, b, tol: float) -> bool:
    """ASE's ``equal(a, b, atol=tol)`` (``np.allclose``, rtol 0) in a few NumPy
    calls: identical bits are equal unless they hold NaN, integer or bool
    arrays that differ are not, float arrays are equal when the largest
    difference is within ``tol``; anything else (NaN, infinities, mixed dtypes)
    goes to ``np.allclose`` itself."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if a.dtype == b.dtype:
        kind = a.dtype.kind
        if a.tobytes() == b.tobytes():
            return kind not in "fc" or not np.isnan(a).any()
        if kind in "biu":
            return False
        if kind == "f":
            largest = np.abs(a - b).max()
            if not np.isnan(largest):  # (inf - x beyond tol: allclose says False too)
                return bool(largest <= tol)
    return bool(np.allclose(a, b, rtol=0, atol=tol))  # NaN, inf - inf


def system_changes(old: tp.Optional[ase.Atoms], new: ase.Atoms, tol: float = 1e-15,
                   excluded: tp.Collection[str] = ()) -> tp.List[str]:
    """What ``ase.calculators.calculator.compare_atoms(old, new, tol, excluded)`` returns.

    ASE compares every array with ``np.allclose``, ~0.2 ms per MD step for a
    ligand (7% of a 2-thread ANI-2x step); this answers the same from one
    ``array_equal`` or one maximum per array.
    """
    if old is None:
        return all_changes[:]
    checked = set(all_changes) - set(excluded)
    changes = []
    if "cell" in checked and not _same(old.cell.array, new.cell.array, tol):
        changes.append("cell")
    if "pbc" in checked and not _same(old.pbc, new.pbc, tol):
        changes.append("pbc")
    checked -= {"cell", "pbc"}
    arrays1, arrays2 = set(old.arrays), set(new.arrays)
    changes += checked & (arrays1 ^ arrays2)
    for prop in checked & arrays1 & arrays2:
        if not _same(old.arrays[prop], new.arrays[prop], tol):
            changes.append(prop)
    return changes


def _steppable(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether non-periodic atoms go through :class:`~torchani_fast.step.GrowingStep`
    (an eager model patched by torchani_fast whose every part the step evaluates)."""
    if LEGACY:
        return False
    from ..step import EnergyForcesStep

    return EnergyForcesStep.supports(model, device)


class _ScriptedArchive:
    """A scripted model in a copied or pickled calculator: its ``torch.jit.save`` archive."""

    def __init__(self, data: bytes):
        self.data = data

    def load(self) -> torch.jit.ScriptModule:
        import io

        return torch.jit.load(io.BytesIO(self.data))


class Calculator(_AseCalculator):
    """ASE calculator that evaluates a TorchANI model once per geometry.

    Parameters
    ----------
    model : torchani.arch.ANI or torch.jit.ScriptModule
        An ANI model with ``periodic_table_index=True``, patched by
        :func:`torchani_fast.patch` (unpatched models work too, at TorchANI's
        speed). Scripted models work. Its dtype (float32 or float64) and device
        (CPU or CUDA) are taken from its first parameter at construction.
    overwrite : bool
        As in TorchANI: wrap the positions of periodic systems into the cell and
        write them back to the ``Atoms`` (image information is lost).
    stress_kind : {"scaling", "fdotr", "numerical"}
        How the stress of periodic systems is computed: "scaling" (default)
        differentiates the energy with respect to a strain of the cell and
        positions; "fdotr" sums pair-vector x pair-force over the neighbour
        list; "numerical" uses central differences of the energy with respect to
        strain (12 extra energy evaluations, with a step suited to the dtype).
        "scaling" and "fdotr" come out of the same backward pass as the forces.
    cuda_graphs : bool
        On a GPU, capture the step of a molecule (no periodic axis) in a CUDA
        graph on its first geometry and replay it for the next ones (default);
        re-captured when the atoms, the pbc or the weights change, or when a
        denser geometry needs a larger neighbour list
        (:class:`~torchani_fast.step.GraphedSteps`). False: always eager.
    **kwargs
        Passed to ``ase.calculators.calculator.Calculator`` (e.g. ``label``).

    Attributes
    ----------
    evaluations : int
        Number of model evaluations (forward + backward) run so far.

    Notes
    -----
    Every evaluation computes ``energy``, ``free_energy`` (the same number),
    ``forces`` and, when any axis is periodic, ``stress`` (Voigt order
    xx, yy, zz, yz, xz, xy), whatever property was asked for. Stress of a
    non-periodic system raises ``PropertyNotImplementedError``.
    """

    implemented_properties = ["energy", "free_energy", "forces", "stress"]

    def __init__(self, model: torch.nn.Module, overwrite: bool = False,
                 stress_kind: str = "scaling", cuda_graphs: bool = True, **kwargs):
        super().__init__(**kwargs)
        if stress_kind not in STRESS_KINDS:
            raise ValueError(f"stress_kind must be one of {STRESS_KINDS}, got {stress_kind!r}")
        self.model = model
        self._overwrite = overwrite
        self._stress_kind = stress_kind
        self.cuda_graphs = bool(cuda_graphs)
        # ASE keeps the last atoms and results on the calculator: one lock spans
        # check_state, calculate and the copy of the result (re-entrant, since
        # get_property calls calculate).
        self._lock = threading.RLock()
        self._directory_made: tp.Optional[str] = None
        self.evaluations = 0
        self._bind()

    # ------------------------------------------------------------ model state
    def _model_key(self) -> tuple:
        """What the cached tensors and step were built from: the model object,
        its dtype and device, and the storage of its first parameter (a new
        one after ``.to()``, ``.double()``...). Weights changed in place
        (``load_state_dict``, an optimizer) need no rebuild: the step and the
        model read them at every call."""
        ref = model_float(self.model)
        return (id(self.model), ref.dtype, ref.device, ref.data_ptr())

    def _bind(self) -> None:
        """(Re)build everything derived from ``self.model``: dtype, device,
        supported elements and the caches of input tensors and step."""
        model = self.model
        if hasattr(model, "periodic_table_index") and not model.periodic_table_index:
            raise ValueError(
                "the ASE calculator needs a model with periodic_table_index=True "
                "(species given as atomic numbers)"
            )
        ref = model_float(model)
        self._bound_model = model  # (kept alive, so its id is not reused while compared)
        self._key = (id(model), ref.dtype, ref.device, ref.data_ptr())
        self._device = ref.device
        self._dtype = ref.dtype
        numbers = getattr(model, "atomic_numbers", None)
        self._supported = None if numbers is None else sorted(int(z) for z in numbers.tolist())
        # Input tensors kept between calls: rebuilt only when what they encode changes.
        self._numbers: tp.Optional[np.ndarray] = None
        self._species: tp.Optional[Tensor] = None
        self._elem_idxs: tp.Optional[Tensor] = None
        self._cell_key: tp.Optional[tuple] = None
        self._cell: tp.Optional[Tensor] = None
        self._pbc: tp.Optional[Tensor] = None
        self._volume = 0.0
        self._workspace = Workspace()  # the CPU ops' outputs reuse the last call's memory
        self._aev_features = int(getattr(getattr(model, "aev_computer", None), "out_dim", 0))
        # Non-periodic atoms of an eager patched model: a GrowingStep for the
        # current species (built on their first geometry, rebuilt when they
        # change; its input tensor is refilled in place), in a CUDA graph on a GPU.
        self._steppable = _steppable(model, self._device)
        self._steps = None
        if self._steppable:
            from ..step import GraphedSteps

            self._steps = GraphedSteps(model, cuda_graphs=getattr(self, "cuda_graphs", True))

    def _check_model(self) -> None:
        """Rebuild the caches if the model was replaced (``calc.model = other``)
        or moved (``.double()``, ``.to(device)``) since they were built; the
        last results no longer hold then either."""
        if self.model is not self._bound_model or self._model_key() != self._key:
            self._bind()
            self.results = {}
            self.atoms = None

    def __getstate__(self) -> dict:
        """The calculator without its lock and caches (rebuilt by ``__setstate__``):
        what ``copy.deepcopy`` and ``pickle`` take, as for TorchANI's calculator."""
        state = self.__dict__.copy()
        for name in ("_lock", "_bound_model", "_key", "_numbers", "_species", "_elem_idxs", "_cell_key",
                     "_cell", "_pbc", "_volume", "_eye", "_workspace", "_aev_features", "_steppable",
                     "_steps", "_device", "_dtype", "_supported"):
            state.pop(name, None)
        if isinstance(self.model, torch.jit.ScriptModule):  # (pickle takes no ScriptModule: its archive)
            import io

            archive = io.BytesIO()
            torch.jit.save(self.model, archive)
            state["model"] = _ScriptedArchive(archive.getvalue())
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if isinstance(self.model, _ScriptedArchive):
            self.model = self.model.load()
        self._lock = threading.RLock()
        self._bind()

    @property
    def _step(self):
        """The current molecule's :class:`~torchani_fast.step.GrowingStep` (None before one)."""
        return None if self._steps is None else self._steps.step

    @property
    def device(self) -> torch.device:
        """The model's device, where the input tensors are built."""
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        """The model's floating-point dtype, in which positions are passed."""
        return self._dtype

    # ------------------------------------------------------------------ inputs
    def _species_tensors(self, numbers: np.ndarray) -> tp.Tuple[Tensor, Tensor]:
        if self._numbers is None or not np.array_equal(numbers, self._numbers):
            if self._supported is not None:
                check_elements(numbers, self._supported, "this model")
            species = torch.tensor(numbers, dtype=torch.long, device=self._device).unsqueeze(0)
            self._elem_idxs = self.model.species_converter(species)
            self._species = species
            self._numbers = numbers.copy()
        return self._species, self._elem_idxs

    def _cell_tensors(self, atoms: ase.Atoms) -> tp.Tuple[tp.Optional[Tensor], tp.Optional[Tensor]]:
        pbc = atoms.pbc
        cell = atoms.cell.array
        key = (tuple(bool(p) for p in pbc), cell.tobytes())
        if key != self._cell_key:
            if pbc.any():
                full = periodic_cell(atoms)
                self._cell = torch.tensor(full, dtype=self._dtype, device=self._device)
                self._pbc = torch.tensor(pbc, dtype=torch.bool, device=self._device)
                self._volume = abs(float(np.linalg.det(full)))
            else:
                self._cell = self._pbc = None
                self._volume = 0.0
            self._cell_key = key
        return self._cell, self._pbc

    # ------------------------------------------------------------- calculation
    def check_state(self, atoms: ase.Atoms, tol: float = 1e-15) -> tp.List[str]:
        """ASE's check (:func:`system_changes`, the answer of ASE's ``compare_atoms``), faster."""
        return system_changes(self.atoms, atoms, tol, self.ignored_changes)

    def get_property(self, name, atoms=None, allow_calculation=True):
        """ASE's ``get_property`` under the calculator's lock (see the module doc)."""
        with self._lock:
            self._check_model()  # (results of another model are not served from the cache)
            return super().get_property(name, atoms, allow_calculation)

    def calculate(self, atoms: tp.Optional[ase.Atoms] = None,
                  properties: tp.Sequence[str] = ("energy",),
                  system_changes: tp.Sequence[str] = tuple(all_changes)) -> None:
        """Evaluate the model once and store energy, forces and (periodic) stress.

        Parameters
        ----------
        atoms : ase.Atoms, optional
            The structure; by default the one last attached.
        properties : sequence of str
            What ASE asks for. Everything is computed anyway; only "stress" of
            a non-periodic system is refused.
        system_changes : sequence of str
            What changed since the last call (ASE's bookkeeping).
        """
        with self._lock:
            self._calculate(atoms, properties, system_changes)

    def _calculate(self, atoms, properties, system_changes) -> None:
        self._check_model()
        if atoms is not None:
            self.atoms = atoms.copy()
        if self._directory_made != self.directory:  # the base's other task (a stat), once per directory
            super().calculate(None, properties, system_changes)
            self._directory_made = self.directory
        if self.atoms is None:
            raise ValueError("the calculator is not attached to any Atoms")
        species, elem_idxs = self._species_tensors(self.atoms.numbers)
        cell, pbc = self._cell_tensors(self.atoms)
        coords = None
        if cell is not None:  # also for unpatched models, whose search has no such check
            coords = self._coords()
            check_periodic_work(species, coords, cell, pbc, float(self.model.cutoff))
        with_stress = cell is not None and self._volume > 0.0
        if "stress" in properties and not with_stress:
            raise PropertyNotImplementedError(
                "stress needs a periodic cell of non-zero volume (set atoms.pbc and atoms.cell)"
            )
        n = len(self.atoms)
        if cell is None and self._steppable:
            flat = self._stepped(species, self.atoms.positions)
        else:
            flat = self._unstepped(self._coords() if coords is None else coords, species, elem_idxs,
                                   cell, pbc, with_stress, atoms)
        self.evaluations += 1
        self.results["energy"] = float(flat[0])
        self.results["free_energy"] = float(flat[0])
        self.results["forces"] = flat[1:1 + 3 * n].reshape(n, 3)
        if with_stress:
            self.results["stress"] = full_3x3_to_voigt_6_stress(flat[1 + 3 * n:].reshape(3, 3))

    def _stepped(self, species: Tensor, positions: np.ndarray) -> np.ndarray:
        """[energy, forces...] in eV and eV/Å of non-periodic atoms, from the
        species' :class:`~torchani_fast.step.GrowingStep` (:class:`~torchani_fast.step.GraphedSteps`):
        the positions are copied into the step's input tensor, Hartree -> eV in float64."""
        # The species' step: built (sized on this geometry) for new atoms, else replayed.
        self._steps.get(self._numbers.tobytes(), lambda: (species, self._coords(), None, None))
        energies, forces = self._steps.host_call(positions, energy_per_hartree=ase.units.Hartree)
        return np.concatenate((energies, forces.reshape(-1)))

    def _coords(self) -> Tensor:
        """The positions as a (1, A, 3) tensor of the model's dtype and device."""
        return torch.tensor(self.atoms.positions, dtype=self._dtype, device=self._device).unsqueeze(0)

    def _unstepped(self, coords: Tensor, species: Tensor, elem_idxs: Tensor, cell: tp.Optional[Tensor],
                   pbc: tp.Optional[Tensor], with_stress: bool, atoms: tp.Optional[ase.Atoms]) -> np.ndarray:
        """[energy, forces..., stress (3x3)...] in eV, eV/Å and eV/Å³ through the
        model's own entry points (periodic atoms, scripted or unpatched models)."""
        if self._overwrite and cell is not None:
            from torchani.utils import map_to_central

            warnings.warn("'overwrite' set, info about crossing PBC *will be lost*")
            coords = map_to_central(coords, cell, pbc)
            wrapped = coords[0].cpu().numpy().astype(np.float64)
            self.atoms.set_positions(wrapped)
            if atoms is not None:  # keep the caller's Atoms equal to the cached copy
                atoms.set_positions(wrapped)
        reuse = Workspace.reuses(coords.shape[1], self._aev_features, self._dtype)
        with torch.enable_grad(), self._workspace if reuse else contextlib.nullcontext():
            energy, forces, virial = core.energies_forces_virial(
                self.model, species, elem_idxs, coords, cell, pbc, self._stress_kind, ase.units.Hartree)
        parts = [energy.detach().reshape(1), forces.reshape(-1)]
        if with_stress:
            parts.append((virial / self._volume).reshape(-1))
        # One device -> host copy for all results.
        return torch.cat(parts).cpu().numpy().astype(np.float64)
