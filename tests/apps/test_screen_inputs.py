"""Every input form ``torchani_fast.screen`` takes (a path as str or Path, an
``ase.Atoms``, a list of paths, a list of Atoms, a mix), on a real Dask cluster:
each gives the results of the same structures read from one file.

Before issue 60 ``screen("confs.xyz")`` read the string as a list of one-letter
file names and ``screen(Path("confs.xyz"))`` raised "'PosixPath' object is not
iterable".
"""
from pathlib import Path

import ase.io
import pytest

distributed = pytest.importorskip("distributed")

from torchani_fast import screen as screen_fn  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data"
pytestmark = pytest.mark.usefixtures("weights")
OPTIONS = dict(dtype="float64", device="cpu", batch_size=3)


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as lc, Client(lc, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    frames = ase.io.read(DATA / "screen_ch4.xyz", index=":7")
    ase.io.write(root / "a.xyz", frames[:4], format="extxyz")
    ase.io.write(root / "b.xyz", frames[4:], format="extxyz")
    ase.io.write(root / "all.xyz", frames, format="extxyz")
    ase.io.write(root / "b.pdb", frames[4:])  # another format: read on the client and shipped
    # (the Atoms as the files hold them: extended XYZ rounds positions to 8 decimals)
    return root, ase.io.read(root / "all.xyz", index=":")


@pytest.fixture(scope="module")
def reference(cluster, files):
    root, _ = files
    return [r["energy"] for r in screen_fn([root / "all.xyz"], client=cluster, **OPTIONS)]


def _energies(results):
    assert all("error" not in r for r in results), results
    return [r["energy"] for r in results]


def test_one_path_as_str_and_as_path(cluster, files, reference):
    root, _ = files
    assert _energies(screen_fn(str(root / "all.xyz"), client=cluster, **OPTIONS)) == reference
    assert _energies(screen_fn(root / "all.xyz", client=cluster, **OPTIONS)) == reference


def test_lists_of_paths_str_path_and_other_formats(cluster, files, reference):
    root, _ = files
    assert _energies(screen_fn([str(root / "a.xyz"), root / "b.xyz"], client=cluster, **OPTIONS)) == reference
    pdb = _energies(screen_fn((root / "a.xyz", root / "b.pdb"), client=cluster, **OPTIONS))
    assert pdb[:4] == reference[:4]
    # (PDB keeps 3 decimals of the positions: the reference is what ASE reads of it)
    read = _energies(screen_fn(ase.io.read(root / "b.pdb", index=":"), client=cluster, **OPTIONS))
    assert pdb[4:] == pytest.approx(read, rel=1e-10)


def test_atoms_alone_in_a_list_and_mixed_with_paths(cluster, files, reference):
    root, frames = files
    # (other batches than the reference's: float64 rounding apart)
    assert _energies(screen_fn(frames[0], client=cluster, **OPTIONS)) == pytest.approx(reference[:1], rel=1e-10)
    results = screen_fn(frames, client=cluster, **OPTIONS)
    assert _energies(results) == reference
    assert [(r["file"], r["frame"]) for r in results] == [("<atoms[0:7]>", k) for k in range(7)]
    mixed = screen_fn([root / "a.xyz", *frames[4:]], client=cluster, **OPTIONS)
    assert _energies(mixed) == reference
    assert [r["file"] for r in mixed][3:5] == [str(root / "a.xyz"), "<atoms[1:4]>"]


def test_index_selects_frames_of_atoms_inputs_as_of_files(cluster, files, reference):
    _, frames = files
    selected = _energies(screen_fn(frames, client=cluster, index="::2", **OPTIONS))
    assert selected == pytest.approx(reference[::2], rel=1e-10)


@pytest.mark.parametrize("bad, message", [
    (42, r"files must be a path, an ase.Atoms or a sequence of them, got builtins.int"),
    ([Path("a.xyz"), 3.5], r"files\[1\] must be a path \(str or os.PathLike\) or an ase.Atoms, got builtins.float"),
])
def test_other_inputs_are_refused_by_name(cluster, bad, message):
    with pytest.raises(TypeError, match=message):
        screen_fn(bad, client=cluster, **OPTIONS)


def test_empty_input_is_refused(cluster):
    with pytest.raises(Exception, match="files is empty"):
        screen_fn([], client=cluster, **OPTIONS)


@pytest.mark.parametrize("workers", [0, -1, None, 1.5])
def test_no_cluster_is_refused_before_any_file_is_written(tmp_path, files, workers):
    root, _ = files
    out = tmp_path / "out.json"
    with pytest.raises(Exception, match=r"--workers must be at least 1, got"):
        screen_fn(root / "a.xyz", workers=workers, output=out)
    assert list(tmp_path.iterdir()) == []


def test_the_command_line_and_screening_read_files_with_one_reader(tmp_path, monkeypatch):
    # One reader of structure files (apps.structures.read_frames) for the local command
    # and screening's non-extxyz inputs: the same frames and the same messages.
    from ase.build import molecule

    from torchani_fast.apps import cli, screen as screen_module, structures

    frames = [molecule(name) for name in ("CH4", "H2O", "NH3")]
    path = tmp_path / "mols.traj"
    ase.io.write(path, frames)
    calls = []
    real = structures.read_frames

    def counting(p, index=":"):
        calls.append((str(p), index))
        return real(p, index)

    monkeypatch.setattr(cli, "read_frames", counting)
    monkeypatch.setattr(screen_module, "read_frames", counting)
    local = cli._read(path, "1:")
    items = screen_module._items([path], "1:")
    assert calls == [(str(path), "1:"), (str(path), "1:")]
    assert [k for k, _ in local] == [it["frame"] for it in items] == [1, 2]
    assert [a.get_chemical_formula() for _, a in local] == [it["atoms"].get_chemical_formula() for it in items]
    messages = []
    for read in (lambda: cli._read(path, "7"), lambda: screen_module._items([path], "7")):
        with pytest.raises(Exception) as exc:
            read()
        messages.append(str(exc.value))
    assert messages[0] == messages[1] == f"{path}: has 3 frame(s), no frame 7"
