"""Lists of ASE structures as model input: what the command line and the screening driver share.

``torchani-fast energy|optimize`` (:mod:`torchani_fast.cli`) and
:func:`torchani_fast.screen` (the same commands on Dask workers) check, batch and
evaluate structures with these functions, so that a structure gets the same
error message and the same bits either way:

- :data:`MODEL_NAMES`, :func:`elements`, :data:`CUTOFFS`: the models by name and
  what is known of them before their weights are loaded;
- :func:`parse_index`, :func:`select_frames`, :func:`read_frames`: the one reader of
  structure files and frame selections (the command line's and screening's);
- :func:`check_structure`: the elements, finite positions and a usable cell;
- :func:`batch_key` and :func:`plan_batches`: which structures share a padded call;
- :func:`evaluate_batch` and :func:`batch_results`: one call and its per-structure results;
- :func:`optimizer_class`, :func:`ase_optimizer`, :func:`frozen_copy`, :func:`progress`:
  the optimisation and reporting pieces.
"""
import math
import sys
import typing as tp

from .. import core, grad, registry

__all__ = ["MODEL_NAMES", "CUTOFFS", "elements", "parse_index", "select_frames", "read_frames", "check_structure", "batch_key", "plan_batches",
           "evaluate_batch", "batch_results", "optimizer_class", "ase_optimizer", "frozen_copy",
           "progress"]

#: The models' names in lower case -> as spelled by the registry (:mod:`torchani_fast.registry`).
MODEL_NAMES = {spec.name.lower(): spec.name for spec in registry.MODELS}

#: The models' neighbour cutoffs (Å): the largest of their potentials, for the cell
#: check before the model is loaded.
CUTOFFS = {spec.name: spec.cutoff for spec in registry.MODELS}


def elements(name: str) -> tp.Tuple[str, ...]:
    """The element symbols model ``name`` covers (known without loading it)."""
    return registry.by_name(name).elements


def parse_index(index: str):
    """``ase.io.read``'s frame selection (int or slice) of ``index`` ("3", "-1", ":",
    "::10"); ``ValueError`` for anything else, a zero step included."""
    from ase.io.formats import string2index

    try:
        selection = string2index(index)
    except (ValueError, TypeError):
        selection = None
    if selection is None or (isinstance(selection, slice) and selection.step == 0) \
            or not isinstance(selection, (int, slice)):
        raise ValueError(f"invalid frame index {index!r}; use e.g. 0, -1, :, 2:5 or ::10")
    return selection


def select_frames(name, count: int, index: str) -> tp.List[int]:
    """The frame numbers (from 0) that ``index`` selects of ``count`` frames of
    ``name``; ``ValueError`` naming it when the selection is out of range or empty."""
    selection = parse_index(index)
    numbers = list(range(count))
    if isinstance(selection, int):
        if not -count <= selection < count:
            raise ValueError(f"{name}: has {count} frame(s), no frame {selection}")
        numbers = [numbers[selection]]
    else:
        numbers = numbers[selection]
    if not numbers:
        raise ValueError(f"{name}: no structures (frames {index!r} of {count})")
    return numbers


def read_frames(path, index: str = ":") -> list:
    """``[(frame, atoms)]``: the frames of the structure file ``path`` (any format
    ASE reads) that ``index`` selects, numbered from 0 in the file; ``ValueError``
    naming the file when it is missing, unreadable or the selection empty."""
    import ase.io
    from pathlib import Path

    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file")
    parse_index(index)  # (a bad index is named before the file is read)
    try:
        frames = ase.io.read(str(path), index=":")
    except Exception as exc:
        raise ValueError(f"{path}: cannot be read by ASE ({type(exc).__name__}: {exc})") from exc
    frames = frames if isinstance(frames, list) else [frames]
    return [(k, frames[k]) for k in select_frames(path, len(frames), index)]


def check_structure(name: str, where: str, atoms) -> None:
    """``ValueError`` starting with ``where`` ("file.xyz, frame 3") if model ``name``
    cannot evaluate ``atoms``: no atoms, an element it does not cover
    (:func:`torchani_fast.validation.check_elements`' message), non-finite
    positions, or a cell the model refuses (a periodic system for a model
    without cutoff, a zero or singular cell, one in nm)."""
    import numpy as np
    import torch
    from ase.data import atomic_numbers

    from .ase import periodic_cell
    from ..validation import check_elements, check_periodic_work

    if len(atoms) == 0:
        raise ValueError(f"{where}: no atoms")
    check_elements(atoms.numbers, [atomic_numbers[s] for s in elements(name)], name, where=where)
    finite = np.isfinite(atoms.positions).all(axis=1)
    if not finite.all():
        j = int(np.flatnonzero(~finite)[0])
        raise ValueError(f"{where}: atom {j} has non-finite coordinates {atoms.positions[j].tolist()}")
    if atoms.pbc.any():
        if math.isinf(CUTOFFS[name]):
            raise ValueError(f"{where}: {name} has a repulsion without cutoff, which is not defined "
                             f"for periodic systems (pbc={atoms.pbc.tolist()})")
        species = torch.as_tensor(atoms.numbers).unsqueeze(0)
        coords = torch.as_tensor(atoms.positions, dtype=torch.float64).unsqueeze(0)
        cell = torch.as_tensor(periodic_cell(atoms), dtype=torch.float64)
        try:
            check_periodic_work(species, coords, cell, torch.as_tensor(atoms.pbc), CUTOFFS[name])
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


def batch_key(atoms) -> tuple:
    """Structures with equal keys (pbc and, if periodic, the cell) may share a call:
    the model takes one cell per batch, as TorchANI does."""
    return (tuple(bool(p) for p in atoms.pbc),
            atoms.cell.array.tobytes() if atoms.pbc.any() else b"")


def plan_batches(sizes: tp.Sequence[int], keys: tp.Sequence[tp.Hashable], batch_size: int,
                 max_slots: int = 32768) -> tp.List[tp.List[int]]:
    """Indices of the structures evaluated together, one padded model call each.

    Structures share a call when their keys (:func:`batch_key`) are equal, in
    the order the keys first appear. Within a key they are sorted by size
    (stably), so little padding is needed, and a batch holds at most
    ``batch_size`` structures and ``max_slots`` padded atoms. A key of ``None``
    leaves the structure out (the screening driver's unreadable frames).
    """
    groups: dict = {}
    for i, key in enumerate(keys):
        if key is not None:
            groups.setdefault(key, []).append(i)
    batches = []
    for idxs in groups.values():
        idxs.sort(key=lambda i: sizes[i])
        batch: tp.List[int] = []
        for i in idxs:
            size = sizes[i]  # the largest so far, as sizes ascend
            if batch and (len(batch) >= batch_size or (len(batch) + 1) * size > max_slots):
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
    return batches


def evaluate_batch(model, batch: list, forces: bool, hessians: bool):
    """Energies (M,), forces (M, A, 3) or None and Hessians (M, 3A, 3A) or None of a
    batch of ASE Atoms (padded to the largest, one cell and pbc for all), on the
    model's device and dtype, through :func:`torchani_fast.core.energies_forces`
    (or ``energies_forces_hessians``; energies only: one forward pass without
    gradients). Raises ``NotImplementedError`` when the model has no Hessians."""
    import torch

    from .ase import periodic_cell

    ref = core.model_float(model)
    amax = max(len(a) for a in batch)
    species = torch.full((len(batch), amax), -1, dtype=torch.long)
    coords = torch.zeros((len(batch), amax, 3), dtype=torch.float64)
    for k, a in enumerate(batch):
        species[k, :len(a)] = torch.from_numpy(a.numbers)
        coords[k, :len(a)] = torch.from_numpy(a.positions)
    species = species.to(ref.device)
    first = batch[0]
    cell = pbc = None
    if first.pbc.any():
        cell = torch.tensor(periodic_cell(first), dtype=ref.dtype, device=ref.device)
        pbc = torch.tensor(first.pbc, dtype=torch.bool, device=ref.device)
    if hessians:
        e, f, h = grad.energies_forces_hessians(model, species, coords, cell, pbc)
    elif forces:
        e, f = core.energies_forces(model, species, coords, cell, pbc)
        h = None
    else:  # energies only: no backward pass
        with torch.no_grad():
            x = coords.to(device=ref.device, dtype=ref.dtype)
            e = model((species, x), cell=cell, pbc=pbc).energies
        f = h = None
    return e, f, h


def batch_results(batch: list, e, f, h) -> tp.List[dict]:
    """One dict per structure of ``batch`` from :func:`evaluate_batch`'s tensors:
    ``energy`` (float, Ha), and where computed ``forces`` (A x 3 lists, Ha/Å) and
    ``hessians`` (3A x 3A lists), without the padding atoms."""
    e = e.cpu().double()
    f = None if f is None else f.cpu().double()
    out = []
    for k, atoms in enumerate(batch):
        a = len(atoms)
        rec: dict = {"energy": float(e[k])}
        if f is not None:
            rec["forces"] = f[k, :a].tolist()
        if h is not None:
            rec["hessians"] = h[k, :3 * a, :3 * a].cpu().double().tolist()
        out.append(rec)
    return out


def optimizer_class(name: str):
    """ASE's optimiser class for ``name`` (BFGS, LBFGS or FIRE)."""
    import ase.optimize

    return {"BFGS": ase.optimize.BFGS, "LBFGS": ase.optimize.LBFGS, "FIRE": ase.optimize.FIRE}[name]


def ase_optimizer(name: str, atoms, hessian: str = "lindh", **kwargs):
    """ASE's optimiser ``name`` on ``atoms``; BFGS starts from Lindh's model Hessian
    when ``hessian`` is ``"lindh"``, as :class:`torchani_fast.batched.BFGS` does
    (``"ase"``: ASE's own start, 70 eV/Å² x identity)."""
    opt = optimizer_class(name)(atoms, **kwargs)
    if name == "BFGS" and hessian == "lindh":
        import torch

        from .model_hessian import lindh_hessian

        numbers = torch.as_tensor(atoms.numbers, dtype=torch.long)[None]
        positions = torch.as_tensor(atoms.positions, dtype=torch.float64)[None]
        opt.H0 = lindh_hessian(numbers, positions)[0].numpy()
    return opt


def frozen_copy(atoms, results: dict):
    """A copy of ``atoms`` carrying ``results`` (what extended XYZ writes)."""
    from ase.calculators.singlepoint import SinglePointCalculator

    out = atoms.copy()
    out.calc = SinglePointCalculator(out, **{k: results[k] for k in ("energy", "forces", "stress")
                                             if k in results})
    return out


def progress(iterable=None, **kwargs):
    """A tqdm progress bar on stderr."""
    from tqdm.auto import tqdm

    kwargs.setdefault("file", sys.stderr)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **kwargs)
