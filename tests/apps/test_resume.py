"""``resume`` of a screening run (``torchani_fast.screen``, ``torchani-fast
energy|optimize --resume``) after its inputs changed, on a real Dask cluster.

The partial file's header holds a fingerprint of every input (size,
modification time, SHA-256 of the bytes; of the structures for ``Atoms``).
Before issue 60 only the file names and the structure count were compared:
``--resume`` after an edit that kept the frame count mixed the old energies
into an output marked complete.
"""
import json
import os
import sys
from pathlib import Path

import ase.io
import pytest

distributed = pytest.importorskip("distributed")

from torchani_fast import screen as screen_fn  # noqa: E402

ScreenError = sys.modules["torchani_fast.screen"].ScreenError
DATA = Path(__file__).resolve().parents[1] / "data"
pytestmark = pytest.mark.usefixtures("weights")


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as lc, Client(lc, timeout=60) as client:
        yield client


def _interrupted_run(client, inputs, out):
    """A run stopped after its first task: OUTPUT.partial holds some records."""
    def stop(records):
        raise Stop

    with pytest.raises(Stop):
        screen_fn(inputs, client=client, output=out, batch_size=2, task_atoms=0, dtype="float64",
                  device="cpu", callback=stop)
    partial = Path(str(out) + ".partial")
    assert partial.exists() and not out.exists()
    return partial


@pytest.fixture
def conformers(tmp_path):
    path = tmp_path / "confs.xyz"
    ase.io.write(path, ase.io.read(DATA / "screen_ch4.xyz", index=":8"), format="extxyz")
    return path


def _edit_positions(path):
    """The same frames, sizes and file size, one coordinate changed in the first frame."""
    frames = ase.io.read(path, index=":")
    frames[0].positions[1, 0] += 0.25
    before = path.stat().st_size
    ase.io.write(path, frames, format="extxyz")
    return before


@pytest.mark.parametrize("edit", ["positions", "appended frame", "replaced by fewer frames"])
def test_resume_after_the_input_changed_is_refused(cluster, conformers, tmp_path, edit):
    out = tmp_path / "out.json"
    partial = _interrupted_run(cluster, [conformers], out)
    kept = partial.read_bytes()
    frames = ase.io.read(conformers, index=":")
    if edit == "positions":
        _edit_positions(conformers)
    elif edit == "appended frame":
        ase.io.write(conformers, frames + frames[:1], format="extxyz")
    else:
        ase.io.write(conformers, frames[:4], format="extxyz")
    with pytest.raises(ScreenError, match=r"changed since .*out\.json\.partial|other inputs"):
        screen_fn([conformers], client=cluster, output=out, batch_size=2, dtype="float64",
                  device="cpu", resume=True)
    assert partial.read_bytes() == kept and not out.exists()


def test_resume_after_a_touch_completes_with_the_same_results(cluster, conformers, tmp_path):
    out = tmp_path / "out.json"
    _interrupted_run(cluster, [conformers], out)
    stat = conformers.stat()
    os.utime(conformers, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10 ** 9))  # same bytes
    screen_fn([conformers], client=cluster, output=out, batch_size=2, dtype="float64", device="cpu",
              resume=True)
    fresh = tmp_path / "fresh.json"
    screen_fn([conformers], client=cluster, output=fresh, batch_size=2, dtype="float64", device="cpu")
    assert json.loads(out.read_text())["energies"] == json.loads(fresh.read_text())["energies"]


def test_resume_of_atoms_inputs_checks_the_structures(cluster, tmp_path):
    frames = ase.io.read(DATA / "screen_ch4.xyz", index=":6")
    out = tmp_path / "out.json"
    _interrupted_run(cluster, frames, out)
    frames[5].positions[0, 2] += 0.1
    with pytest.raises(ScreenError, match=r"<atoms\[0:6\]> changed since"):
        screen_fn(frames, client=cluster, output=out, batch_size=2, dtype="float64", device="cpu",
                  resume=True)


def test_resume_of_a_batched_optimize_completes_with_the_same_results(cluster, tmp_path):
    """``optimize`` relaxes each task's share (64 structures) as one batch; a run
    stopped after its first task, resumed, writes what an uninterrupted run writes
    and relaxes only the structures of the tasks that had not finished."""
    conformers = tmp_path / "ch4.xyz"
    ase.io.write(conformers, ase.io.read(DATA / "screen_ch4.xyz", index=":"), format="extxyz")
    n = len(ase.io.read(conformers, index=":"))
    out = tmp_path / "relaxed.xyz"
    options = dict(client=cluster, dtype="float64", device="cpu", fmax=0.05, steps=40)

    def stop(records):
        raise Stop

    with pytest.raises(Stop):
        screen_fn([conformers], "optimize", output=out, task_atoms=0, callback=stop, **options)
    partial = Path(str(out) + ".partial")
    assert partial.exists() and not out.exists()
    relaxed_again = []
    resumed = screen_fn([conformers], "optimize", output=out, resume=True,
                        callback=relaxed_again.extend, **options)
    fresh = tmp_path / "fresh.xyz"
    screen_fn([conformers], "optimize", output=fresh, **options)
    assert out.read_bytes() == fresh.read_bytes()
    assert len(resumed) == n and not partial.exists()
    assert 0 < len(relaxed_again) < n  # the first task's structures were not relaxed again
