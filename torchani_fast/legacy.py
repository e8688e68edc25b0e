"""``patch(model)`` for TorchANI 2.2.4, the legacy API (``BuiltinModel`` / ``BuiltinEnsemble``).

``import torchani_fast`` with TorchANI 2.2.4 installed makes ``torchani_fast.patch``
this module's :func:`patch`. It swaps the two members of a 2.2.4 model that do the
work, in place, and keeps its class (a subclass of it), its state dict and every
entry point (``forward((species, coords), cell=, pbc=)`` returning
``SpeciesEnergies``, ``atomic_energies``, ``members_energies``, ``energies_qbcs``,
``model[i]``, ``len``, ``species_to_tensor``, ``ase()``, ``torch.jit.script``):

- ``model.aev_computer`` -> :class:`AEVComputer`, which keeps 2.2.4's constant
  buffers (``EtaR``, ``ShfR``, ``EtaA``, ``Zeta``, ``ShfA``, ``ShfZ``,
  ``triu_index``, ``default_cell``, ``default_shifts``) and attributes (``Rcr``,
  ``Rca``, ``num_species``, ``sizes``, ...) and computes the AEV with
  torchani_fast's neighbour search (:class:`torchani_fast.aev.NeighborList`) and
  ``torchani_fast::aev`` op;
- ``model.neural_networks`` (an ``Ensemble`` of ``ANIModel``, or one ``ANIModel``)
  -> :class:`FusedEnsemble` / :class:`FusedNetworks`, torchani_fast's fused
  networks (:mod:`torchani_fast.nn`) over 2.2.4's own ``Sequential`` element
  networks, registered under the same names (``neural_networks.3.H.0.weight``).

TorchANI 2.2.4's conventions are kept: element indices 0..S-1 unless
``periodic_table_index=True``, ``-1`` for padding, ``cell`` (3, 3) and ``pbc``
(3,) given together (an all-False ``pbc`` is not periodic), one cell for the
whole batch, energies in float64 (2.2.4's ``EnergyShifter``). Periodic
coordinates need not be wrapped into the cell (2.2.4 needs them wrapped: its
image search assumes it; its ASE calculator wraps them).
"""
import typing as tp

import torch
from torch import Tensor
from torch.jit import Final
from torchani.aev import SpeciesAEV
from torchani.models import BuiltinEnsemble, BuiltinModel
from torchani.nn import SpeciesEnergies

from . import ops
from ._front_door import front_door_class, swap_class
from .aev import NeighborList
from .nn.fused import _FusedBase
from .nn.layout import _Layout, linears
from .validation import InputError, check_inputs

__all__ = ["patch", "is_patched", "AEVComputer", "FusedEnsemble", "FusedNetworks"]

_BUFFERS = ("EtaR", "ShfR", "EtaA", "Zeta", "ShfA", "ShfZ", "triu_index", "default_cell",
            "default_shifts")
_SIZES = ("radial_sublength", "radial_length", "angular_sublength", "angular_length", "aev_length")


class AEVComputer(torch.nn.Module):
    """Drop-in for TorchANI 2.2.4's ``torchani.AEVComputer`` on torchani_fast's ops.

    Built by :meth:`from_torchani`; the constant buffers are shared with the
    original (the state dict is unchanged, ``.to()`` moves them).
    """

    Rcr: Final[float]
    Rca: Final[float]
    num_species: Final[int]
    radial_sublength: Final[int]
    radial_length: Final[int]
    angular_sublength: Final[int]
    angular_length: Final[int]
    aev_length: Final[int]
    sizes: Final[tp.Tuple[int, int, int, int, int]]
    use_cuda_extension: Final[bool]
    triu_index: Tensor

    def __init__(self, aev_computer: torch.nn.Module, neighborlist: tp.Optional[NeighborList] = None):
        super().__init__()
        check_supported(aev_computer)
        self.Rcr = float(aev_computer.Rcr)
        self.Rca = float(aev_computer.Rca)
        self.num_species = int(aev_computer.num_species)
        for name in _SIZES:
            setattr(self, name, int(getattr(aev_computer, name)))
        self.sizes = tuple(int(s) for s in aev_computer.sizes)
        self.use_cuda_extension = False
        self.cuaev_enabled = False
        for name in _BUFFERS:
            self.register_buffer(name, getattr(aev_computer, name))
        self.neighborlist = neighborlist if neighborlist is not None else NeighborList()

    @classmethod
    def from_torchani(cls, aev_computer: torch.nn.Module,
                      neighborlist: tp.Optional[NeighborList] = None) -> "AEVComputer":
        """Wrap a TorchANI 2.2.4 ``AEVComputer`` (raises ``TypeError`` if unsupported)."""
        return cls(aev_computer, neighborlist)

    @torch.jit.unused
    def constants(self):
        """``(Rcr, EtaR, ShfR, Rca, ShfZ, EtaA, Zeta, ShfA)``, as TorchANI 2.2.4 returns them."""
        return self.Rcr, self.EtaR, self.ShfR, self.Rca, self.ShfZ, self.EtaA, self.Zeta, self.ShfA

    def forward(self, input_: tp.Tuple[Tensor, Tensor], cell: tp.Optional[Tensor] = None,
                pbc: tp.Optional[Tensor] = None) -> SpeciesAEV:
        """``SpeciesAEV(species, aevs)`` of a batch, as TorchANI 2.2.4's ``AEVComputer.forward``."""
        species, coordinates = input_
        # TorchANI 2.2.4 asserts the shapes; InputError is also an AssertionError.
        check_inputs(species, coordinates, 0, self.EtaR.dtype, self.EtaR.device)
        if (cell is None) != (pbc is None):
            raise InputError(
                "cell and pbc go together (TorchANI 2.2.4): pass both, e.g. cell=<(3, 3) lattice "
                "vectors> and pbc=torch.tensor([True, True, True]), or neither, got {} and {}".format(
                    "cell" if cell is not None else "cell=None", "pbc" if pbc is not None else "pbc=None"))
        neighbors = self.neighborlist(self.Rcr, species, coordinates, cell, pbc)
        diff_vectors = neighbors.diff_vectors
        if diff_vectors.dtype != self.EtaR.dtype:
            # float32 coords into a float64 model: promoted (validation.DTYPE_RULE).
            diff_vectors = diff_vectors.to(self.EtaR.dtype)
        aev = ops.aev(
            species, neighbors.indices, diff_vectors,
            self.EtaR.view(-1), self.ShfR.view(-1),
            self.EtaA.view(-1), self.Zeta.view(-1), self.ShfA.view(-1), self.ShfZ.view(-1),
            self.Rcr, self.Rca, self.num_species,
        )
        return SpeciesAEV(species, aev)


def check_supported(aev_computer: torch.nn.Module) -> None:
    """Raise ``TypeError`` naming what torchani_fast cannot reproduce of a 2.2.4 AEV computer."""
    from torchani.aev import AEVComputer as TorchaniAEV

    if not isinstance(aev_computer, TorchaniAEV):
        raise TypeError(
            f"torchani_fast supports torchani.AEVComputer, got {type(aev_computer).__name__}")
    for name in ("EtaR", "EtaA", "Zeta"):
        n = getattr(aev_computer, name).numel()
        if n != 1:
            raise TypeError(f"torchani_fast supports one {name} value (as ANI-1x/2x/1ccx), got {n}")
    if not aev_computer.Rca <= aev_computer.Rcr:
        raise TypeError(f"Rca {aev_computer.Rca} must not exceed Rcr {aev_computer.Rcr}")
    if aev_computer.use_cuda_extension:
        raise TypeError("the AEV computer uses TorchANI's cuaev extension (use_cuda_extension=True); "
                        "patch the model built without it")


# -- the networks ----------------------------------------------------------------------------


def unsupported_reason(networks: torch.nn.Module) -> tp.Optional[str]:
    """Why 2.2.4 ``networks`` (``Ensemble`` of ``ANIModel`` or one ``ANIModel``) cannot be fused."""
    from torchani.nn import ANIModel, Ensemble

    if isinstance(networks, Ensemble):
        if not all(type(m) is ANIModel for m in networks):
            return "ensemble members are not ANIModel"
        nets = list(networks)
    elif type(networks) is ANIModel:
        nets = [networks]
    else:
        return f"{type(networks).__name__} is not an Ensemble or ANIModel"
    shapes = None
    for net in nets:
        if len(set(id(m) for m in net.values())) != len(net):
            return "element networks are aliased"
        net_shapes = []
        for atomic in net.values():
            if not isinstance(atomic, torch.nn.Sequential) or len(atomic) % 2 != 1:
                return f"element network {type(atomic).__name__} is not a Sequential of Linear and CELU"
            for k, layer in enumerate(atomic):
                if k % 2 == 0 and (type(layer) is not torch.nn.Linear or layer.bias is None):
                    return f"layer {k} ({type(layer).__name__}) is not Linear with bias"
                if k % 2 == 1 and not (type(layer) is torch.nn.CELU and layer.alpha == 0.1):
                    return f"activation {layer!r} is not CELU(alpha=0.1)"
            lins = linears(atomic)
            if lins[-1].out_features != 1:
                return "networks have more than one output"
            net_shapes.append(tuple(tuple(lin.weight.shape) for lin in lins))
        if shapes is None:
            shapes = net_shapes
        elif net_shapes != shapes:
            return "members differ in layer sizes"
    if len({s[0][1] for s in shapes}) != 1:
        return "element networks read different input sizes"
    return None


class _LegacyFused(_FusedBase):
    """The fused evaluation with TorchANI 2.2.4's calling convention (tuples in, SpeciesEnergies out)."""

    def _values(self, species: Tensor, aev: Tensor, atomic: bool, ensemble_values: bool) -> Tensor:
        if species.shape != aev.shape[:-1]:  # TorchANI 2.2.4 asserts it
            raise InputError("species {} and aevs {} must have shapes (M, A) and (M, A, F)".format(
                list(species.shape), list(aev.shape)))
        reduce = not atomic and not (ensemble_values and self.is_ensemble)
        values = self._member_atomic(species.flatten(), aev.flatten(0, 1),
                                     species.shape[0] if reduce else 0)
        return self._reduce(values, species.shape[0], species.shape[1], atomic, ensemble_values)

    def forward(self, species_aev: tp.Tuple[Tensor, Tensor],  # type: ignore[override]
                cell: tp.Optional[Tensor] = None, pbc: tp.Optional[Tensor] = None) -> SpeciesEnergies:
        """``SpeciesEnergies(species, energies)``: molecular energies (M,), unshifted."""
        species, aev = species_aev
        return SpeciesEnergies(species, self._values(species, aev, False, False))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._eager_clear()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _init(self, layout: _Layout, members: int) -> None:
        self.total_members_num = members
        self.active_members_idxs = list(range(members))
        self.register_buffer("atomic_numbers", torch.zeros(1, dtype=torch.long), persistent=False)
        self._init_layout(layout)
        # The AEVs come from torchani_fast's op, whose zero blocks mean "no such neighbours".
        self.zero_blocks_exact = True


class FusedEnsemble(_LegacyFused):
    """Drop-in for TorchANI 2.2.4's ``Ensemble`` of ``ANIModel``: every member at once.

    The members stay registered as ``"0"``, ``"1"``, ... (the state dict is
    unchanged); iterating, ``len`` and ``self[i]`` work as on the ``Ensemble``
    (``self[i]`` is member ``i`` fused, a :class:`FusedNetworks`).
    """

    size: int

    def __init__(self, ensemble: torch.nn.Module, layout: _Layout):
        super().__init__()
        for i, member in enumerate(ensemble):
            self.add_module(str(i), member)
        self.size = len(ensemble)
        self.is_ensemble = True
        self._init(layout, len(ensemble))
        self._layout = layout

    @torch.jit.export
    def members_energies(self, species_aev: tp.Tuple[Tensor, Tensor]) -> Tensor:
        """Unshifted energies of every member, (members, M)."""
        species, aev = species_aev
        return self._values(species, aev, False, True)

    @torch.jit.export
    def members_atomic_energies(self, species_aev: tp.Tuple[Tensor, Tensor]) -> Tensor:
        """Unshifted atomic energies of every member, (members, M, A)."""
        species, aev = species_aev
        return self._values(species, aev, True, True)

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        return iter(self._modules[str(i)] for i in range(self.size))

    def __getitem__(self, idx: int) -> "FusedNetworks":
        idx = range(self.size)[idx]  # negative indices and IndexError as a list
        member = FusedNetworks(self._modules[str(idx)], self._layout)
        member.split_min_atoms = self.split_min_atoms
        return member

    @torch.jit.unused
    def _member_atomics(self) -> tp.List[tp.List[torch.nn.Module]]:
        return [list(self._modules[str(i)].values()) for i in range(self.size)]


class FusedNetworks(_LegacyFused):
    """Drop-in for one TorchANI 2.2.4 ``ANIModel`` (``model[i]``, ``model_index=i``).

    The element networks stay registered under their names (``"H"``, ``"C"``,
    ...); ``self["H"]``, ``keys()``, ``values()``, ``items()`` work as on the
    ``ANIModel``.
    """

    def __init__(self, ani_model: torch.nn.Module, layout: _Layout):
        super().__init__()
        self._element_names = list(ani_model.keys())
        for name, module in ani_model.items():
            self.add_module(name, module)
        self.is_ensemble = False
        self._init(layout, 1)

    @torch.jit.export
    def _atomic_energies(self, species_aev: tp.Tuple[Tensor, Tensor]) -> Tensor:
        """Unshifted atomic energies (M, A), as ``ANIModel._atomic_energies``."""
        species, aev = species_aev
        return self._values(species, aev, True, False)

    def __getitem__(self, key: str) -> torch.nn.Module:
        return self._modules[key]

    def __len__(self) -> int:
        return len(self._element_names)

    def __iter__(self):
        return iter(self._element_names)

    def keys(self):
        return list(self._element_names)

    def values(self):
        return [self._modules[k] for k in self._element_names]

    def items(self):
        return [(k, self._modules[k]) for k in self._element_names]

    @torch.jit.unused
    def _member_atomics(self) -> tp.List[tp.List[torch.nn.Module]]:
        return [self.values()]


def fuse_networks(networks: torch.nn.Module, aev_computer: AEVComputer) -> _LegacyFused:
    """The fused form of 2.2.4 networks (fused ones are returned as they are); ``TypeError`` if unsupported."""
    from torchani.nn import Ensemble

    if isinstance(networks, _LegacyFused):
        return networks
    reason = unsupported_reason(networks)
    if reason is not None:
        raise TypeError(f"torchani_fast cannot fuse these networks: {reason}")
    layout = _Layout(aev_computer.radial_sublength, aev_computer.angular_sublength,
                     aev_computer.triu_index.tolist())
    if isinstance(networks, Ensemble):
        return FusedEnsemble(networks, layout)
    return FusedNetworks(networks, layout)


# -- the model --------------------------------------------------------------------------------


def is_patched(model: torch.nn.Module) -> bool:
    """Whether the 2.2.4 ``model`` was patched by torchani_fast."""
    return isinstance(getattr(model, "aev_computer", None), AEVComputer)


def patch(model: torch.nn.Module, neighborlist: str = "auto") -> torch.nn.Module:
    """Make a TorchANI 2.2.4 model use torchani_fast's compiled kernels.

    Parameters
    ----------
    model : torchani.models.BuiltinModel
        ``torchani.models.ANI1x()``, ``ANI2x()``, ``ANI1ccx()`` (any
        ``periodic_table_index``, ``model_index=i``), ``model[i]``, any dtype.
    neighborlist : {"auto", "all_pairs", "cell_list"}
        Neighbour search strategy; "auto" switches to the O(N) cell list for
        large molecules.

    Returns
    -------
    The same model object, patched in place. Patching twice is harmless.

    Raises
    ------
    TypeError
        If the model is not a 2.2.4 ``BuiltinModel`` or has parts torchani_fast
        does not reproduce exactly (the message names them).
    """
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError("patch() needs the eager TorchANI model; call torch.jit.script after patching")
    if not isinstance(model, BuiltinModel):
        raise TypeError(
            "torchani_fast.patch expects a TorchANI 2.2.4 model (torchani.models.ANI1x(), "
            f"ANI2x(), ANI1ccx() or one of their members), got {type(model).__name__}")
    aev = model.aev_computer
    if isinstance(aev, AEVComputer):
        aev.neighborlist.set_strategy(neighborlist)
    else:
        aev = AEVComputer.from_torchani(aev, NeighborList(neighborlist))
    networks = fuse_networks(model.neural_networks, aev)
    model.aev_computer = aev
    model.neural_networks = networks
    _install_front_door(model)
    return model


class _ModelFrontDoor:
    """What a patched 2.2.4 ``BuiltinModel`` adds: nothing TorchScript sees."""


class _EnsembleFrontDoor:
    """A patched ``BuiltinEnsemble``: members evaluated by the fused op, ``model[i]`` patched."""

    @torch.jit.export
    def atomic_energies(self, species_coordinates: tp.Tuple[Tensor, Tensor],
                        cell: tp.Optional[Tensor] = None, pbc: tp.Optional[Tensor] = None,
                        average: bool = True) -> SpeciesEnergies:
        """Atomic energies (M, A), or per member (members, M, A) with ``average=False``."""
        if self.periodic_table_index:
            species_coordinates = self.species_converter(species_coordinates)
        species, aevs = self.aev_computer(species_coordinates, cell=cell, pbc=pbc)
        values = self.neural_networks.members_atomic_energies((species, aevs))
        shift = self.energy_shifter.self_energies.to(species.device)[species]
        # Added in place in the networks' dtype, as TorchANI 2.2.4 adds them.
        values += torch.where(species >= 0, shift, torch.zeros_like(shift))
        if average:
            return SpeciesEnergies(species, values.mean(dim=0))
        return SpeciesEnergies(species, values)

    @torch.jit.export
    def members_energies(self, species_coordinates: tp.Tuple[Tensor, Tensor],
                         cell: tp.Optional[Tensor] = None,
                         pbc: tp.Optional[Tensor] = None) -> SpeciesEnergies:
        """Shifted energies of every member, (members, M)."""
        if self.periodic_table_index:
            species_coordinates = self.species_converter(species_coordinates)
        species, aevs = self.aev_computer(species_coordinates, cell=cell, pbc=pbc)
        values = self.neural_networks.members_energies((species, aevs))
        return SpeciesEnergies(species, values + self.energy_shifter.sae(species))

    def __getitem__(self, index):
        member = super().__getitem__(index)  # a BuiltinModel sharing the fused member
        _install_front_door(member)
        return member


def _mixins(base: type) -> tp.Tuple[type, ...]:
    """The front door in front of ``base`` (BuiltinModel, BuiltinEnsemble or a subclass)."""
    return (_EnsembleFrontDoor if issubclass(base, BuiltinEnsemble) else _ModelFrontDoor,)


class PatchedBuiltinModel(*_mixins(BuiltinModel), BuiltinModel):
    __doc__ = BuiltinModel.__doc__


class PatchedBuiltinEnsemble(*_mixins(BuiltinEnsemble), BuiltinEnsemble):
    __doc__ = BuiltinEnsemble.__doc__


def _install_front_door(model: torch.nn.Module) -> None:
    if not isinstance(model, (_ModelFrontDoor, _EnsembleFrontDoor)):
        swap_class(model, front_door_class(
            type(model), {BuiltinModel: PatchedBuiltinModel, BuiltinEnsemble: PatchedBuiltinEnsemble}, _mixins))
