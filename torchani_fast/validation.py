"""Input validation for patched models, eager and TorchScript alike.

TorchANI 2.9 answers a wrong coordinate shape with an empty AssertionError,
returns an energy for NaN coordinates, and (once scripted) treats an unsupported
element as padding. A patched model checks every call and raises an error that
names the argument and the offending value instead. On the CPU a valid input
costs two one-pass C++ ops (``first_invalid_atom``, ``convert_species``,
kernels/validate_cpu.cpp); when they flag an atom, or on other devices, the
element-wise checks below run and word the error (on CUDA each reduction is
one host synchronisation).

Choices (documented in the README, "Errors"):
- errors TorchANI reports with an ``AssertionError`` (the species' rank, the
  coordinates' shape, a non-zero charge) raise :class:`InputError`, which is
  both a ``ValueError`` and an ``AssertionError``, so code written against
  TorchANI (``except AssertionError``) keeps catching them; every other input
  error stays a plain ``ValueError`` or ``TypeError``;
- dtypes follow :data:`DTYPE_RULE`: float32 coordinates into a float64 model
  are promoted, as TorchANI does; float64 coordinates into a float32 model are
  refused (TorchANI fails inside a matrix product there);
- padding atoms (species -1) may carry any coordinates, NaN included;
- an all-False ``pbc`` means "not periodic" (TorchANI raises), ``cell`` without
  ``pbc`` is refused as ambiguous.
"""
import typing as tp

import torch
from torch import Tensor
from torchani.constants import PERIODIC_TABLE
from torchani.nn import SpeciesConverter as _TorchaniSpeciesConverter

__all__ = ["InputError", "DTYPE_RULE", "check_inputs", "check_cell_pbc", "SpeciesConverter"]

DTYPE_RULE = """\
The one dtype rule of a patched model (coords, cell and the model's floating dtype):
- coords of the model's dtype run as they are (no conversion on the hot path);
- float32 coords into a float64 model are promoted, as TorchANI promotes them:
  the pair vectors are formed from the float32 coords (as TorchANI forms
  them) and converted once to float64, so energies are float64, agree with
  TorchANI to the float32 rounding of the geometry (~1e-11 relative on the
  energy) and the gradient reaches the float32 input in float32; a cell, if
  given, must be float32 like the coords (TorchANI fails on a float64 cell);
- float64 coords into a float32 model are refused (TorchANI raises an opaque
  matrix-product dtype error there; silently rounding the input is not done);
- any other coords dtype (float16, bfloat16, integers) is refused.
"""


class InputError(ValueError, AssertionError):
    """A bad input that TorchANI reports with an ``AssertionError``.

    Deriving from both keeps ``except ValueError`` (torchani_fast's documented
    error) and ``except AssertionError`` (what TorchANI raises, and what code
    and tests written against TorchANI catch) working. Under TorchScript every
    exception surfaces as ``torch.jit.Error``, for TorchANI as for a patched model.
    """


def _where(flat_index: int, num_atoms: int) -> str:
    return "molecule {}, atom {}".format(flat_index // num_atoms, flat_index % num_atoms)


def _dtype(d: torch.dtype) -> str:
    # TorchScript formats a dtype as its enum number; name the common ones.
    names = {torch.float32: "torch.float32", torch.float64: "torch.float64",
             torch.float16: "torch.float16", torch.bfloat16: "torch.bfloat16",
             torch.int64: "torch.int64", torch.int32: "torch.int32", torch.int16: "torch.int16",
             torch.int8: "torch.int8", torch.uint8: "torch.uint8", torch.bool: "torch.bool"}
    for k, v in names.items():
        if d == k:
            return v
    return "dtype #{}".format(d)


def _first(mask: Tensor) -> int:
    return int(mask.reshape(-1).nonzero()[0, 0])


def check_inputs(species: Tensor, coords: Tensor, charge: int, dtype: torch.dtype,
                 device: torch.device) -> None:
    """Validate ``species`` (M, A) and ``coords`` (M, A, 3) for a model of ``dtype`` on ``device``."""
    if species.dtype != torch.long and species.dtype != torch.int:
        raise ValueError("species must be an integer tensor (int64 or int32), got {}".format(_dtype(species.dtype)))
    if species.dim() != 2:
        raise InputError("species must have shape (molecules, atoms), got {}".format(list(species.shape)))
    if species.shape[0] == 0 or species.shape[1] == 0:
        raise ValueError("species is empty (shape {}): nothing to compute".format(list(species.shape)))
    if coords.dim() != 3 or coords.shape[0] != species.shape[0] or coords.shape[1] != species.shape[1] \
            or coords.shape[2] != 3:
        raise InputError("coords must have shape (molecules, atoms, 3) = {} to match species, got {}".format(
            [species.shape[0], species.shape[1], 3], list(coords.shape)))
    if coords.dtype != torch.float and coords.dtype != torch.double:
        raise ValueError("coords must be float32 or float64, got {}".format(_dtype(coords.dtype)))
    if coords.dtype != dtype and not (coords.dtype == torch.float and dtype == torch.double):
        # DTYPE_RULE: only float32 -> float64 is promoted (by the AEV computer).
        raise ValueError(
            "coords are {} but the model is {}: convert one of them explicitly "
            "(coords.to({}) or model.to({}))".format(_dtype(coords.dtype), _dtype(dtype), _dtype(dtype), _dtype(coords.dtype)))
    if species.device != coords.device:
        raise ValueError("species is on {} but coords on {}".format(species.device, coords.device))
    if coords.device != device:
        raise ValueError("the inputs are on {} but the model is on {}".format(coords.device, device))
    if charge != 0:
        raise InputError("charge must be 0 (ANI models describe neutral molecules), got {}".format(charge))
    if coords.device.type == "cpu" and torch.ops.torchani_fast.first_invalid_atom(species, coords.detach()) < 0:
        return  # one pass in C++ found nothing; the checks below word the error otherwise
    bad = species < -1
    if bool(bad.any()):
        i = _first(bad)
        raise ValueError("species must be >= -1 (-1 marks padding), got {} at {}".format(
            int(species.reshape(-1)[i]), _where(i, species.shape[1])))
    bad = (~torch.isfinite(coords).all(-1)) & (species >= 0)
    if bool(bad.any()):
        i = _first(bad)
        row: tp.List[float] = coords.detach().reshape(-1, 3)[i].tolist()
        raise ValueError("coords must be finite, got {} at {}".format(row, _where(i, species.shape[1])))


def check_cell_pbc(coords: Tensor, cell: tp.Optional[Tensor], pbc: tp.Optional[Tensor],
                   values: bool = True) -> None:
    """Validate ``cell`` (3, 3) and ``pbc`` (3,) bool against ``coords``.

    ``values=False`` checks only shapes, dtypes and devices, which reads no data
    (no host sync on CUDA, so a CUDA graph can capture the caller); the
    fixed-capacity neighbour op then reports a singular or non-finite cell
    through its ``num_pairs`` (-2).
    """
    if pbc is not None:
        if pbc.dtype != torch.bool or pbc.shape != (3,):
            raise ValueError("pbc must be a bool tensor of shape (3,), got {} of shape {}".format(
                _dtype(pbc.dtype), list(pbc.shape)))
        if cell is None:
            raise ValueError("pbc was given without a cell: pass cell, a (3, 3) tensor of lattice vectors (rows)")
        if pbc.device != coords.device:
            raise ValueError("pbc is on {} but coords on {}".format(pbc.device, coords.device))
    if cell is not None:
        if pbc is None:
            raise ValueError(
                "cell was given without pbc: pass pbc=torch.tensor([True, True, True]) for a "
                "periodic system, or no cell for a molecule")
        if cell.shape != (3, 3):
            raise ValueError("cell must have shape (3, 3), got {}".format(list(cell.shape)))
        if cell.dtype != coords.dtype:
            raise ValueError("cell is {} but coords are {}".format(_dtype(cell.dtype), _dtype(coords.dtype)))
        if cell.device != coords.device:
            raise ValueError("cell is on {} but coords on {}".format(cell.device, coords.device))
        if not values:
            return
        if cell.device.type == "cpu" and pbc is not None and torch.ops.torchani_fast.valid_cell(cell.detach(), pbc):
            return  # one C++ op found nothing (instead of ~15 ATen ops); the checks below word the error
        rows: tp.List[tp.List[float]] = cell.detach().tolist()
        if not bool(torch.isfinite(cell).all()):
            raise ValueError("cell must be finite, got {}".format(rows))
        if bool(pbc.any()):
            det = float(torch.linalg.det(cell.detach().double()))
            scale = float((cell.detach().double() ** 2).sum(1).sqrt().prod())
            if not abs(det) > 1e-8 * scale:
                raise ValueError("cell is singular (determinant {}), got {}".format(det, rows))


class SpeciesConverter(_TorchaniSpeciesConverter):
    """TorchANI's atomic-number converter that refuses unsupported elements.

    TorchANI raises only in eager mode; scripted, an unsupported element silently
    becomes padding. This one raises in both, naming the element and the atom.
    Built by :meth:`from_torchani` (the ``conv_tensor`` buffer, and so the state
    dict, is unchanged).
    """

    symbols_table: tp.List[str]

    @classmethod
    def from_torchani(cls, converter: torch.nn.Module) -> "SpeciesConverter":
        converter.__class__ = cls
        converter.symbols_table = list(PERIODIC_TABLE)
        return converter

    def _supported(self) -> str:
        # In the model's element order (H, C, N, O, S, F, Cl for ANI-2x).
        names: tp.List[str] = []
        for k in range(int((self.conv_tensor >= 0).sum())):
            names.append(self.symbols_table[int((self.conv_tensor == k).nonzero()[0, 0])])
        return ", ".join(names)

    def forward(self, atomic_nums: Tensor, nop: bool = False, _dont_use: bool = False) -> Tensor:
        conv = self.conv_tensor
        if nop:  # element indices given directly (periodic_table_index=False)
            n = int((conv >= 0).sum())
            bad = (atomic_nums < -1) | (atomic_nums >= n)
            if bool(bad.any()):
                i = _first(bad)
                raise ValueError(
                    "species must be element indices in [-1, {}) for this model (-1 is padding), "
                    "got {} at {}".format(n, int(atomic_nums.reshape(-1)[i]), _where(i, atomic_nums.shape[-1])))
            return atomic_nums
        if atomic_nums.device.type == "cpu" and conv.dtype == torch.long and (
                atomic_nums.dtype == torch.long or atomic_nums.dtype == torch.int):
            elem_idxs, invalid = torch.ops.torchani_fast.convert_species(atomic_nums, conv)
            if invalid < 0:
                return elem_idxs  # else the checks below word the error
        bad = (atomic_nums < -1) | (atomic_nums >= conv.shape[0] - 1)
        if bool(bad.any()):
            i = _first(bad)
            raise ValueError("species must be atomic numbers (1-118) or -1 for padding, got {} at {}".format(
                int(atomic_nums.reshape(-1)[i]), _where(i, atomic_nums.shape[-1])))
        elem_idxs = conv[atomic_nums]
        bad = (elem_idxs < 0) & (atomic_nums >= 0)
        if bool(bad.any()):
            i = _first(bad)
            z = int(atomic_nums.reshape(-1)[i])
            raise ValueError("unsupported element {} (atomic number {}) at {}; this model supports {}".format(
                self.symbols_table[z], z, _where(i, atomic_nums.shape[-1]), self._supported()))
        return elem_idxs


class ValidatedModel:
    """Mixin for patched models: ``_check_inputs`` with real messages.

    ``torchani.arch.ANI`` calls ``self._check_inputs(species, coords, charge)`` at
    the start of every entry point (forward, atomic_energies, energies_qbcs,
    compute_from_neighbors, ...); TorchScript compiles this override in its place.
    """

    def _check_inputs(self, species: Tensor, coords: Tensor, charge: int = 0) -> None:
        reference = self.energy_shifter.self_energies
        check_inputs(species, coords, charge, reference.dtype, reference.device)
