"""The evaluation core: how a patched model's energy is composed, for every front end.

A patched model's energy is composed in one place, :class:`ModelCore`'s
``_energies_from_neighbors`` (``ModelCoreQ`` for models with charges): the
potentials of ``model.potentials`` (the ANI network potential — AEV and fused
networks — and the pair potentials) evaluated on the model's one neighbour list,
summed in their order, plus the self energies. TorchScript compiles it into the
patched class (it is a mixin, :mod:`torchani_fast.mixins`), and every entry point
reaches it:

- the model's ``forward`` (overridden here: TorchANI's checks, conversion and
  search, with the value checks folded into one host read on a GPU, then the
  composition without a second check), hence ``atomic_energies``,
  ``energies_qbcs``... (TorchANI's methods, which call it), and
  ``compute_from_neighbors`` (overridden too: checks a given list, then composes);
- :func:`energies_forces` (``model.energies_forces``, the command line,
  screening), :func:`energies_forces_virial` (ASE stress by strain),
  :func:`local_energies` (atoms among ghosts: LAMMPS), and the Hessians of
  :mod:`torchani_fast.grad` (its energies and forces from the model, its
  neighbours from :func:`neighbors`);
- :class:`~torchani_fast.step.EnergyForcesStep` (ASE molecules, OpenMM, MD and
  optimisation loops), which hands it a fixed-capacity neighbour list
  (:func:`neighbors`) and, on CUDA, fixed element groups (no host synchronisation).

The neighbours come from :func:`neighbors` (the exact list, or a fixed-capacity
padded one). Besides, this module holds the helpers the front ends share: the
model's dtype and device (:func:`model_float`), the tensor check of inputs
(:func:`require_tensors`), ``-dE/dx`` (:func:`forces_of`) and the
:class:`Workspace`. It imports no front end.
"""
import typing as tp

import torch
from torch import Tensor
from torchani.neighbors import Neighbors, discard_outside_cutoff
from torchani.tuples import EnergiesScalars, SpeciesEnergies, SpeciesEnergiesAtomicCharges

from ._device_paths import host_path
from .potentials import runs_op
from .validation import cell_status, check_neighbors, input_values_status
from .workspace import Workspace

__all__ = ["EnergiesForces", "EnergiesForcesHessians", "ModelCore", "ModelCoreQ", "Workspace",
           "energies_forces", "energies_forces_virial", "forces_of",
           "local_energies", "model_float", "neighbors", "numerical_virial", "require_tensors"]


class EnergiesForces(tp.NamedTuple):
    """Energies (M,) in Hartree and forces (M, A, 3) in Hartree/Å, detached."""

    energies: Tensor
    forces: Tensor


class EnergiesForcesHessians(tp.NamedTuple):
    """Energies (M,), forces (M, A, 3) and Hessians (M, 3A, 3A), in Ha and Å, detached."""

    energies: Tensor
    forces: Tensor
    hessians: Tensor


# -- the composition ------------------------------------------------------------------------
# TorchANI's ANI.compute_from_neighbors copies the model's neighbour list once per
# potential, keeping the pairs within that potential's cutoff (discard_outside_cutoff:
# a nonzero over all pairs and three index_selects, and their backward). torchani_fast's
# AEV and its pair-potential ops skip the pairs beyond their own cutoff themselves, so
# the patched model hands them the list as it is; any other potential still gets its copy.


class _CoreBase:
    """What :class:`ModelCore` and :class:`ModelCoreQ` share."""

    def _checked_neighbors(self, species: Tensor, coords: Tensor, cell: tp.Optional[Tensor],
                           pbc: tp.Optional[Tensor], charge: int,
                           molecule_idxs: tp.Optional[Tensor]) -> tp.Tuple[Tensor, Neighbors]:
        """The element indices of checked inputs and the model's neighbour list: what
        ``forward`` does before the composition (TorchANI's checks, conversion and search).

        On the device path (GPUs; not traced, finite cutoff) the checks of values
        (coordinates, species, cell) stay on the device as one status, which the
        neighbour list reads back with its pair count: one host read per call. If
        that status says something is wrong, the checks below run and word the error.
        """
        # (Nested: TorchScript resolves a hasattr that is a whole condition when it
        # compiles; a model whose parts are TorchANI's takes the checks below.)
        if hasattr(self.species_converter, "converted"):
            if hasattr(self.neighborlist, "checked"):
                if isinstance(coords, Tensor) and not host_path(coords) and not torch.compiler.is_compiling() \
                        and self.cutoff != float("inf"):  # (not a tensor: the checks below name it)
                    self._check_inputs(species, coords, charge, False)  # (reads no data)
                    elem_idxs, bad = self.species_converter.converted(species, not self.periodic_table_index)
                    bad = bad | input_values_status(species, coords)
                    bad_cell = cell_status(species, coords, cell, pbc, float(self.cutoff))
                    if bad_cell is not None:
                        bad = bad | bad_cell
                    found, ok = self.neighborlist.checked(self.cutoff, elem_idxs, coords, cell, pbc, bad)
                    if ok:
                        return elem_idxs, _within_molecules(found, coords, molecule_idxs)
        self._check_inputs(species, coords, charge)
        elem_idxs = self.species_converter(species, nop=not self.periodic_table_index)
        found = self.neighborlist(self.cutoff, elem_idxs, coords, cell, pbc)
        return elem_idxs, _within_molecules(found, coords, molecule_idxs)

    def _neighbors_per_potential(self, neighbors: Neighbors) -> tp.List[Neighbors]:
        """The list each potential of ``self.potentials`` reads, in their order."""
        out: tp.List[Neighbors] = []
        for pot in self.potentials.values():
            whole = not pot._enabled  # (not evaluated: no copy)
            if hasattr(pot, "fast_cutoff_kind"):  # FastRepulsionXTB / FastDispersionD3
                whole = whole or runs_op(pot.fast_cutoff_kind, neighbors)
            if hasattr(pot, "aev_computer"):
                if hasattr(pot.aev_computer, "cutoff_kind"):  # torchani_fast's AEVComputer
                    whole = True
            out.append(neighbors if whole else discard_outside_cutoff(neighbors, pot.cutoff))
        return out

    def _zero_energies(self, coords: Tensor, molecules: int, atomic: bool, ensemble_values: bool) -> Tensor:
        """Zeros of the output's shape (TorchANI's start)."""
        energies = coords.new_zeros(molecules)
        if atomic:
            energies = energies.unsqueeze(1)
        if ensemble_values:
            energies = energies.unsqueeze(0)
        return energies

    def _shifted(self, energies: Tensor, elem_idxs: Tensor, atomic: bool) -> Tensor:
        if self.energy_shifter._enabled:
            energies = energies + self.energy_shifter(elem_idxs, atomic=atomic)
        return energies


def _within_molecules(neighbors: Neighbors, coords: Tensor, molecule_idxs: tp.Optional[Tensor]) -> Neighbors:
    """The pairs whose atoms share a molecule index (TorchANI's experimental
    ``_molecule_idxs`` (A,) of one structure); all of them if None."""
    if molecule_idxs is None:
        return neighbors
    if coords.shape[0] != 1:
        raise ValueError("_molecule_idxs needs one structure (coords of shape (1, atoms, 3)), got {}".format(
            list(coords.shape)))
    if molecule_idxs.shape != (coords.shape[1],):
        raise ValueError("_molecule_idxs must have shape ({},), one index per atom, got {}".format(
            coords.shape[1], list(molecule_idxs.shape)))
    keep = (molecule_idxs[neighbors.indices[0]] == molecule_idxs[neighbors.indices[1]]).nonzero().view(-1)
    return Neighbors(neighbors.indices.index_select(1, keep), neighbors.distances.index_select(0, keep),
                     neighbors.diff_vectors.index_select(0, keep))


class ModelCore(_CoreBase):
    """Mixin of patched ``ANI`` models: the one composition of their energy.

    ``compute_from_neighbors`` is TorchANI's (the same in 2.7-2.9): the inputs
    and the neighbour list checked, then :meth:`_energies_from_neighbors`.
    ``forward`` is TorchANI's too, its inputs checked and its neighbours found
    by :meth:`_checked_neighbors` (one host read on a GPU), then composed.
    """

    @torch.jit.export
    def compute_from_neighbors(
        self,
        elem_idxs: Tensor,
        coords: Tensor,
        neighbors: Neighbors,
        charge: int = 0,
        atomic: bool = False,
        ensemble_values: bool = False,
    ) -> EnergiesScalars:
        self._check_inputs(elem_idxs, coords, charge)
        check_neighbors(elem_idxs, neighbors)
        return EnergiesScalars(self._energies_from_neighbors(elem_idxs, coords, neighbors, charge, atomic,
                                                             ensemble_values))

    def forward(
        self,
        species_coordinates: tp.Tuple[Tensor, Tensor],
        cell: tp.Optional[Tensor] = None,
        pbc: tp.Optional[Tensor] = None,
        charge: int = 0,
        atomic: bool = False,
        ensemble_values: bool = False,
        _molecule_idxs: tp.Optional[Tensor] = None,
    ) -> SpeciesEnergies:
        """TorchANI's ``ANI.forward``: the element indices and the energies (Hartree)."""
        species, coords = species_coordinates
        elem_idxs, neighbors = self._checked_neighbors(species, coords, cell, pbc, charge, _molecule_idxs)
        return SpeciesEnergies(elem_idxs, self._energies_from_neighbors(elem_idxs, coords, neighbors, charge,
                                                                        atomic, ensemble_values))

    @torch.jit.export
    def local_atomic_energies(self, elem_idxs: Tensor, coords: Tensor, neighbors: Neighbors,
                              num_local: int) -> Tensor:
        """Atomic energies (M, A) in Hartree of which the first ``num_local`` atoms
        of each row are exact: the others (a domain's ghost atoms) only take part
        as neighbours; their networks are not evaluated and their entries are not
        their energies. Pair potentials share each pair's energy half and half."""
        self._check_inputs(elem_idxs, coords, 0)
        check_neighbors(elem_idxs, neighbors)
        return self._energies_from_neighbors(elem_idxs, coords, neighbors, 0, True, False, num_local)

    def _energies_from_neighbors(
        self,
        elem_idxs: Tensor,
        coords: Tensor,
        neighbors: Neighbors,
        charge: int = 0,
        atomic: bool = False,
        ensemble_values: bool = False,
        num_local: int = -1,
    ) -> Tensor:
        """Energies in Hartree, (M,) (``atomic``: (M, A); ``ensemble_values``: a
        member axis first) of checked inputs: every enabled potential on its list,
        in order, then the self energies. ``num_local`` >= 0 (atomic energies
        only): the networks run on the first ``num_local`` atoms of each row alone
        (:meth:`local_atomic_energies`)."""
        # The first potential's energies start the sum (TorchANI starts from zeros: the
        # same values and shape, two launches fewer on a GPU).
        energies: tp.Optional[Tensor] = None
        lists = self._neighbors_per_potential(neighbors)
        k = 0
        for pot in self.potentials.values():
            if pot._enabled:
                term: tp.Optional[Tensor] = None
                if num_local >= 0:
                    # The AEVs of every atom (a local atom's reads its ghost neighbours),
                    # the fused networks of the local atoms alone. (Nested: TorchScript
                    # resolves a hasattr that is a whole condition when it compiles.)
                    if hasattr(pot, "neural_networks"):
                        if hasattr(pot.neural_networks, "local_atomic"):
                            aevs = pot.aev_computer.compute_from_neighbors(elem_idxs, coords, lists[k])
                            term = pot.neural_networks.local_atomic(elem_idxs, aevs, num_local)
                if term is None:
                    term = pot.compute_from_neighbors(elem_idxs, coords, lists[k], charge, atomic,
                                                      ensemble_values).energies
                energies = term if energies is None else energies + term
            k += 1
        if energies is None:
            energies = self._zero_energies(coords, elem_idxs.shape[0], atomic, ensemble_values)
        elif ensemble_values and energies.dim() == (2 if atomic else 1):
            energies = energies.unsqueeze(0)  # (no member axis from any potential: zeros' shape)
        return self._shifted(energies, elem_idxs, atomic)


class ModelCoreQ(_CoreBase):
    """Mixin of patched ``ANIq`` models (ANImbis): :class:`ModelCore` with atomic charges."""

    @torch.jit.export
    def compute_from_neighbors(
        self,
        elem_idxs: Tensor,
        coords: Tensor,
        neighbors: Neighbors,
        charge: int = 0,
        atomic: bool = False,
        ensemble_values: bool = False,
    ) -> EnergiesScalars:
        self._check_inputs(elem_idxs, coords, charge)
        check_neighbors(elem_idxs, neighbors)
        energies, qs = self._energies_charges_from_neighbors(elem_idxs, coords, neighbors, charge, atomic,
                                                             ensemble_values)
        return EnergiesScalars(energies, qs)

    def forward(
        self,
        species_coordinates: tp.Tuple[Tensor, Tensor],
        cell: tp.Optional[Tensor] = None,
        pbc: tp.Optional[Tensor] = None,
        charge: int = 0,
        atomic: bool = False,
        ensemble_values: bool = False,
        _molecule_idxs: tp.Optional[Tensor] = None,
    ) -> SpeciesEnergiesAtomicCharges:
        """TorchANI's ``ANIq.forward``: the element indices, energies (Hartree) and atomic charges."""
        species, coords = species_coordinates
        elem_idxs, neighbors = self._checked_neighbors(species, coords, cell, pbc, charge, _molecule_idxs)
        energies, qs = self._energies_charges_from_neighbors(elem_idxs, coords, neighbors, charge, atomic,
                                                             ensemble_values)
        return SpeciesEnergiesAtomicCharges(elem_idxs, energies, qs)

    @torch.jit.export
    def local_atomic_energies(self, elem_idxs: Tensor, coords: Tensor, neighbors: Neighbors,
                              num_local: int) -> Tensor:
        """:meth:`ModelCore.local_atomic_energies` (here every atom's networks run:
        the charge networks' output is per molecule)."""
        self._check_inputs(elem_idxs, coords, 0)
        check_neighbors(elem_idxs, neighbors)
        return self._energies_from_neighbors(elem_idxs, coords, neighbors, 0, True, False, num_local)

    def _energies_from_neighbors(
        self,
        elem_idxs: Tensor,
        coords: Tensor,
        neighbors: Neighbors,
        charge: int = 0,
        atomic: bool = False,
        ensemble_values: bool = False,
        num_local: int = -1,
    ) -> Tensor:
        """:meth:`ModelCore._energies_from_neighbors` (the charges dropped; every
        atom's networks run whatever ``num_local``)."""
        return self._energies_charges_from_neighbors(elem_idxs, coords, neighbors, charge, atomic,
                                                     ensemble_values)[0]

    def _energies_charges_from_neighbors(
        self,
        elem_idxs: Tensor,
        coords: Tensor,
        neighbors: Neighbors,
        charge: int = 0,
        atomic: bool = False,
        ensemble_values: bool = False,
    ) -> tp.Tuple[Tensor, Tensor]:
        """Energies as :meth:`ModelCore._energies_from_neighbors`, and the network
        potential's atomic charges (M, A)."""
        energies = self._zero_energies(coords, elem_idxs.shape[0], atomic, ensemble_values)
        qs = coords.new_zeros(elem_idxs.shape)  # atomic charges
        if ensemble_values:
            qs = energies.unsqueeze(0)  # (as TorchANI has it)
        lists = self._neighbors_per_potential(neighbors)
        k = 0
        for name, pot in self.potentials.items():
            if pot._enabled:
                e, q = pot.compute_from_neighbors(elem_idxs, coords, lists[k], charge, atomic, ensemble_values)
                energies = energies + e
                if name == "nnp":
                    assert q is not None
                    qs = qs + q
            k += 1
        return self._shifted(energies, elem_idxs, atomic), qs


# -- eager drivers ----------------------------------------------------------------------------


def model_float(model: torch.nn.Module) -> Tensor:
    """The first floating-point parameter (or buffer) of ``model``: its dtype and device."""
    for t in model.parameters():
        return t
    for t in model.buffers():
        if t.is_floating_point():
            return t
    raise ValueError("the model has no floating-point parameters or buffers to take a dtype from")


def require_tensors(**named) -> None:
    """TypeError naming the first argument that is not a tensor (None allowed)."""
    for name, value in named.items():
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor, got {type(value).__module__}.{type(value).__name__}; "
                f"convert it explicitly, e.g. torch.as_tensor({name})")


def forces_of(energies: Tensor, x: Tensor) -> Tensor:
    """-dE/dx; zeros where the energies do not depend on ``x`` (a batch of
    padding only: every energy is 0 and autograd has nothing to differentiate)."""
    if not energies.requires_grad:
        return torch.zeros_like(x)
    (grad,) = torch.autograd.grad(energies.sum(), x, allow_unused=True)
    return torch.zeros_like(x) if grad is None else -grad


def neighbors(model: torch.nn.Module, elem_idxs: Tensor, coords: Tensor, cell: tp.Optional[Tensor],
              pbc: tp.Optional[Tensor], max_pairs: tp.Optional[int] = None,
              search: tp.Optional[torch.nn.Module] = None) -> tp.Tuple[Neighbors, tp.Optional[Tensor]]:
    """The neighbour list the composition reads, at the model's cutoff.

    With ``max_pairs`` None, the exact list (the model's own search) and None;
    otherwise a list of ``max_pairs`` slots and its pair count as a tensor (no
    host synchronisation; read it with ``ops.check_num_pairs``), from ``search``
    (a neighbour list module of the model's kind; the model's own by default).
    """
    nl = model.neighborlist if search is None else search
    if max_pairs is None:
        return nl(model.cutoff, elem_idxs, coords, cell, pbc), None
    return nl.padded(float(model.cutoff), elem_idxs, coords, cell, pbc, max_pairs)


def prepare(model, species, coords: Tensor, cell, pbc):
    """The inputs as the model takes them: a fresh leaf of ``coords`` (requires grad)
    and ``cell``/``pbc`` in the model's dtype and on its device."""
    require_tensors(species=species, coords=coords, cell=cell, pbc=pbc)
    ref = model_float(model)
    # A fresh leaf: detach() gives a new tensor object, so setting requires_grad
    # on it never touches the caller's tensor; .to() is a no-op when the dtype
    # and device already match.
    x = coords.detach().to(device=ref.device, dtype=ref.dtype).requires_grad_(True)
    if cell is not None:
        cell = cell.detach().to(device=ref.device, dtype=ref.dtype)
    if pbc is not None:
        pbc = pbc.to(device=ref.device)
    return x, cell, pbc


def energies_forces(model: torch.nn.Module, species: Tensor, coords: Tensor,
                    cell: tp.Optional[Tensor] = None,
                    pbc: tp.Optional[Tensor] = None) -> EnergiesForces:
    """Energies and forces of a batch, leaving the caller's tensors untouched.

    Parameters
    ----------
    model : torchani.arch.ANI or torch.jit.ScriptModule
        Any TorchANI ANI model, patched or not, eager or scripted.
    species : Tensor
        (M, A) long: atomic numbers (or element indices if the model has
        ``periodic_table_index=False``); -1 marks padding atoms.
    coords : Tensor
        (M, A, 3) positions in Å, any float dtype and device: a detached copy
        is moved to the model's dtype and device; ``coords.requires_grad`` is
        left as it was.
    cell : Tensor, optional
        (3, 3) lattice vectors (rows) in Å, shared by the batch.
    pbc : Tensor, optional
        (3,) bool; ``None`` for no periodicity.

    Returns
    -------
    EnergiesForces
        ``energies`` (M,) in Hartree and ``forces`` (M, A, 3) = -dE/dx in
        Hartree/Å, both detached, in the model's dtype and on its device.
        Forces on padding atoms are 0; a batch of padding only gives energies
        and forces 0.

    Raises
    ------
    TypeError
        If an input is not a tensor (numpy arrays and lists are not converted).
    """
    x, cell, pbc = prepare(model, species, coords, cell, pbc)
    with torch.enable_grad():
        energies = model((species.to(x.device), x), cell=cell, pbc=pbc).energies
        forces = forces_of(energies, x)
    return EnergiesForces(energies.detach(), forces)


STRESS_KINDS = ("scaling", "fdotr", "numerical")


def energies_forces_virial(model: torch.nn.Module, species: Tensor, elem_idxs: Tensor, coords: Tensor,
                           cell: tp.Optional[Tensor], pbc: tp.Optional[Tensor], stress_kind: str = "scaling",
                           energy_unit: float = 1.0) -> tp.Tuple[Tensor, Tensor, tp.Optional[Tensor]]:
    """Energy, forces and virial of one structure (``coords`` (1, A, 3), a leaf).

    Without a cell: ``model((species, coords))``'s energy and its forces, virial
    None. With one, the virial ``dE/dstrain`` (3, 3) by ``stress_kind``:
    "scaling" differentiates E(x F, cell F), F = I + sym(strain), at strain 0;
    "fdotr" sums pair vector x pair force over the neighbour list; both come out
    of the forces' backward pass. "numerical": :func:`numerical_virial`.
    Everything is in ``energy_unit`` per Hartree (the energy is scaled before
    differentiating, as the ASE calculator always did): energy (1,), forces
    (A, 3) per Å.
    """
    coords.requires_grad_(True)
    if cell is None:
        energy = model((species, coords), cell=None, pbc=None).energies * energy_unit
        (grad,) = torch.autograd.grad(energy.sum(), coords)
        return energy, -grad[0], None
    if stress_kind not in STRESS_KINDS:
        raise ValueError(f"stress_kind must be one of {STRESS_KINDS}, got {stress_kind!r}")
    inputs = [coords]
    if stress_kind == "scaling":
        strain = coords.new_zeros((3, 3), requires_grad=True)
        deform = torch.eye(3, dtype=coords.dtype, device=coords.device) + 0.5 * (strain + strain.T)
        x, c = coords @ deform, cell @ deform
        inputs.append(strain)
    else:
        x, c = coords, cell
    found, _ = neighbors(model, elem_idxs, x, c, pbc)
    if stress_kind == "fdotr":
        diff = found.diff_vectors
        found = Neighbors(found.indices, diff.norm(2, -1), diff)
        inputs.append(diff)
    energy = model.compute_from_neighbors(elem_idxs, x, found).energies * energy_unit
    grads = torch.autograd.grad(energy.sum(), inputs)
    if stress_kind == "scaling":
        virial = grads[1]
    elif stress_kind == "fdotr":
        virial = grads[1].transpose(0, 1) @ diff.detach()
    else:
        virial = numerical_virial(model, elem_idxs, coords.detach(), cell, pbc) * energy_unit
    return energy, -grads[0][0], virial


def numerical_virial(model: torch.nn.Module, elem_idxs: Tensor, coords: Tensor, cell: Tensor,
                     pbc: Tensor) -> Tensor:
    """dE/dstrain (3, 3) in Hartree by central differences of E(strain) of one
    structure; the step balances truncation against the rounding of the energy
    (TorchANI's fixed 1e-6 gives zeros in float32)."""
    eps = float(torch.finfo(coords.dtype).eps) ** (1.0 / 3.0)
    virial = coords.new_zeros((3, 3))

    def energy(deform: Tensor) -> Tensor:
        x, c = coords @ deform, cell @ deform
        found, _ = neighbors(model, elem_idxs, x, c, pbc)
        return model.compute_from_neighbors(elem_idxs, x, found).energies[0]

    with torch.no_grad():
        eye = torch.eye(3, dtype=coords.dtype, device=coords.device)
        for i in range(3):
            for j in range(i, 3):
                d = torch.zeros(3, 3, dtype=coords.dtype, device=coords.device)
                d[i, j] += 0.5 * eps
                d[j, i] += 0.5 * eps
                v = (energy(eye + d) - energy(eye - d)) / (2 * eps)
                virial[i, j] = virial[j, i] = v
    return virial


def local_energies(model: torch.nn.Module, elem_idxs: Tensor, coords: Tensor, num_local: int) -> Tensor:
    """The atomic energies (M, num_local) in Hartree of the first ``num_local``
    atoms of each structure among the rest (a domain's ghost atoms: LAMMPS),
    with pair potentials shared half and half, so that the domains' sums add up
    to the whole system's energy; the networks of the other atoms are not run.
    ``coords`` (M, N, 3) are Cartesian (no cell): the ghosts are the periodic
    images already."""
    found, _ = neighbors(model, elem_idxs, coords, None, None)
    return model.local_atomic_energies(elem_idxs, coords, found, num_local)[:, :num_local]
