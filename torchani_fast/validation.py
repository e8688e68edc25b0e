"""Input validation for patched models, eager and TorchScript alike.

TorchANI 2.9 answers a wrong coordinate shape with an empty AssertionError,
returns an energy for NaN coordinates, and (once scripted) treats an unsupported
element as padding. A patched model checks every call and raises an error that
names the argument and the offending value instead. On the CPU a valid input
costs two one-pass C++ ops (``first_invalid_atom``, ``convert_species``,
csrc/validate/validate_cpu.cpp); when they flag an atom, or on other devices, the
element-wise checks below run and word the error (on CUDA one host read of a
status per check, more only to word an error). Traced (torch.compile,
torch.export), the value checks are checking ops that run with the graph
(ops.py, docs/compile.md).

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

from . import ops
from ._device_paths import host_path
try:
    from torchani.constants import PERIODIC_TABLE
    from torchani.nn import SpeciesConverter as _TorchaniSpeciesConverter
except ImportError:  # TorchANI 2.2.4 (torchani_fast.legacy): its converter is kept as it is
    from torchani.utils import PERIODIC_TABLE
    _TorchaniSpeciesConverter = torch.nn.Module

__all__ = ["InputError", "DTYPE_RULE", "check_inputs", "check_input_values", "check_neighbors", "check_cell_pbc",
           "check_species_values", "SpeciesConverter", "input_values_status", "cell_status"]

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
                 device: torch.device, values: bool = True) -> None:
    """Validate ``species`` (M, A) and ``coords`` (M, A, 3) for a model of ``dtype`` on ``device``.

    ``values=False`` checks only what reads no data (types, shapes, dtypes,
    devices, the charge); :func:`input_values_status` is then the rest, on the device.
    """
    if not torch.jit.is_scripting():  # (scripted, the signature already demands tensors)
        for name, value in (("species", species), ("coords", coords)):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__module__}."
                                f"{type(value).__name__}; convert it with torch.as_tensor({name})")
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
    if torch.compiler.is_compiling():
        # Traced (torch.compile, torch.export): no branch on values here; the checking
        # op reads them when the graph runs and raises the errors below (ops.py).
        ops.check_input_values(species, coords.detach())
        return
    if values:
        check_input_values(species, coords)


def check_input_values(species: Tensor, coords: Tensor) -> None:
    """The value checks of :func:`check_inputs`: species >= -1, finite coordinates of real atoms."""
    if host_path(coords):
        if ops.first_invalid_atom(species, coords.detach()) < 0:
            return  # one pass in C++ found nothing; the checks below word the error otherwise
    elif not bool(input_values_status(species, coords)):
        return  # (both checks in one read of the device; the wording below reads again, on error only)
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


def input_values_status(species: Tensor, coords: Tensor) -> Tensor:
    """False (a 0-dim bool device tensor) where :func:`check_input_values` passes, True
    where it raises; computed on the device without reading anything back."""
    return ((species < -1) | ((~torch.isfinite(coords.detach()).all(-1)) & (species >= 0))).any()


def check_neighbors(elem_idxs: Tensor, neighbors: tp.Tuple[Tensor, Tensor, Tensor]) -> None:
    """Validate a neighbour list handed to ``compute_from_neighbors``: indices (2, P)
    into the M * A flattened atoms, distances (P,) and pair vectors (P, 3), finite.

    The kernels read a negative index as an unused slot of a padded list and a
    NaN pair as one beyond the cutoff, so without this a bad list gives a number.
    One reduction per tensor and one host read when the list is good.
    """
    indices, distances, diff = neighbors[0], neighbors[1], neighbors[2]
    if indices.dim() != 2 or indices.shape[0] != 2:
        raise ValueError("neighbors.indices must have shape (2, pairs), got {}".format(list(indices.shape)))
    num_pairs = indices.shape[1]
    if distances.shape != (num_pairs,) or diff.shape != (num_pairs, 3):
        raise ValueError("neighbors.distances and diff_vectors must have shapes ({},) and ({}, 3) for {} "
                         "pairs, got {} and {}".format(num_pairs, num_pairs, num_pairs,
                                                       list(distances.shape), list(diff.shape)))
    if torch.compiler.is_compiling():
        return  # traced: the list's length and values are data (the model's own search made it)
    if num_pairs == 0:
        return
    num_atoms = elem_idxs.numel()
    bad = (indices.min() < 0) | (indices.max() >= num_atoms) | ~torch.isfinite(distances.detach().sum() + diff.detach().sum())
    if not bool(bad):
        return
    outside = (indices < 0) | (indices >= num_atoms)
    if bool(outside.any()):
        p = _first(outside.any(0))
        pair: tp.List[int] = indices[:, p].tolist()
        raise ValueError("neighbors.indices must index the {} flattened atoms (0 to {}), got pair {} = {}".format(
            num_atoms, num_atoms - 1, p, pair))
    nonfinite = ~torch.isfinite(diff.detach()).all(-1) | ~torch.isfinite(distances.detach())
    if bool(nonfinite.any()):
        p = _first(nonfinite)
        vector: tp.List[float] = diff[p].detach().tolist()
        raise ValueError("neighbors must be finite, got distance {} and diff_vector {} at pair {}".format(
            float(distances[p]), vector, p))
    # (finite values whose sum overflowed: nothing wrong)


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
        if host_path(cell) and pbc is not None and ops.valid_cell(cell.detach(), pbc):
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
    Made by :func:`torchani_fast.patch` (a class swap) (the ``conv_tensor`` buffer, and so the state
    dict, is unchanged).
    """

    symbols_table: tp.List[str]

    def _init_patched(self) -> None:
        """What the class swap (:mod:`torchani_fast.patch`) adds to TorchANI's converter."""
        self.symbols_table = list(PERIODIC_TABLE)

    def _supported(self) -> str:
        return _supported(self.conv_tensor, self.symbols_table)

    def forward(self, atomic_nums: Tensor, nop: bool = False, _dont_use: bool = False) -> Tensor:
        conv = self.conv_tensor
        if torch.compiler.is_compiling():
            # Traced: the checking op raises the errors of check_species_values when the
            # graph runs; the indexing is kept in bounds until then.
            ops.check_species_values(atomic_nums, conv, nop)
            return atomic_nums if nop else conv[atomic_nums.clamp(-1, conv.shape[0] - 1)]
        if not nop and host_path(atomic_nums) and conv.dtype == torch.long and (
                atomic_nums.dtype == torch.long or atomic_nums.dtype == torch.int):
            elem_idxs, invalid = ops.convert_species(atomic_nums, conv)
            if invalid < 0:
                return elem_idxs  # else the checks below word the error
        check_species_values(atomic_nums, conv, nop, self.symbols_table)
        return atomic_nums if nop else conv[atomic_nums]

    @torch.jit.export
    def converted(self, atomic_nums: Tensor, nop: bool = False) -> tp.Tuple[Tensor, Tensor]:
        """The element indices and, instead of the checks of :meth:`forward`, their
        status: a 0-dim bool tensor, False where ``forward`` would pass and True where
        it would raise (then the indices are meaningless: call ``forward`` for the
        error). Nothing is read back to the host."""
        conv = self.conv_tensor
        if nop:  # element indices given directly
            bad = (atomic_nums < -1) | (atomic_nums >= (conv >= 0).sum())
            return atomic_nums, bad.any()
        outside = (atomic_nums < -1) | (atomic_nums >= conv.shape[0] - 1)
        elem_idxs = conv[atomic_nums.clamp(-1, conv.shape[0] - 1)]
        return elem_idxs, (outside | ((elem_idxs < 0) & (atomic_nums >= 0))).any()


def _supported(conv: Tensor, symbols: tp.List[str]) -> str:
    # In the model's element order (H, C, N, O, S, F, Cl for ANI-2x).
    names: tp.List[str] = []
    for k in range(int((conv >= 0).sum())):
        names.append(symbols[int((conv == k).nonzero()[0, 0])])
    return ", ".join(names)


def check_species_values(atomic_nums: Tensor, conv: Tensor, element_indices: bool,
                         symbols: tp.List[str]) -> None:
    """Raise for species that :class:`SpeciesConverter` (table ``conv``) cannot convert:
    element indices outside [-1, elements) (``element_indices``), else atomic numbers
    outside 1-118 and -1 or of elements the model lacks. ``symbols``: the periodic table
    (``list(PERIODIC_TABLE)``)."""
    if element_indices:  # element indices given directly (periodic_table_index=False)
        n = int((conv >= 0).sum())
        bad = (atomic_nums < -1) | (atomic_nums >= n)
        if bool(bad.any()):
            i = _first(bad)
            raise ValueError(
                "species must be element indices in [-1, {}) for this model (-1 is padding), "
                "got {} at {}".format(n, int(atomic_nums.reshape(-1)[i]), _where(i, atomic_nums.shape[-1])))
        return
    outside = (atomic_nums < -1) | (atomic_nums >= conv.shape[0] - 1)
    elem_idxs = conv[atomic_nums.clamp(-1, conv.shape[0] - 1)]
    bad = (elem_idxs < 0) & (atomic_nums >= 0)
    if not bool((outside | bad).any()):  # both checks in one read of the device
        return
    if bool(outside.any()):
        i = _first(outside)
        raise ValueError("species must be atomic numbers (1-118) or -1 for padding, got {} at {}".format(
            int(atomic_nums.reshape(-1)[i]), _where(i, atomic_nums.shape[-1])))
    if bool(bad.any()):
        i = _first(bad)
        z = int(atomic_nums.reshape(-1)[i])
        raise ValueError("unsupported element {} (atomic number {}) at {}; this model supports {}".format(
            symbols[z], z, _where(i, atomic_nums.shape[-1]), _supported(conv, symbols)))


# -- one place that decides whether a cell is usable ---------------------------------------
# Real matter has at most ~0.2 atoms per Å³ (diamond 0.18, water 0.10), so within
# ANI's 5.2 Å cutoff an atom has ~60-120 neighbours. A cell given in nm (or a
# box far smaller than any real one) packs 10³ times more atoms per volume: the
# pair list and the AEV's pair-of-pairs then grow to gigabytes and minutes. The
# limits below are 25x past any real density and 10x inside the C++ search's
# own limit (1e6 visited images), so they refuse only such cells.
# (TorchScript reads no module globals: the defaults of check_periodic_work repeat them.)
MAX_NEIGHBORS_PER_ATOM = 3000.0
MAX_PERIODIC_IMAGES = 1e5


def _num(x: float) -> str:
    # TorchScript's str.format has no format specs: 3 decimals, or a whole number.
    if x >= 100.0:
        return str(int(x + 0.5))
    return str(float(int(x * 1000.0 + 0.5)) / 1000.0)


def check_periodic_work(species: Tensor, coords: Tensor, cell: tp.Optional[Tensor],
                        pbc: tp.Optional[Tensor], cutoff: float, values: bool = True,
                        max_images: float = MAX_PERIODIC_IMAGES, max_neighbors: float = MAX_NEIGHBORS_PER_ATOM) -> None:
    """Whether ``cell``/``pbc`` can describe a periodic system at ``cutoff``; raise if not.

    The single cell check of torchani_fast, used by the model's neighbour list,
    :class:`~torchani_fast.step.EnergyForcesStep`, the ASE calculator and the
    CLI. In order it refuses: what :func:`check_cell_pbc` refuses (shapes,
    dtypes, devices, a cell without pbc and the reverse); a non-finite cell; a
    periodic axis whose lattice vector is zero (ASE's default cell with
    ``pbc=True``); a singular cell; and a cell whose neighbour search would be
    unbounded work: more than ``max_images`` periodic images within
    the cutoff, or more than ``max_neighbors`` expected neighbours
    per atom (the atoms of the densest molecule over the cell's volume; along
    non-periodic axes the atoms' own extent, at least the cutoff's diameter).
    The last two suggest the usual cause, a cell or coordinates in nm or bohr.

    Parameters
    ----------
    species : Tensor (M, A)
        Atomic numbers or element indices; -1 marks padding (not counted).
    coords : Tensor (M, A, 3)
        Positions in Å.
    cell, pbc : Tensor, optional
        (3, 3) lattice vectors (rows) in Å and (3,) bool, as for the model.
    cutoff : float
        The model's neighbour cutoff in Å.
    values : bool
        False checks only shapes, dtypes and devices (reads no data: no host
        synchronisation, so CUDA graphs can capture the caller).
    max_images, max_neighbors : float
        The work limits (``MAX_PERIODIC_IMAGES``, ``MAX_NEIGHBORS_PER_ATOM``).
    """
    check_cell_pbc(coords, cell, pbc, values=False)
    if cell is None or pbc is None or not values:
        return
    if torch.compiler.is_compiling():
        # Traced: the checking op runs this function on the values when the graph runs.
        ops.check_cell_values(species, coords.detach(), cell.detach(), pbc, cutoff)
        return
    if not host_path(cell) and not bool(_cell_status(species, cell.detach(), pbc, cutoff, max_images,
                                                     max_neighbors)):
        return  # (one read of the device: the checks below word an error, or find nothing)
    # One C++ op says whether the cell is finite and non-singular (most calls);
    # otherwise the element-wise checks below word the error.
    if not (host_path(cell) and bool(ops.valid_cell(cell.detach(), pbc))):
        _check_cell_values(coords, cell, pbc)
    periodic: tp.List[bool] = pbc.tolist()
    if not (periodic[0] or periodic[1] or periodic[2]):
        return
    rows: tp.List[tp.List[float]] = cell.detach().double().tolist()
    # Distances between lattice planes: h_a = volume / |b x c|.
    crosses: tp.List[tp.List[float]] = []
    for a in range(3):
        u = rows[(a + 1) % 3]
        v = rows[(a + 2) % 3]
        crosses.append([u[1] * v[2] - u[2] * v[1], u[2] * v[0] - u[0] * v[2], u[0] * v[1] - u[1] * v[0]])
    volume = abs(rows[0][0] * crosses[0][0] + rows[0][1] * crosses[0][1] + rows[0][2] * crosses[0][2])
    images = 1.0
    fractions: tp.List[float] = [1.0, 1.0, 1.0]  # the searched volume over the cell's, per axis
    for a in range(3):
        area = (crosses[a][0] ** 2 + crosses[a][1] ** 2 + crosses[a][2] ** 2) ** 0.5
        spacing = volume / area
        if periodic[a]:
            images *= 2.0 * float(int(cutoff / spacing) + 1) + 1.0
        else:
            fractions[a] = 2.0 * cutoff / spacing
    if images > max_images:
        raise ValueError(
            "cell is too small for the cutoff ({} Å): the neighbour search would visit {} "
            "periodic images (the limit is {}); cell {}. Is the cell in nm or bohr instead "
            "of Å?".format(cutoff, _num(images), _num(max_images), rows))
    sphere = 4.0 / 3.0 * 3.141592653589793 * cutoff ** 3
    # First an upper bound that reads no data: every slot a real atom, and
    # along non-periodic axes all atoms within the cutoff's diameter.
    atoms = species.shape[1]
    searched = volume * fractions[0] * fractions[1] * fractions[2]
    if atoms * sphere / searched <= max_neighbors:
        return
    real = species >= 0
    atoms = int(real.sum(1).max())
    if not (periodic[0] and periodic[1] and periodic[2]):
        # Along a non-periodic axis the atoms occupy their own extent (in units
        # of the lattice vector; at least the cutoff's diameter).
        frac = coords.detach().double() @ torch.linalg.inv(cell.detach().double())
        for a in range(3):
            if not periodic[a]:
                column = frac[:, :, a]
                big = torch.where(real, column, torch.full_like(column, -1e300)).max(1).values
                small = torch.where(real, column, torch.full_like(column, 1e300)).min(1).values
                fractions[a] = max(fractions[a], float((big - small).max()))
    searched = volume * fractions[0] * fractions[1] * fractions[2]
    neighbors = atoms * sphere / searched
    if neighbors > max_neighbors:
        raise ValueError(
            "cell is too small for its atoms: {} atoms in {} Å³ give about {} neighbours "
            "per atom within the {} Å cutoff (real matter has at most ~150; the limit is {}). "
            "Is the cell (or are the coordinates) in nm or bohr instead of Å? cell {}".format(
                atoms, _num(searched), _num(neighbors), cutoff, _num(max_neighbors), rows))


def cell_status(species: Tensor, coords: Tensor, cell: tp.Optional[Tensor], pbc: tp.Optional[Tensor],
                cutoff: float) -> tp.Optional[Tensor]:
    """:func:`check_periodic_work`'s checks that read no data, raised here; the rest as a
    status on the device (0-dim bool: False where it passes without looking at the
    atoms' extents, True where it may raise), None without a cell. Nothing is read
    back to the host."""
    check_cell_pbc(coords, cell, pbc, values=False)
    if cell is None or pbc is None:
        return None
    return _cell_status(species, cell.detach(), pbc, cutoff)  # (the default limits)


def _cell_status(species: Tensor, cell: Tensor, pbc: Tensor, cutoff: float,
                 max_images: float = MAX_PERIODIC_IMAGES, max_neighbors: float = MAX_NEIGHBORS_PER_ATOM) -> Tensor:
    """False (a 0-dim bool device tensor) where :func:`check_periodic_work` would pass ``cell``
    without looking at the atoms' extents; True where it may raise: a non-finite
    cell, a zero periodic lattice vector, a singular cell, too many images, or
    more neighbours per atom than ``max_neighbors`` by the bound that counts every
    slot as an atom. Computed on the device: reading it is the check's one sync."""
    rows = cell.double()
    lengths = rows.pow(2).sum(1).sqrt()
    crosses = torch.linalg.cross(rows.roll(-1, 0), rows.roll(-2, 0))  # row a: b x c
    det = (rows[0] * crosses[0]).sum()
    volume = det.abs()
    spacing = volume / crosses.pow(2).sum(1).sqrt()
    images = torch.where(pbc, 2.0 * (torch.floor(spacing.reciprocal() * cutoff) + 1.0) + 1.0,
                         torch.ones_like(spacing)).prod()
    fractions = torch.where(pbc, torch.ones_like(spacing), spacing.reciprocal() * (2.0 * cutoff))
    sphere = 4.0 / 3.0 * 3.141592653589793 * cutoff ** 3
    neighbors = (volume * fractions.prod()).reciprocal() * (species.shape[1] * sphere)
    bad = ~torch.isfinite(rows).all()
    any_periodic = pbc.any()
    bad = bad | (pbc & ~(lengths > 0.0)).any()
    bad = bad | (any_periodic & ~(volume > 1e-8 * lengths.prod()))
    bad = bad | (any_periodic & ~(images <= max_images)) | (any_periodic & ~(neighbors <= max_neighbors))
    return bad


def _check_cell_values(coords: Tensor, cell: Tensor, pbc: Tensor) -> None:
    """The element-wise cell checks, in the order of their messages."""
    if not bool(pbc.any()):
        check_cell_pbc(coords, cell, pbc, values=True)
        return
    rows: tp.List[tp.List[float]] = cell.detach().double().tolist()
    periodic: tp.List[bool] = pbc.tolist()
    if not bool(torch.isfinite(cell).all()):
        raise ValueError("cell must be finite, got {}".format(rows))
    for a in range(3):
        length = (rows[a][0] ** 2 + rows[a][1] ** 2 + rows[a][2] ** 2) ** 0.5
        if periodic[a] and not length > 0.0:
            raise ValueError(
                "pbc is True along axis {} but the cell's lattice vector {} is zero (cell {}): "
                "give the periodic cell in Å (ASE: atoms.cell = ..., or atoms.pbc = False for "
                "a molecule)".format(a, a, rows))
    check_cell_pbc(coords, cell, pbc, values=True)  # singular cells


# -- one element check ---------------------------------------------------------------------
def check_elements(numbers: tp.Sequence[int], supported: tp.Sequence[int], model: str = "the model",
                   where: str = "") -> None:
    """Raise ``ValueError`` naming the first atom whose element ``model`` does not cover.

    The one element check of the front ends (ASE calculator, CLI); the model
    itself checks again through :class:`SpeciesConverter`.

    Parameters
    ----------
    numbers : sequence of int
        Atomic numbers, one per atom (ASE's ``atoms.numbers``).
    supported : sequence of int
        The atomic numbers the model covers (``model.atomic_numbers``).
    model : str
        The model's name, for the message.
    where : str
        Prefix naming the structure ("water.xyz, frame 3"), for the message.
    """
    allowed = set(int(z) for z in supported)
    for j, z in enumerate(numbers):
        if int(z) not in allowed:
            def name(n: int) -> str:
                return PERIODIC_TABLE[n] if 0 <= n < len(PERIODIC_TABLE) else "#{}".format(n)

            covers = " ".join(name(k) for k in sorted(allowed))
            raise ValueError("{}element {} (atomic number {}) at atom {} (counting from 0) is not "
                             "supported by {}, which covers {}".format(
                                 where + ": " if where else "", name(int(z)), int(z), j, model, covers))


# -- the checks as ops, for traced graphs (torch.compile, torch.export) ---------------------
# Called through ops.check_*_values under torch.compiler.is_compiling(): ops with no output,
# kept in the graph (side-effectful), that read the real values when the graph runs and
# raise the eager error; their fakes do nothing.
@torch.library.custom_op("torchani_fast::check_input_values", mutates_args=())
def _check_input_values_op(species: Tensor, coords: Tensor) -> None:
    """Raise the eager error for species < -1 or non-finite coordinates of real atoms."""
    check_input_values(species, coords)


@torch.library.custom_op("torchani_fast::check_species_values", mutates_args=())
def _check_species_values_op(atomic_nums: Tensor, conv: Tensor, element_indices: bool) -> None:
    """Raise the eager error for an unknown or unsupported element (SpeciesConverter)."""
    check_species_values(atomic_nums, conv, element_indices, list(PERIODIC_TABLE))


@torch.library.custom_op("torchani_fast::check_cell_values", mutates_args=())
def _check_cell_values_op(species: Tensor, coords: Tensor, cell: Tensor, pbc: Tensor,
                       cutoff: float) -> None:
    """Raise the eager error for a non-finite, singular or too small cell (check_periodic_work)."""
    check_periodic_work(species, coords, cell, pbc, cutoff, values=True)


for _check in (_check_input_values_op, _check_species_values_op, _check_cell_values_op):
    _check.register_fake(lambda *args: None)
    torch.fx.node.has_side_effect(_check._opoverload)
