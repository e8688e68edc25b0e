"""Systems for LAMMPS: water boxes and LAMMPS data files (``atom_style atomic``)."""
import typing as tp

import numpy as np

# Masses (g/mol) written to data files, for the elements TorchANI models know.
MASSES = {"H": 1.008, "C": 12.011, "N": 14.007, "O": 15.999, "F": 18.998, "S": 32.06, "Cl": 35.45}
_WATER = np.array([[0.0, 0.0, 0.0], [0.9572, 0.0, 0.0], [-0.2400, 0.9266, 0.0]])  # O H H, Å


def _rotation(rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    return q * np.sign(np.diag(r))


def water_box(n_side: int, seed: int = 0, spacing: float = 3.107, tilt: float = 0.0):
    """``n_side**3`` randomly oriented water molecules on a jittered grid (≈1 g/cm³ at the
    default spacing), periodic. ``tilt`` (a fraction of the edge) makes the cell triclinic
    (LAMMPS's xy, xz, yz). Returns an ``ase.Atoms``; molecules cross the cell's faces."""
    import ase

    rng = np.random.default_rng(seed)
    edge = n_side * spacing
    cell = np.array([[edge, 0.0, 0.0], [tilt * edge, edge, 0.0], [tilt * edge, -0.5 * tilt * edge, edge]])
    symbols, positions = [], []
    for i, j, k in np.ndindex(n_side, n_side, n_side):
        frac = (np.array([i, j, k]) + 0.5 + rng.uniform(-0.05, 0.05, 3)) / n_side
        centre = frac @ cell
        positions.extend(centre + _WATER @ _rotation(rng).T)
        symbols.extend("OHH")
    atoms = ase.Atoms(symbols, positions=positions, cell=cell, pbc=True)
    atoms.wrap()
    return atoms


def write_data(atoms, path: str, elements: tp.Sequence[str]) -> None:
    """Write ``atoms`` (periodic, cell in LAMMPS's lower-triangular form) as a LAMMPS
    data file whose atom type t is ``elements[t - 1]`` (so ``pair_coeff * * {elements}``)."""
    cell = [[float(v) for v in row] for row in atoms.cell.array]
    if abs(cell[0][1]) + abs(cell[0][2]) + abs(cell[1][2]) > 1e-12:
        raise ValueError("atoms: the cell must be lower triangular (a along x, b in the xy plane), "
                         f"got {cell}")
    index = {e: t for t, e in enumerate(elements, 1)}
    missing = sorted(set(atoms.get_chemical_symbols()) - set(index))
    if missing:
        raise ValueError(f"elements: {list(elements)} lacks {missing}")
    lines = [f"LAMMPS data file written by torchani_fast.lammps.data ({len(atoms)} atoms)", "",
             f"{len(atoms)} atoms", f"{len(elements)} atom types", "",
             f"0.0 {cell[0][0]!r} xlo xhi", f"0.0 {cell[1][1]!r} ylo yhi", f"0.0 {cell[2][2]!r} zlo zhi"]
    if abs(cell[1][0]) + abs(cell[2][0]) + abs(cell[2][1]) > 0:
        lines.append(f"{cell[1][0]!r} {cell[2][0]!r} {cell[2][1]!r} xy xz yz")
    lines += ["", "Masses", ""] + [f"{t} {MASSES.get(e, 1.0)} # {e}" for e, t in index.items()]
    lines += ["", "Atoms # atomic", ""]
    for i, (s, x) in enumerate(zip(atoms.get_chemical_symbols(), atoms.positions), 1):
        lines.append(f"{i} {index[s]} {float(x[0])!r} {float(x[1])!r} {float(x[2])!r}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def density(atoms) -> float:
    """Mass density in g/cm³."""
    mass = sum(MASSES[s] for s in atoms.get_chemical_symbols())  # g/mol
    return mass / 0.602214076 / atoms.get_volume()  # (g/mol) / (1e-24 N_A) / Å³
