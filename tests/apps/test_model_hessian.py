"""Lindh's model Hessian (torchani_fast.apps.model_hessian) against an independent oracle.

The oracle sums k w (grad q)(grad q)^T over every stretch, bend and torsion of a
small molecule in plain Python loops, with each internal coordinate q written
as a function of the positions (a distance, an angle by atan2, a dihedral by
atan2) and its gradient taken by autograd, so neither the neighbour lists nor the
hand-written gradients of the vectorised code are reused. The same terms are
left out (each atom pair's rho and each term's weight against the module's cuts).
"""
import itertools
import math

import numpy as np
import pytest
import torch

from torchani_fast.apps import model_hessian as mh
from support import read_molecule


def _rho(numbers, x):
    rows = [(z > 2) + (z > 10) for z in numbers]
    n = len(numbers)
    rho = torch.zeros(n, n, dtype=torch.float64)
    for i, j in itertools.permutations(range(n), 2):
        a, r0 = mh._ALPHA[rows[i]][rows[j]], mh._R_REF[rows[i]][rows[j]]
        rho[i, j] = math.exp(a * (r0 ** 2 - float(((x[i] - x[j]) ** 2).sum())))
    return rho


def _distance(p):
    return (p[0] - p[1]).norm()


def _angle(p):
    u, v = p[0] - p[1], p[2] - p[1]
    return torch.atan2(torch.linalg.cross(u, v).norm(), (u * v).sum())


def _dihedral(p):
    b0, b1, b2 = p[0] - p[1], p[2] - p[1], p[3] - p[2]
    n1, n2 = torch.linalg.cross(b0, b1), torch.linalg.cross(b1, b2)
    m = torch.linalg.cross(n1, b1 / b1.norm())
    return torch.atan2((m * n2).sum(), (n1 * n2).sum())


def _oracle(numbers, positions, shift):
    x = torch.as_tensor(positions, dtype=torch.float64) / mh.BOHR
    n = len(numbers)
    rho = _rho(numbers, x)
    h = torch.zeros(3 * n, 3 * n, dtype=torch.float64)

    def add(k, atoms, q):
        p = x[list(atoms)].clone().requires_grad_(True)
        g = torch.autograd.grad(q(p), p)[0].reshape(-1)
        dof = [3 * a + c for a in atoms for c in range(3)]
        h[np.ix_(dof, dof)] += k * torch.outer(g, g)

    for i, j in itertools.combinations(range(n), 2):
        add(mh.K_STRETCH * rho[i, j], (i, j), _distance)
    for j in range(n):
        for i, k in itertools.combinations([a for a in range(n) if a != j], 2):
            w = rho[i, j] * rho[j, k]
            if min(rho[i, j], rho[j, k]) > mh._BEND_RHO and w > mh._BEND_WEIGHT:
                add(mh.K_BEND * w, (i, j, k), _angle)
    for j, k in itertools.combinations(range(n), 2):
        if rho[j, k] <= mh._TORSION_RHO:
            continue
        for i in range(n):
            for l in range(n):
                if len({i, j, k, l}) < 4 or rho[i, j] <= mh._TORSION_RHO or rho[k, l] <= mh._TORSION_RHO:
                    continue
                w = rho[i, j] * rho[j, k] * rho[k, l]
                if w > mh._TORSION_WEIGHT:
                    add(mh.K_TORSION * w, (i, j, k, l), _dihedral)
    return h * (mh.HARTREE / mh.BOHR ** 2) + shift * torch.eye(3 * n, dtype=torch.float64)


@pytest.mark.parametrize("name", ["CH3CH2OH", "3lka_ligand.xyz"])
def test_equals_the_oracle(name):
    if name.endswith(".xyz"):
        atoms = read_molecule(name)
    else:
        import ase.build

        atoms = ase.build.molecule(name)
    atoms.positions += np.random.default_rng(0).normal(scale=0.05, size=atoms.positions.shape)
    want = _oracle(atoms.numbers.tolist(), atoms.positions, 7.0)
    got = mh.lindh_hessian(torch.as_tensor(atoms.numbers)[None], torch.as_tensor(atoms.positions)[None], 7.0)[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_padded_batch_equals_each_alone_and_is_positive_definite():
    import ase.build

    mols = [ase.build.molecule(m) for m in ("CH3CH2OH", "CH4", "H2O")]
    width = max(len(m) for m in mols)
    numbers = torch.full((3, width), -1)
    positions = torch.zeros((3, width, 3), dtype=torch.float64)
    for b, m in enumerate(mols):
        numbers[b, :len(m)] = torch.as_tensor(m.numbers)
        positions[b, :len(m)] = torch.as_tensor(m.positions)
    batch = mh.lindh_hessian(numbers, positions, shift=2.0)
    for b, m in enumerate(mols):
        n = 3 * len(m)
        alone = mh.lindh_hessian(numbers[b:b + 1, :len(m)], positions[b:b + 1, :len(m)], shift=2.0)[0]
        torch.testing.assert_close(batch[b, :n, :n], alone, rtol=1e-13, atol=1e-13)
        # Padding atoms: the shift alone, coupled to nothing.
        torch.testing.assert_close(batch[b, n:, :], 2.0 * torch.eye(3 * width, dtype=torch.float64)[n:])
        torch.testing.assert_close(batch[b], batch[b].T, rtol=0, atol=0)
        assert torch.linalg.eigvalsh(alone).min() > 2.0 - 1e-9  # shift + positive semi-definite terms
    # Translations and rotations of a molecule are its zero modes: only the shift is left.
    m = mols[0]
    n = len(m)
    h = batch[0, :3 * n, :3 * n] - 2.0 * torch.eye(3 * n, dtype=torch.float64)
    translation = torch.zeros(n, 3, dtype=torch.float64)
    translation[:, 0] = 1.0
    rotation = torch.linalg.cross(torch.tensor([0.3, -0.5, 0.8], dtype=torch.float64).expand(n, 3),
                                  positions[0, :n])
    for mode in (translation, rotation):
        v = mode.reshape(-1)
        assert float(v @ h @ v) == pytest.approx(0.0, abs=1e-9 * float(v @ v) * float(h.abs().max()))


def test_rotating_the_molecule_rotates_the_hessian():
    import ase.build

    m = ase.build.molecule("CH3CH2OH")
    x = torch.as_tensor(m.positions)
    q, _ = torch.linalg.qr(torch.as_tensor(np.random.default_rng(1).normal(size=(3, 3))))
    z = torch.as_tensor(m.numbers)[None]
    h = mh.lindh_hessian(z, x[None])[0]
    hr = mh.lindh_hessian(z, (x @ q.T + 1.5)[None])[0]
    big = torch.block_diag(*[q] * len(m))
    torch.testing.assert_close(hr, big @ h @ big.T, rtol=1e-10, atol=1e-10)


def test_bad_arguments():
    z = torch.tensor([[6, 1]])
    x = torch.zeros((1, 2, 3), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"shift must be > 0 \(eV/Å²\), got 0"):
        mh.lindh_hessian(z, x, shift=0.0)
    with pytest.raises(ValueError, match=r"numbers \(B, W\) and positions \(B, W, 3\) must agree, "
                                         r"got \(1, 2\) and \(2, 3\)"):
        mh.lindh_hessian(z, x[0])
