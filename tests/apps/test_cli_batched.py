"""``torchani-fast optimize`` batched (the default) against its per-structure path.

The batched optimisers take ASE's steps on each structure, so the batched run and
``--per-structure`` write the same structures (input order, same info keys,
positions within 1e-9 Å). A structure that fails inside the batch is written
with ``error=...`` and makes the exit status 1; the others are written as usual.
"""
from pathlib import Path

import ase.build
import ase.io
import numpy as np
import pytest

from torchani_fast import batched, cli

DATA = Path(__file__).resolve().parents[1] / "data"
pytestmark = pytest.mark.usefixtures("weights")


def _inputs(tmp_path):
    path = tmp_path / "start.xyz"
    # Ethanol first: the CH4 frames finish before it, yet the file keeps input order.
    frames = [ase.build.molecule("CH3CH2OH")] + ase.io.read(DATA / "CH4-5.xyz", index=":3")
    ase.io.write(path, frames, format="extxyz")
    return path


def _run(*argv):
    return cli.main([str(a) for a in argv] + ["-d", "cpu", "--no-progress"])


def test_batched_is_the_default_and_equals_per_structure(tmp_path, capsys):
    path = _inputs(tmp_path)
    assert _run("optimize", path, "--fmax", "0.01", "-o", tmp_path / "b.xyz") == 0
    assert "4/4 converged" in capsys.readouterr().out
    assert _run("optimize", path, "--fmax", "0.01", "--per-structure", "-o", tmp_path / "p.xyz") == 0
    mine = ase.io.read(tmp_path / "b.xyz", index=":")
    ref = ase.io.read(tmp_path / "p.xyz", index=":")
    assert [a.info["frame"] for a in mine] == [0, 1, 2, 3]
    assert [len(a) for a in mine] == [9, 5, 5, 5]
    for a, b in zip(mine, ref):
        assert a.info.keys() == b.info.keys()  # source, frame, optimizer, steps, converged, fmax
        assert a.info["steps"] == b.info["steps"] and a.info["fmax"] == pytest.approx(b.info["fmax"], rel=1e-6)
        np.testing.assert_allclose(a.positions, b.positions, rtol=0, atol=1e-9)
        assert a.get_potential_energy() == pytest.approx(b.get_potential_energy(), rel=1e-12)
        np.testing.assert_allclose(a.get_forces(), b.get_forces(), rtol=0, atol=1e-9)
    assert mine[0].info["optimizer"] == "BFGS" and all(a.info["converged"] for a in mine)
    assert not Path(str(tmp_path / "b.xyz") + ".partial").exists()


def test_a_failure_inside_the_batch_is_written_and_reported(tmp_path, capsys, monkeypatch):
    path = _inputs(tmp_path)
    real = batched.iter_optimize

    def second_fails(model, structures, **kwargs):
        for i, r in real(model, structures, **kwargs):
            if i == 1:
                r.error, r.converged = "non-finite energy or forces after 3 steps", False
            yield i, r

    monkeypatch.setattr(batched, "iter_optimize", second_fails)
    out = tmp_path / "o.xyz"
    assert _run("optimize", path, "-o", out) == 1
    captured = capsys.readouterr()
    assert f"{path}, frame 1: non-finite energy or forces after 3 steps" in captured.err
    frames = ase.io.read(out, index=":")
    assert len(frames) == 4 and frames[1].info["error"].startswith("non-finite")
    assert [a.info["converged"] for a in frames] == [True, False, True, True]
    assert "3/4 converged" in captured.out


def test_max_atoms_is_checked(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _run("optimize", _inputs(tmp_path), "--max-atoms", "0")
    assert exc.value.code == 2
    assert "--max-atoms must be at least 1, got 0" in capsys.readouterr().err
