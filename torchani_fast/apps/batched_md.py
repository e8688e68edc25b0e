"""Many MD replicas at once: velocity Verlet (NVE) and Langevin (NVT) over a padded batch.

Each replica (any molecule; replicas may differ in size and elements, or be
copies of one molecule started with different velocities) steps in the same
padded model call (:func:`torchani_fast.batched.energies_forces`' layout), and
its trajectory comes back on its own:

>>> traj = torchani_fast.batched_md.run(model, replicas, steps=1000, dt=0.5, temperature=300,
...                                     friction=0.01, seed=0)
>>> traj[3].positions.shape, traj[3].temperature[-1]             # doctest: +SKIP

Units are ASE's (Å, eV, amu; ``dt`` in fs, ``friction`` in 1/fs, temperatures
in K). Velocity Verlet is ASE's ``VelocityVerlet`` step for step; Langevin is
the BAOAB splitting (Leimkuhler and Matthews), whose configurational
sampling is exact to second order in ``dt``.
"""
import dataclasses
import typing as tp

import numpy as np
import torch
from torch import Tensor

from .. import core
from . import batched

__all__ = ["Trajectory", "run"]


@dataclasses.dataclass
class Trajectory:
    """One replica's frames (every ``interval`` steps, the start included):
    ``positions`` (F, A, 3) Å, ``velocities`` (F, A, 3) Å/fs, ``potential`` and
    ``kinetic`` (F,) eV, ``temperature`` (F,) K (2 E_kin / (3 A k_B)) and
    ``steps`` (F,) the step of each frame."""

    positions: np.ndarray
    velocities: np.ndarray
    potential: np.ndarray
    kinetic: np.ndarray
    temperature: np.ndarray
    steps: np.ndarray


def run(model: torch.nn.Module, replicas: tp.Sequence, steps: int, dt: float = 0.5,
        temperature: tp.Optional[float] = None, friction: float = 0.0, seed: int = 0,
        interval: int = 1, velocities: tp.Optional[tp.Sequence[np.ndarray]] = None) -> tp.List[Trajectory]:
    """Run ``steps`` MD steps of every replica in one batch; one :class:`Trajectory` each.

    Parameters
    ----------
    model : torchani.arch.ANI
        A TorchANI model, patched or not (forces in its dtype; the integration in float64).
    replicas : sequence of ase.Atoms
        The structures, in vacuum (no cell), of any sizes and elements.
    steps : int
        MD steps per replica.
    dt : float
        Time step in fs.
    temperature : float, optional
        K: the Langevin bath, and the Maxwell-Boltzmann draw of the initial
        velocities (unless ``velocities`` is given, or the Atoms carry momenta).
    friction : float
        Langevin friction in 1/fs; 0 (default) is velocity Verlet (NVE).
    seed : int
        Seeds the initial velocities and the Langevin noise (one generator for the batch).
    interval : int
        Record a frame every ``interval`` steps.
    velocities : sequence of (A, 3) arrays, optional
        Initial velocities in Å/fs, one per replica.
    """
    import ase.units
    from ase.data import atomic_masses

    if not (isinstance(steps, int) and steps >= 0):
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if not (isinstance(interval, int) and interval >= 1):
        raise ValueError(f"interval must be an int >= 1, got {interval!r}")
    if not dt > 0:
        raise ValueError(f"dt must be > 0 (fs), got {dt!r}")
    if friction < 0 or (friction > 0 and temperature is None):
        raise ValueError(f"friction must be >= 0 (1/fs), and a Langevin run (friction {friction}) "
                         f"needs a temperature, got {temperature!r}")
    if temperature is not None and not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (K), got {temperature!r}")
    if any(a.pbc.any() for a in replicas):
        raise ValueError("batched MD takes molecules in vacuum (atoms.pbc all False); "
                         "run periodic systems with torchani-fast md or the ASE calculator")
    if velocities is not None and len(velocities) != len(replicas):
        raise ValueError(f"velocities: one array per replica ({len(replicas)}), got {len(velocities)}")
    packed = batched.pack(replicas)
    species, x, column = batched.pad(packed.numbers, packed.positions, packed.system_idx)
    ref = core.model_float(model)
    dev = ref.device
    species, x = species.to(dev), x.to(dev)
    real = species >= 0
    masses = torch.as_tensor(atomic_masses, dtype=torch.float64, device=dev)[species.clamp(min=0)]
    masses = torch.where(real, masses, 1.0)[..., None]  # (R, W, 1) amu
    natoms = real.sum(1)
    gen = torch.Generator(device=dev).manual_seed(seed)
    fs = ase.units.fs
    kB = ase.units.kB
    # Velocities in Å per ASE time unit (ASE's momenta / masses).
    v = torch.zeros_like(x)
    for k, atoms in enumerate(replicas):
        n = len(atoms)
        if velocities is not None:
            v[k, :n] = torch.as_tensor(np.asarray(velocities[k]), dtype=torch.float64) / fs
        elif atoms.get_momenta().any():
            v[k, :n] = torch.as_tensor(atoms.get_velocities(), dtype=torch.float64)
    if velocities is None and temperature and not any(a.get_momenta().any() for a in replicas):
        v = torch.randn(x.shape, generator=gen, dtype=torch.float64, device=dev) * (kB * temperature / masses).sqrt()
        v = torch.where(real[..., None], v, 0.0)
    hartree = float(ase.units.Hartree)

    def forces(pos: Tensor) -> tp.Tuple[Tensor, Tensor]:
        e, f = core.energies_forces(model, species, pos)
        return e.to(torch.float64) * hartree, f.to(torch.float64) * hartree

    step = dt * fs
    c1 = float(np.exp(-friction / fs * step))  # friction per ASE time unit x dt
    c2 = float(np.sqrt(1.0 - c1 * c1))
    noise_scale = (kB * (temperature or 0.0) / masses).sqrt() * c2
    frames: tp.Dict[str, list] = {"x": [], "v": [], "e": [], "k": [], "s": []}

    def record(i: int, e: Tensor) -> None:
        kinetic = 0.5 * (masses * v * v).sum((1, 2))
        frames["x"].append(x.cpu())
        frames["v"].append(v.cpu() * fs)
        frames["e"].append(e.cpu())
        frames["k"].append(kinetic.cpu())
        frames["s"].append(i)

    e, f = forces(x)
    record(0, e)
    for i in range(1, steps + 1):
        v = v + 0.5 * step * f / masses
        if friction > 0:  # BAOAB: A, O, A
            x = x + 0.5 * step * v
            xi = torch.randn(x.shape, generator=gen, dtype=torch.float64, device=dev)
            v = torch.where(real[..., None], c1 * v + noise_scale * xi, 0.0)
            x = x + 0.5 * step * v
        else:
            x = x + step * v
        e, f = forces(x)
        v = v + 0.5 * step * f / masses
        if i % interval == 0:
            record(i, e)
    xs, vs = torch.stack(frames["x"], 1).numpy(), torch.stack(frames["v"], 1).numpy()
    es, ks = torch.stack(frames["e"], 1).numpy(), torch.stack(frames["k"], 1).numpy()
    temps = 2.0 * ks / (3.0 * natoms.cpu().numpy()[:, None] * kB)
    out = []
    for k in range(len(replicas)):
        n = int(natoms[k])
        out.append(Trajectory(xs[k, :, :n].copy(), vs[k, :, :n].copy(), es[k].copy(), ks[k].copy(),
                              temps[k].copy(), np.array(frames["s"])))
    return out
