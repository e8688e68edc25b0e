"""The ``torchani-fast`` command against TorchANI, run in-process (and once as a subprocess)."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import ase.io
import numpy as np
import pytest
import torch

import torchani.ase
from torchani_fast import cli, models
from support import MOLECULES, atoms_to_tensors, energy_forces, model_pair, read_molecule

# The command line loads the published weights (and the references must match them).
pytestmark = pytest.mark.usefixtures("weights")


@pytest.fixture(scope="module")
def pair():
    """Member 0 of ANI-2x, TorchANI's and patched: the CLI's plumbing is what is
    tested here, and one network costs 1/8 of the ensemble."""
    ref, fast = model_pair("ANI2x", torch.float64)
    return ref[0], fast[0]


@pytest.fixture(autouse=True)
def preloaded(pair, monkeypatch):
    """Serve the patched float64 CPU model from the CLI's cache (no weights reloaded)."""
    monkeypatch.setitem(models._LOADED, models.cache_key("ANI2x", dtype=torch.float64), pair[1])


def run(*argv):
    return cli.main([str(a) for a in argv])


def _expected(ref, atoms):
    species, coords, cell, pbc = atoms_to_tensors(atoms)
    e, f = energy_forces(ref, species, coords, cell, pbc)
    return float(e[0]), f[0].numpy()


def test_energy_periodic_file_matches_torchani(pair, tmp_path):
    ref, _ = pair
    out = tmp_path / "out.json"
    assert run("energy", MOLECULES / "water-0.8nm.xyz", MOLECULES / "benzene.xyz", "--forces",
               "-t", "f64", "-d", "cpu", "--no-progress", "-o", out) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"energies", "forces", "structures"}
    for k, name in enumerate(["water-0.8nm.xyz", "benzene.xyz"]):
        e, f = _expected(ref, read_molecule(name))
        assert data["energies"][k] == pytest.approx(e, rel=0, abs=1e-9)  # Hartree
        np.testing.assert_allclose(np.array(data["forces"][k]), f, rtol=0, atol=1e-9)  # Ha/Å
        assert data["structures"][k] == {"file": str(MOLECULES / name), "frame": 0,
                                         "natoms": len(read_molecule(name))}


def test_energy_multiframe_file_is_batched_and_matches_torchani(pair, tmp_path, capsys):
    ref, _ = pair
    # Frames of different sizes (methane, ligands) in one file: one padded batch.
    frames = read_molecule("CH4-5.xyz", index=":3") + [read_molecule("3lka_ligand.xyz"),
                                                       read_molecule("CH4-5.xyz", index=7)]
    path = tmp_path / "mixed.extxyz"
    ase.io.write(path, frames, format="extxyz")
    frames = ase.io.read(path, index=":")  # as written (8 decimals)
    calls = []
    hook = pair[1].neighborlist.register_forward_hook(lambda *a: calls.append(1))
    try:
        assert run("energy", path, "-f", "-t", "float64", "-d", "cpu", "--no-progress") == 0
    finally:
        hook.remove()
    data = json.loads(capsys.readouterr().out)
    assert len(calls) == 1  # all frames in one model call
    assert [s["frame"] for s in data["structures"]] == list(range(len(frames)))
    for k, atoms in enumerate(frames):
        e, f = _expected(ref, atoms)
        assert data["energies"][k] == pytest.approx(e, rel=0, abs=1e-9)
        np.testing.assert_allclose(np.array(data["forces"][k]), f, rtol=0, atol=1e-9)

    # --index selects frames and keeps their numbers; --batch-size 2 splits the batch.
    assert run("energy", path, "-i", "1::2", "-b", "1", "-t", "f64", "-d", "cpu", "--no-progress") == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["frame"] for s in data["structures"]] == [1, 3]
    assert "forces" not in data
    assert data["energies"][1] == pytest.approx(_expected(ref, frames[3])[0], rel=0, abs=1e-9)


def test_hessians(tmp_path, capsys):
    code = run("energy", MOLECULES / "3lka_ligand.xyz", "--hessians", "-t", "f64", "-d", "cpu")
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads(captured.out)
    n = 3 * len(read_molecule("3lka_ligand.xyz"))
    assert np.array(data["hessians"]).shape == (1, n, n) and "forces" in data


def test_bad_inputs_name_file_frame_and_element(tmp_path, capsys):
    frames = read_molecule("CH4-5.xyz", index=":2")
    frames[1].numbers[2] = 26  # iron in frame 1, atom 3
    bad = tmp_path / "iron.xyz"
    ase.io.write(bad, frames, format="extxyz")
    # Only frame 0 of each file is read with -i 0, and it is fine.
    assert run("energy", MOLECULES / "CH4-5.xyz", bad, "-i", "0", "-d", "cpu", "-t", "f64",
               "--no-progress") == 0
    capsys.readouterr()
    assert run("energy", bad, "-d", "cpu", "-t", "f64") == 1
    err = capsys.readouterr().err
    assert f"{bad}, frame 1: element Fe (atomic number 26) at atom 2" in err and "Cl" in err

    garbage = tmp_path / "garbage.xyz"
    garbage.write_text("this is not\na structure file\n")
    assert run("optimize", garbage, "-d", "cpu") == 1
    assert str(garbage) in capsys.readouterr().err
    assert run("md", tmp_path / "missing.xyz", "-d", "cpu") == 1
    assert "missing.xyz: no such file" in capsys.readouterr().err
    assert run("energy", MOLECULES / "3lka_ligand.xyz", "-m", "ANI1x") == 1  # S is not in ANI-1x
    assert "element S" in capsys.readouterr().err


def test_help_explains_options(capsys):
    for argv, words in ((["--help"], ["energy", "optimize", "md", "TORCHANI_DATA_DIR"]),
                        (["energy", "--help"], ["--forces", "--hessians", "Hartree", "--dtype", "--device"]),
                        (["optimize", "--help"], ["--fmax", "--optimizer", "LBFGS", "--steps"]),
                        (["md", "--help"], ["--temperature", "--ensemble", "--dt", "langevin"])):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 0
        out = capsys.readouterr().out
        for w in words:
            assert w in out, (argv, w)
    with pytest.raises(SystemExit) as exc:
        cli.main(["optimize", "x.xyz", "--optimizer", "CG"])
    assert exc.value.code == 2


@pytest.mark.parametrize("hessian", ["ase", "lindh"])
def test_optimize_matches_torchani_bfgs(pair, tmp_path, capsys, hessian):
    """ASE's BFGS with TorchANI's calculator: the same path with ``--hessian ase``;
    the same minimum from Lindh's model Hessian (the default)."""
    import ase.optimize
    from ase.build import molecule

    ref, _ = pair
    ethanol = tmp_path / "ethanol.xyz"
    ase.io.write(ethanol, molecule("CH3CH2OH"), format="xyz")  # plain XYZ, no cell
    out = tmp_path / "opt.xyz"
    assert run("optimize", MOLECULES / "CH4-5.xyz", ethanol, "-i", "-1", "--hessian", hessian,
               "--fmax", "0.005", "-d", "cpu", "--no-progress", "-o", out) == 0
    table = capsys.readouterr().out
    assert "2/2 converged" in table and "ethanol.xyz" in table
    results = ase.io.read(out, index=":")
    assert len(results) == 2
    for atoms, path in zip(results, [MOLECULES / "CH4-5.xyz", ethanol]):
        start = ase.io.read(path, index=-1)
        start.calc = torchani.ase.Calculator(ref)
        ase.optimize.BFGS(start, logfile=None).run(fmax=0.005, steps=1000)
        assert atoms.info["converged"] and atoms.info["source"] == str(path)
        # Two points with forces below fmax near one minimum: energies within
        # ~fmax^2 / (2 k) of each other (k > 1 eV/Å² here).
        assert atoms.get_potential_energy() == pytest.approx(start.get_potential_energy(), rel=0,
                                                             abs=1e-6 if hessian == "ase" else 1e-4)
        if hessian == "ase":
            np.testing.assert_allclose(atoms.positions, start.positions, rtol=0, atol=1e-4)
        else:  # (the paths differ: so may the orientation; the interatomic distances may not)
            np.testing.assert_allclose(atoms.get_all_distances(), start.get_all_distances(), rtol=0, atol=2e-3)
        assert np.abs(atoms.get_forces()).max() < 0.005 * 1.0001


def test_md_writes_trajectory_and_log(tmp_path, capsys):
    out = tmp_path / "md.xyz"
    for ensemble in ("nve", "langevin"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert run("md", MOLECULES / "CH4-5.xyz", "--frame", "0", "--steps", "20", "--interval", "5",
                       "--ensemble", ensemble, "--seed", "1", "-d", "cpu", "--no-progress", "-o", out) == 0
        # (ASE 3.29 deprecates MaxwellBoltzmannDistribution for thermalize_momenta)
        assert not [w for w in caught if "thermalize_momenta" in str(w.message)]
        traj = ase.io.read(out, index=":")
        assert len(traj) == 5  # steps 0, 5, 10, 15, 20
        assert all(np.isfinite(a.get_potential_energy()) for a in traj)
        assert traj[-1].get_momenta().any()
        log = (tmp_path / "md.log").read_text().splitlines()
        assert log[0].split()[0].startswith("Time") and len(log) == 6
    assert "ns/day" in capsys.readouterr().out


def test_console_entry_point_subprocess(tmp_path):
    # The real entry point in a fresh interpreter: bad input fails before any model loads.
    bad = tmp_path / "fe.xyz"
    bad.write_text("1\n\nFe 0 0 0\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-m", "torchani_fast.cli", "energy", str(bad)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"{bad}, frame 0: element Fe (atomic number 26) at atom 0 (counting from 0) is not supported by ANI2x" in proc.stderr
