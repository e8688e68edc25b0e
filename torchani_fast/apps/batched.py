"""Many molecules at once: padded evaluation and batched geometry optimisation.

Conformer screening relaxes thousands of small molecules. One model call per
molecule per step (ASE's optimisers) pays the per-call work of the model and
ASE's Python for each of them; here every molecule in flight shares one padded
call per step, and the optimisers keep their per-molecule state in tensors:

- :func:`pack` and :func:`energies_forces`: structures of any sizes and
  elements as flat atoms plus a molecule index (the layout torch-sim uses),
  evaluated in one padded model call per distinct cell (energies per molecule,
  forces per atom; no Python per molecule);
- :class:`BFGS`, :class:`LBFGS` and :class:`FIRE`: ASE's optimisers of those
  names, step for step, on a batch (each molecule has its own Hessian,
  history, velocities, time step);
- :func:`optimize` and :func:`iter_optimize`: relax a list of structures
  until ASE's criterion holds (largest atomic force < ``fmax`` eV/Å) or
  ``steps`` steps; molecules that finish leave the batch and waiting ones take
  their place, up to ``max_atoms`` padded atoms per call (in-flight batching).
  A structure that cannot be relaxed (an element the model lacks, non-finite
  positions, energies or forces, forces beyond ``fail_fmax``) is reported in
  its result and the others go on.

>>> relaxed = torchani_fast.batched.optimize(model, conformers, fmax=0.01)
>>> relaxed[0].energy, relaxed[0].steps, relaxed[0].converged     # doctest: +SKIP
"""
import dataclasses
import math
import typing as tp

import numpy as np
import torch
from torch import Tensor

from .. import core
from .model_hessian import lindh_hessian

__all__ = ["Packed", "pack", "pad", "energies_forces", "BFGS", "FIRE", "LBFGS", "OPTIMIZERS", "Relaxed",
           "named_optimizer", "optimize", "iter_optimize"]


def _hartree() -> float:
    import ase.units

    return float(ase.units.Hartree)  # what torchani_fast's ASE calculator multiplies by


# ---------------------------------------------------------------- evaluation
class Packed(tp.NamedTuple):
    """Molecules as flat atoms: ``numbers`` (N,) long, ``positions`` (N, 3) float64
    in Å, ``system_idx`` (N,) long (which molecule, ascending), ``cell`` (S, 3, 3)
    in Å or None and ``pbc`` (S, 3) bool or None."""

    numbers: Tensor
    positions: Tensor
    system_idx: Tensor
    cell: tp.Optional[Tensor]
    pbc: tp.Optional[Tensor]


def pack(structures: tp.Sequence) -> Packed:
    """:class:`Packed` of a list of ASE ``Atoms`` (cells and pbc kept when any is periodic)."""
    from .ase import periodic_cell

    if len(structures) == 0:
        raise ValueError("structures is empty: give at least one ase.Atoms")
    sizes = [len(a) for a in structures]
    numbers = torch.from_numpy(np.concatenate([a.numbers for a in structures]).astype(np.int64))
    positions = torch.from_numpy(np.concatenate([a.positions for a in structures]).astype(np.float64))
    system_idx = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    cell = pbc = None
    if any(a.pbc.any() for a in structures):
        cell = torch.from_numpy(np.stack([periodic_cell(a) if a.pbc.any() else np.zeros((3, 3))
                                          for a in structures]).astype(np.float64))
        pbc = torch.from_numpy(np.stack([a.pbc for a in structures]).astype(bool))
    return Packed(numbers, positions, system_idx, cell, pbc)


def pad(numbers: Tensor, positions: Tensor, system_idx: Tensor,
        num_systems: tp.Optional[int] = None) -> tp.Tuple[Tensor, Tensor, Tensor]:
    """Species (S, A) with -1 padding, coordinates (S, A, 3) with zeros, and each
    atom's column (N,): ``species[system_idx, column] == numbers``. A is the
    largest molecule; molecules keep their atoms' order. Tensor ops only."""
    if system_idx.numel() and bool((system_idx[1:] < system_idx[:-1]).any()):
        raise ValueError("system_idx must be ascending (each molecule's atoms together)")
    if num_systems is None:
        num_systems = int(system_idx[-1]) + 1 if system_idx.numel() else 0
    counts = torch.bincount(system_idx, minlength=num_systems)
    starts = torch.cumsum(counts, 0) - counts
    column = torch.arange(system_idx.numel(), device=system_idx.device) - starts[system_idx]
    width = int(counts.max()) if num_systems else 0
    species = numbers.new_full((num_systems, width), -1)
    species[system_idx, column] = numbers
    coords = positions.new_zeros((num_systems, width, 3))
    coords[system_idx, column] = positions
    return species, coords, column


def energies_forces(model: torch.nn.Module, numbers: Tensor, positions: Tensor, system_idx: Tensor,
                    cell: tp.Optional[Tensor] = None, pbc: tp.Optional[Tensor] = None,
                    num_systems: tp.Optional[int] = None) -> core.EnergiesForces:
    """Energies (S,) in Hartree and forces (N, 3) in Hartree/Å of many molecules.

    Parameters
    ----------
    model : torchani.arch.ANI
        A TorchANI model, patched (:func:`torchani_fast.patch`) or not.
    numbers, positions, system_idx : Tensor
        (N,) atomic numbers, (N, 3) positions in Å and (N,) molecule index
        (ascending; molecules of any sizes and elements), as :func:`pack` makes.
    cell : Tensor, optional
        (S, 3, 3) or (3, 3) lattice vectors (rows) in Å; molecules whose cell
        and pbc are equal share a call (the model takes one cell per call).
    pbc : Tensor, optional
        (S, 3) or (3,) bool; ``None`` (or all false) for molecules in vacuum.
    num_systems : int, optional
        S, if some molecules at the end have no atoms (else from ``system_idx``).

    Returns
    -------
    EnergiesForces
        ``energies`` (S,) and ``forces`` (N, 3), detached, in the model's dtype
        and on its device. Each equals the molecule evaluated alone, up to the
        order of floating-point sums.
    """
    core.require_tensors(numbers=numbers, positions=positions, system_idx=system_idx,
                             cell=cell, pbc=pbc)
    if positions.shape != (numbers.shape[0], 3) or system_idx.shape != numbers.shape:
        raise ValueError(f"numbers (N,), positions (N, 3) and system_idx (N,) must agree, got "
                         f"{tuple(numbers.shape)}, {tuple(positions.shape)}, {tuple(system_idx.shape)}")
    ref = core.model_float(model)
    species, coords, column = pad(numbers, positions, system_idx, num_systems)
    count = species.shape[0]
    if pbc is not None and not bool(pbc.any()):
        cell = pbc = None
    if cell is None:
        e, f = core.energies_forces(model, species, coords)
        return core.EnergiesForces(e, f[system_idx.to(f.device), column.to(f.device)])
    cell = cell.expand(count, 3, 3) if cell.dim() == 2 else cell
    pbc = pbc.expand(count, 3) if pbc.dim() == 1 else pbc
    # One call per distinct (cell, pbc): torch.unique over the rows, no loop over molecules.
    keys = torch.cat([cell.reshape(count, 9).to(torch.float64), pbc.to(torch.float64)], 1)
    unique, group = torch.unique(keys, dim=0, return_inverse=True)
    energies = torch.empty(count, dtype=ref.dtype, device=ref.device)
    forces = torch.empty((count, species.shape[1], 3), dtype=ref.dtype, device=ref.device)
    for g in range(unique.shape[0]):
        rows = (group == g).nonzero().squeeze(1)
        periodic = bool(unique[g, 9:].any())
        c = cell[rows[0]] if periodic else None
        p = pbc[rows[0]] if periodic else None
        e, f = core.energies_forces(model, species[rows], coords[rows], c, p)
        energies[rows.to(ref.device)] = e
        forces[rows.to(ref.device)] = f
    return core.EnergiesForces(energies, forces[system_idx.to(ref.device), column.to(ref.device)])


# ---------------------------------------------------------------- optimisers
def _norms(x: Tensor) -> Tensor:
    """sqrt(sum of squares) over the atoms and xyz of each molecule: (B, W, 3) -> (B,)."""
    return (x * x).sum((1, 2)).sqrt()


class _Optimizer:
    """What the relaxation loop needs of a batched optimiser: ``new_state``, ``step``,
    and the state's atom dimensions (:attr:`atom_dims`: name -> dimension), which
    :meth:`widen` pads and :meth:`narrow` cuts when the batch's widest molecule changes."""

    atom_dims: tp.Dict[str, int] = {}

    def widen(self, state: tp.Dict[str, Tensor], grow: int) -> None:
        for name, dim in self.atom_dims.items():
            state[name] = torch.nn.functional.pad(state[name], _pad_spec(state[name], dim, grow))

    def narrow(self, state: tp.Dict[str, Tensor], width: int) -> None:
        for name, dim in self.atom_dims.items():
            state[name] = state[name].narrow(dim, 0, width).contiguous()

    def admit(self, state: tp.Dict[str, Tensor], numbers: Tensor, positions: Tensor) -> None:
        """The last ``len(numbers)`` rows of ``state`` (from :meth:`new_state`) are
        molecules just admitted, with atomic numbers (-1: padding) and positions (Å)."""


class FIRE(_Optimizer):
    """ASE's FIRE (``ase.optimize.FIRE``, same defaults) for a batch: each molecule
    has its own velocity, time step, mixing and count of downhill steps.

    State (``new_state``) holds tensors whose first dimension is the molecule;
    :attr:`atom_dims` names those with an atom dimension (and which).
    """

    atom_dims = {"v": 1}

    def __init__(self, dt: float = 0.1, maxstep: float = 0.2, dtmax: float = 1.0, Nmin: int = 5,
                 finc: float = 1.1, fdec: float = 0.5, astart: float = 0.1, fa: float = 0.99,
                 a: float = 0.1):
        for name, value in dict(dt=dt, maxstep=maxstep, dtmax=dtmax, finc=finc, fdec=fdec).items():
            if not value > 0:
                raise ValueError(f"FIRE: {name} must be > 0, got {value}")
        self.dt, self.maxstep, self.dtmax, self.Nmin = dt, maxstep, dtmax, Nmin
        self.finc, self.fdec, self.astart, self.fa, self.a = finc, fdec, astart, fa, a

    def new_state(self, count: int, width: int, like: Tensor) -> tp.Dict[str, Tensor]:
        return {"v": like.new_zeros((count, width, 3)),
                "dt": like.new_full((count,), self.dt),
                "a": like.new_full((count,), self.a),
                "n": torch.zeros(count, dtype=torch.long, device=like.device),
                "started": torch.zeros(count, dtype=torch.bool, device=like.device)}

    def step(self, state: tp.Dict[str, Tensor], x: Tensor, f: Tensor) -> Tensor:
        """The displacement (B, W, 3) in Å from forces ``f`` (B, W, 3) in eV/Å;
        updates ``state`` in place (as ASE's ``FIRE.step``)."""
        v, dt, a, n, started = state["v"], state["dt"], state["a"], state["n"], state["started"]
        vf = (f * v).sum((1, 2))
        downhill = started & (vf > 0)
        reset = started & ~(vf > 0)
        fnorm = _norms(f)
        scale = torch.where(downhill, _norms(v) / torch.where(downhill, fnorm, 1.0), 0.0)
        ab = a[:, None, None]
        v = torch.where(downhill[:, None, None], (1.0 - ab) * v + ab * f * scale[:, None, None], v)
        v = torch.where(reset[:, None, None], 0.0, v)
        grow = downhill & (n > self.Nmin)
        dt = torch.where(grow, (dt * self.finc).clamp(max=self.dtmax), dt)
        a = torch.where(grow, a * self.fa, a)
        n = torch.where(downhill, n + 1, n)
        a = torch.where(reset, self.astart, a)
        dt = torch.where(reset, dt * self.fdec, dt)
        n = torch.where(reset, 0, n)
        v = v + dt[:, None, None] * f
        dr = dt[:, None, None] * v
        normdr = _norms(dr)
        dr = torch.where((normdr > self.maxstep)[:, None, None],
                         dr * (self.maxstep / normdr.clamp(min=self.maxstep))[:, None, None], dr)
        state.update(v=v, dt=dt, a=a, n=n, started=torch.ones_like(started))
        return dr


class LBFGS(_Optimizer):
    """ASE's LBFGS (``ase.optimize.LBFGS``, same defaults: ``memory`` 100,
    ``alpha`` 70 eV/Å², ``maxstep`` 0.2 Å, no line search) for a batch.

    Each molecule's last ``memory`` steps live in a ring shared by the batch
    (every molecule in flight steps once per call, so one write position
    serves all; a newcomer's empty slots weigh nothing), and the two-loop
    recursion runs over the ring for every molecule at once.
    """

    atom_dims = {"s": 2, "y": 2, "r0": 1, "f0": 1}

    def __init__(self, maxstep: float = 0.2, memory: int = 100, damping: float = 1.0,
                 alpha: float = 70.0):
        if not maxstep > 0:
            raise ValueError(f"LBFGS: maxstep must be > 0, got {maxstep}")
        if not (isinstance(memory, int) and memory >= 1):
            raise ValueError(f"LBFGS: memory must be an int >= 1, got {memory!r}")
        if not alpha > 0:
            raise ValueError(f"LBFGS: alpha must be > 0, got {alpha}")
        self.maxstep, self.memory, self.damping, self.H0 = maxstep, memory, damping, 1.0 / alpha
        self._head = -1  # the ring slot written last

    def new_state(self, count: int, width: int, like: Tensor) -> tp.Dict[str, Tensor]:
        m = self.memory
        return {"s": like.new_zeros((count, m, width, 3)), "y": like.new_zeros((count, m, width, 3)),
                "rho": like.new_zeros((count, m)), "r0": like.new_zeros((count, width, 3)),
                "f0": like.new_zeros((count, width, 3)),
                "it": torch.zeros(count, dtype=torch.long, device=like.device)}

    def step(self, state: tp.Dict[str, Tensor], x: Tensor, f: Tensor) -> Tensor:
        """The displacement (B, W, 3) in Å from positions ``x`` and forces ``f``
        (eV/Å); updates ``state`` in place (as ASE's ``LBFGS.step``)."""
        s, y, rho, it = state["s"], state["y"], state["rho"], state["it"]
        m = self.memory
        started = (it > 0)[:, None, None]
        s0 = torch.where(started, x - state["r0"], 0.0)
        y0 = torch.where(started, state["f0"] - f, 0.0)
        rho0 = 1.0 / (y0 * s0).sum((1, 2))
        rho0 = torch.where(started[:, 0, 0] & torch.isfinite(rho0), rho0, 0.0)
        self._head = head = (self._head + 1) % m
        s[:, head], y[:, head], rho[:, head] = s0, y0, rho0
        filled = min(m, int(it.max()) + 1) if it.numel() else 0
        slots = [(head - k) % m for k in range(filled)]  # newest first
        q = -f
        alphas = []
        for i in slots:
            ai = rho[:, i] * (s[:, i] * q).sum((1, 2))
            q = q - ai[:, None, None] * y[:, i]
            alphas.append(ai)
        z = self.H0 * q
        for i, ai in zip(reversed(slots), reversed(alphas)):
            b = rho[:, i] * (y[:, i] * z).sum((1, 2))
            z = z + s[:, i] * (ai - b)[:, None, None]
        p = -z
        longest = (p * p).sum(2).sqrt().amax(1)
        scale = torch.where(longest >= self.maxstep, self.maxstep / longest.clamp(min=self.maxstep), 1.0)
        dr = p * (scale * self.damping)[:, None, None]
        state.update(r0=x.clone(), f0=f.clone(), it=it + 1)
        return dr


class BFGS(_Optimizer):
    """BFGS for a batch: each molecule keeps its own (3A, 3A) Hessian, updated
    as ASE's ``ase.optimize.BFGS`` does (``maxstep`` 0.2 Å). ASE steps along
    ``V (V^T f / |w|)`` from the eigendecomposition ``H = V diag(w) V^T``; that is
    ``H^-1 f`` when ``H`` is positive definite, which is solved here by a batched
    Cholesky factorisation (an eigendecomposition only for the molecules whose
    ``H`` is not).

    ``hessian`` is the starting Hessian: ``"lindh"`` (default), Lindh's model
    Hessian of the starting geometry plus ``shift`` x identity
    (:func:`torchani_fast.apps.model_hessian.lindh_hessian`), which takes fewer
    steps on molecules (docs/batched.md); ``"ase"``, ASE's ``alpha`` x identity
    (70 eV/Å²): then every step is ASE's BFGS's.
    """

    atom_dims: tp.Dict[str, int] = {"r0": 1, "f0": 1}

    def __init__(self, maxstep: float = 0.2, alpha: float = 70.0, hessian: str = "lindh", shift: float = 10.0):
        if not maxstep > 0:
            raise ValueError(f"BFGS: maxstep must be > 0, got {maxstep}")
        if not alpha > 0:
            raise ValueError(f"BFGS: alpha must be > 0, got {alpha}")
        if hessian not in ("lindh", "ase"):
            raise ValueError(f"BFGS: hessian must be 'lindh' or 'ase', got {hessian!r}")
        if not shift > 0:
            raise ValueError(f"BFGS: shift must be > 0, got {shift}")
        self.maxstep, self.alpha, self.hessian, self.shift = maxstep, alpha, hessian, shift

    def admit(self, state: tp.Dict[str, Tensor], numbers: Tensor, positions: Tensor) -> None:
        if self.hessian == "lindh" and numbers.shape[0]:
            h = lindh_hessian(numbers, positions.to(state["H"].dtype), self.shift)
            state["H"][state["H"].shape[0] - numbers.shape[0]:] = h

    def new_state(self, count: int, width: int, like: Tensor) -> tp.Dict[str, Tensor]:
        eye = torch.eye(3 * width, dtype=like.dtype, device=like.device) * self.alpha
        return {"H": eye.expand(count, -1, -1).clone(), "r0": like.new_zeros((count, width, 3)),
                "f0": like.new_zeros((count, width, 3)),
                "started": torch.zeros(count, dtype=torch.bool, device=like.device)}

    def widen(self, state: tp.Dict[str, Tensor], grow: int) -> None:
        super().widen(state, grow)
        h = state["H"]
        n = h.shape[1]
        wide = torch.eye(n + 3 * grow, dtype=h.dtype, device=h.device).expand(h.shape[0], -1, -1) * self.alpha
        wide = wide.clone()
        wide[:, :n, :n] = h
        state["H"] = wide

    def narrow(self, state: tp.Dict[str, Tensor], width: int) -> None:
        super().narrow(state, width)
        state["H"] = state["H"][:, :3 * width, :3 * width].contiguous()

    def step(self, state: tp.Dict[str, Tensor], x: Tensor, f: Tensor) -> Tensor:
        """The displacement (B, W, 3) in Å from positions ``x`` and forces ``f``
        (eV/Å); updates ``state`` in place (as ASE's ``BFGS.step``)."""
        count, width = x.shape[0], x.shape[1]
        h = state["H"]
        s = (x - state["r0"]).reshape(count, -1)
        dgrad = (state["f0"] - f).reshape(count, -1)  # gradient - gradient0
        update = state["started"] & (s.abs().amax(1) >= 1e-7)
        a = (s * dgrad).sum(1)
        dg = torch.bmm(h, s.unsqueeze(2)).squeeze(2)
        b = (s * dg).sum(1)
        a = torch.where(update, a, 1.0)
        b = torch.where(update, b, 1.0)
        change = (dgrad.unsqueeze(2) * dgrad.unsqueeze(1)) / a[:, None, None] \
            - (dg.unsqueeze(2) * dg.unsqueeze(1)) / b[:, None, None]
        h = torch.where(update[:, None, None], h + change, h)
        fl = f.reshape(count, -1, 1)
        chol, info = torch.linalg.cholesky_ex(h)
        dpos = torch.cholesky_solve(fl, chol).squeeze(2)
        bad = (info != 0).nonzero().squeeze(1)
        if bad.numel():  # not positive definite: ASE's |eigenvalue| step
            omega, v = torch.linalg.eigh(h[bad])
            coef = (fl[bad].squeeze(2).unsqueeze(1) @ v).squeeze(1) / omega.abs()
            dpos[bad] = (v @ coef.unsqueeze(2)).squeeze(2)
        dpos = dpos.reshape(count, width, 3)
        longest = (dpos * dpos).sum(2).sqrt().amax(1)
        scale = torch.where(longest >= self.maxstep, self.maxstep / longest.clamp(min=self.maxstep), 1.0)
        state.update(H=h, r0=x.clone(), f0=f.clone(), started=torch.ones_like(state["started"]))
        return dpos * scale[:, None, None]


#: The optimisers by name (``optimize(..., optimizer="BFGS")``).
OPTIMIZERS = {"BFGS": BFGS, "LBFGS": LBFGS, "FIRE": FIRE}


def named_optimizer(name: str, hessian: str = "lindh") -> "_Optimizer":
    """The optimiser ``name`` (BFGS, LBFGS or FIRE) with its defaults; BFGS
    starting from ``hessian`` (``"lindh"`` or ``"ase"``, see :class:`BFGS`)."""
    if name.upper() not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {name!r}")
    return BFGS(hessian=hessian) if name.upper() == "BFGS" else OPTIMIZERS[name.upper()]()


# ---------------------------------------------------------------- relaxation
@dataclasses.dataclass
class Relaxed:
    """One structure's relaxation: ``positions`` (A, 3) Å, ``energy`` eV, ``forces``
    (A, 3) eV/Å, ``fmax`` (largest atomic force, eV/Å), ``steps`` (optimiser
    steps taken; model calls are ``steps + 1``), ``converged`` (``fmax`` below
    the criterion), ``energy_start`` (eV) and ``error`` (why the structure
    failed; then positions are the last finite ones and energies may be NaN)."""

    positions: np.ndarray
    energy: float
    forces: np.ndarray
    fmax: float
    steps: int
    converged: bool
    energy_start: float
    error: tp.Optional[str] = None


def _failed(positions, message: str) -> Relaxed:
    n = len(positions)
    return Relaxed(np.asarray(positions, dtype=np.float64), math.nan, np.full((n, 3), math.nan),
                   math.nan, 0, False, math.nan, message)


def optimize(model: torch.nn.Module, structures: tp.Sequence, fmax: float = 0.05,
             steps: int = 1000, optimizer: tp.Union[str, "_Optimizer"] = "BFGS",
             max_atoms: int = 4096, fail_fmax: float = 1e4) -> tp.List[Relaxed]:
    """Relax many structures at once; one :class:`Relaxed` per structure, in input order.

    Arguments are those of :func:`iter_optimize`.
    """
    out: tp.List[tp.Optional[Relaxed]] = [None] * len(structures)
    for i, result in iter_optimize(model, structures, fmax, steps, optimizer, max_atoms, fail_fmax):
        out[i] = result
    return tp.cast(tp.List[Relaxed], out)


def iter_optimize(model: torch.nn.Module, structures: tp.Sequence, fmax: float = 0.05,
                  steps: int = 1000, optimizer: tp.Union[str, "_Optimizer"] = "BFGS",
                  max_atoms: int = 4096, fail_fmax: float = 1e4
                  ) -> tp.Iterator[tp.Tuple[int, Relaxed]]:
    """Relax many structures at once, yielding ``(index, Relaxed)`` as each finishes.

    Parameters
    ----------
    model : torchani.arch.ANI
        A TorchANI model, patched or not, on any device and in any dtype
        (positions and optimiser state stay float64 on the model's device).
    structures : sequence of ase.Atoms
        Molecules of any sizes and elements; periodic ones (cell kept fixed)
        are relaxed together with those of the same cell and pbc.
    fmax : float
        Convergence: largest atomic force norm below ``fmax`` eV/Å (ASE's criterion).
    steps : int
        Most optimiser steps per structure (ASE's ``run(steps=...)``).
    optimizer : {"BFGS", "LBFGS", "FIRE"} or an instance of :class:`BFGS`, :class:`LBFGS`, :class:`FIRE`
        The algorithm, ASE's of that name step for step (an instance sets its
        parameters). BFGS (default) needs the fewest steps; its Hessian costs
        (3A)² numbers per molecule in flight.
    max_atoms : int
        Padded atoms per model call at most (molecules in flight x the largest
        of them); a molecule larger than this is relaxed alone.
    fail_fmax : float
        A structure whose largest force exceeds this (eV/Å) has exploded and fails.

    Yields
    ------
    (int, Relaxed)
        The structure's index in ``structures`` and its result, in the order
        they finish. Failures (elements the model lacks, non-finite positions,
        energies or forces, exploding forces) are yielded with ``error`` set.
    """
    if not (isinstance(fmax, (int, float)) and fmax > 0):
        raise ValueError(f"fmax must be a number > 0 (eV/Å), got {fmax!r}")
    if not (isinstance(steps, int) and steps >= 0):
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if not (isinstance(max_atoms, int) and max_atoms >= 1):
        raise ValueError(f"max_atoms must be an int >= 1, got {max_atoms!r}")
    if isinstance(optimizer, str):
        optimizer = named_optimizer(optimizer)
    elif not isinstance(optimizer, _Optimizer):
        raise TypeError(f"optimizer must be a name or a BFGS/LBFGS/FIRE instance, got {type(optimizer).__name__}")
    from .structures import batch_key

    supported = set(int(z) for z in model.atomic_numbers.tolist())
    groups: tp.Dict[tuple, tp.List[int]] = {}
    for i, atoms in enumerate(structures):
        bad = [int(z) for z in atoms.numbers if int(z) not in supported]
        if len(atoms) == 0:
            yield i, _failed(atoms.positions, "no atoms")
        elif bad:
            from ase.data import chemical_symbols

            yield i, _failed(atoms.positions, f"element {chemical_symbols[bad[0]]} (atomic number "
                             f"{bad[0]}) is not supported by the model")
        elif not np.isfinite(atoms.positions).all():
            yield i, _failed(atoms.positions, "non-finite positions")
        else:
            groups.setdefault(batch_key(atoms), []).append(i)
    for idxs in groups.values():
        yield from _relax_group(model, [structures[i] for i in idxs], idxs, fmax, steps, optimizer,
                                max_atoms, fail_fmax)


def _relax_group(model, structures, indices, fmax, max_steps, opt, max_atoms, fail_fmax):
    """Relax structures that share a cell and pbc (one model call per step)."""
    from .ase import periodic_cell

    ref = core.model_float(model)
    dev = ref.device
    hartree = _hartree()
    first = structures[0]
    cell = pbc = None
    if first.pbc.any():
        cell = torch.as_tensor(periodic_cell(first), dtype=torch.float64, device=dev)
        pbc = torch.as_tensor(first.pbc, dtype=torch.bool, device=dev)
    # Everything padded once, in admission order: smallest first (little padding per call).
    sizes = [len(a) for a in structures]
    order = sorted(range(len(structures)), key=lambda k: sizes[k])
    packed = pack([structures[k] for k in order])
    all_species, all_coords, _ = pad(packed.numbers, packed.positions, packed.system_idx)
    all_species, all_coords = all_species.to(dev), all_coords.to(dev)
    natoms = [sizes[k] for k in order]
    natoms_t = torch.tensor(natoms, device=dev)
    out_index = torch.tensor([indices[k] for k in order], device=dev)
    total = len(order)

    width = 0
    rows = torch.zeros(0, dtype=torch.long, device=dev)  # which of all_* each active molecule is
    x = all_coords.new_zeros((0, 0, 3))
    species = all_species.new_zeros((0, 0))
    nsteps = torch.zeros(0, dtype=torch.long, device=dev)
    e_start = all_coords.new_zeros(0)
    state = opt.new_state(0, 0, all_coords)
    queued = 0
    while queued < total or rows.numel():
        # Admit waiting molecules while the padded call stays within max_atoms.
        count = rows.numel()
        take, new_width = 0, width
        while queued + take < total:
            w = max(new_width, natoms[queued + take])
            if (count + take + 1) * w > max_atoms and count + take > 0:
                break
            new_width, take = w, take + 1
        if take:
            new = torch.arange(queued, queued + take, device=dev)
            queued += take
            if new_width > width:
                grow = new_width - width
                x = torch.nn.functional.pad(x, (0, 0, 0, grow))
                species = torch.nn.functional.pad(species, (0, grow), value=-1)
                opt.widen(state, grow)
                width = new_width
            fresh = opt.new_state(take, width, all_coords)
            state = {k: torch.cat([state[k], fresh[k]]) for k in state}
            opt.admit(state, all_species[new, :width], all_coords[new, :width])
            rows = torch.cat([rows, new])
            x = torch.cat([x, all_coords[new, :width]])
            species = torch.cat([species, all_species[new, :width]])
            nsteps = torch.cat([nsteps, torch.zeros(take, dtype=torch.long, device=dev)])
            e_start = torch.cat([e_start, all_coords.new_full((take,), math.nan)])

        e, f = core.energies_forces(model, species, x, cell, pbc)
        e = e.to(torch.float64) * hartree
        f = f.to(torch.float64) * hartree
        e_start = torch.where(nsteps == 0, e, e_start)
        fm = (f * f).sum(2).amax(1).sqrt()
        finite = torch.isfinite(e) & torch.isfinite(f).all(2).all(1) & torch.isfinite(x).all(2).all(1)
        failed = ~finite | (fm > fail_fmax)
        done = failed | (fm < fmax) | (nsteps >= max_steps)
        if bool(done.any()):
            gone = done.nonzero().squeeze(1)
            yield from _results(gone, rows, out_index, natoms_t, x, e, f, fm, nsteps, e_start,
                                failed, finite, fmax, fail_fmax)
            keep = (~done).nonzero().squeeze(1)
            rows, x, species, nsteps, e_start = rows[keep], x[keep], species[keep], nsteps[keep], e_start[keep]
            f = f[keep]
            state = {k: v[keep] for k, v in state.items()}
            if rows.numel() == 0:
                width = 0
                x, species = x[:, :0], species[:, :0]
                opt.narrow(state, 0)
                continue
            narrow = int(natoms_t[rows].max())
            if narrow < width:  # the largest left: drop the padding columns
                width = narrow
                x, species, f = x[:, :width], species[:, :width], f[:, :width]
                opt.narrow(state, width)
        x = x + opt.step(state, x, f)
        nsteps = nsteps + 1


def _pad_spec(t: Tensor, dim: int, grow: int) -> tp.List[int]:
    """``torch.nn.functional.pad``'s spec that adds ``grow`` at the end of dimension ``dim``."""
    return [0, 0] * (t.dim() - dim - 1) + [0, grow]


def _results(gone, rows, out_index, natoms, x, e, f, fm, nsteps, e_start, failed, finite,
             fmax, fail_fmax):
    """(index, Relaxed) of the molecules at rows ``gone`` of the batch (to the host once)."""
    g_rows = rows[gone]
    idx = out_index[g_rows].tolist()
    n = natoms[g_rows].tolist()
    xs, fs = x[gone].cpu().numpy(), f[gone].cpu().numpy()
    es, fms, st, e0 = e[gone].tolist(), fm[gone].tolist(), nsteps[gone].tolist(), e_start[gone].tolist()
    bad, fin = failed[gone].tolist(), finite[gone].tolist()
    for k in range(len(idx)):
        error = None
        if bad[k]:
            error = (f"non-finite energy or forces after {st[k]} steps" if not fin[k] else
                     f"forces exploded after {st[k]} steps (largest {fms[k]:.3g} eV/Å > "
                     f"fail_fmax {fail_fmax:g})")
        yield idx[k], Relaxed(xs[k, :n[k]].copy(), es[k], fs[k, :n[k]].copy(), fms[k], st[k],
                              (not bad[k]) and fms[k] < fmax, e0[k], error)
