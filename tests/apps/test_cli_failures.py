"""The ``torchani-fast`` command under failure: bad options and paths, bad input
files, interruption (SIGINT in a subprocess) and errors mid-run.

Guarantees tested (torchani_fast.apps.output): outputs are written as NAME.partial
and renamed to NAME on success; an interrupted or failed run leaves
NAME.partial with the finished structures/frames and never touches an existing
NAME; errors are one line on stderr, no traceback. Every subprocess has a
timeout; the in-process cases run under conftest's ``deadline`` fixture.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import ase.io
import numpy as np
import pytest
import torch
from ase.build import molecule

from torchani_fast import cli, models
from torchani_fast.models import ANI2x

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("deadline")  # (conftest.py: a SIGALRM per test)
SENTINEL = "an earlier result the user keeps\n"


@pytest.fixture(scope="module")
def model():
    return ANI2x(model_index=0, dtype=torch.float64)


@pytest.fixture(autouse=True)
def preloaded(model, monkeypatch):
    """Serve member 0 of ANI-2x from the CLI's cache (no weights loaded per run)."""
    for dtype in ("float64", "float32"):
        monkeypatch.setitem(models._LOADED, models.cache_key("ANI2x", dtype=getattr(torch, dtype)),
                            model if dtype == "float64" else ANI2x(model_index=0))


def run(capsys, *argv):
    """(exit status, stderr) of cli.main in-process; SystemExit (argparse) counts too."""
    try:
        status = cli.main([str(a) for a in argv])
    except SystemExit as exc:
        status = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return status, err


def waters(n, rng_seed=0):
    rng = np.random.default_rng(rng_seed)
    frames = []
    for _ in range(n):
        w = molecule("H2O")
        w.positions += rng.normal(scale=0.08, size=w.positions.shape)
        frames.append(w)
    return frames


@pytest.fixture
def water_file(tmp_path):
    path = tmp_path / "water.xyz"
    ase.io.write(path, waters(1), format="extxyz")
    return path


# -- 5. options and paths checked before any work (exit status 2, one line) ----------------
@pytest.mark.parametrize("argv, words", [
    (["optimize", "--fmax", "0"], "--fmax must be a finite number > 0"),
    (["optimize", "--fmax", "-1"], "--fmax must be a finite number > 0"),
    (["optimize", "--fmax", "nan"], "--fmax must be a finite number > 0"),
    (["md", "--temperature", "-5"], "--temperature must be a finite number >= 0"),
    (["md", "--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["md", "--temperature", "1e9"], "far beyond"),
    (["md", "--dt", "0"], "--dt must be in (0, 10] fs"),
    (["md", "--dt", "-0.5"], "--dt must be in (0, 10] fs"),
    (["md", "--dt", "1000"], "--dt must be in (0, 10] fs"),
    (["md", "--dt", "inf"], "--dt must be in (0, 10] fs"),
    (["md", "--ensemble", "langevin", "--friction", "-0.01"], "--friction must be a finite number >= 0"),
    (["md", "--steps", "0"], "--steps must be at least 1"),
    (["energy", "-i", "abc"], "invalid frame index -i 'abc'"),
    (["energy", "-i", "::0"], "invalid frame index -i '::0'"),
])
def test_nonsense_options_are_refused_before_any_work(capsys, water_file, tmp_path, argv, words):
    # Before: accepted and run (fmax <= 0, T < 0, dt <= 0 or absurd), or a traceback (-i, friction).
    command, *options = argv
    out = tmp_path / ("out.json" if command == "energy" else "out.xyz")
    status, err = run(capsys, command, water_file, *options, "-d", "cpu", "--no-progress", "-o", out)
    assert status == 2 and words in err
    assert not out.exists() and not Path(str(out) + ".partial").exists()


def test_md_refuses_log_and_trajectory_in_one_file(capsys, water_file, tmp_path):
    # Before: log and trajectory written into traj.log, exit status 0, unreadable trajectory.
    traj = tmp_path / "traj.log"
    traj.write_text(SENTINEL)
    status, err = run(capsys, "md", water_file, "-o", traj, "--steps", "2", "-d", "cpu", "--no-progress")
    assert status == 2 and "are the same file" in err
    assert traj.read_text() == SENTINEL
    status, err = run(capsys, "md", water_file, "-o", tmp_path / "t.xyz", "--log", tmp_path / "t.xyz",
                      "--steps", "2", "-d", "cpu", "--no-progress")
    assert status == 2 and "are the same file" in err


@pytest.mark.parametrize("command", ["energy", "optimize", "md"])
def test_missing_output_directory_fails_before_any_work(capsys, water_file, tmp_path, command):
    # Before: a traceback after all the work (optimize: all results lost).
    out = tmp_path / "no" / "such" / "dir" / "out.xyz"
    status, err = run(capsys, command, water_file, "-o", out, "-d", "cpu", "--no-progress")
    assert status == 1 and f"{out.parent} does not exist" in err and err.count("\n") == 1


def bad_file(tmp_path, kind):
    path = tmp_path / f"{kind}.xyz"
    frames = waters(3)
    if kind == "nan":
        frames[1].positions[2, 0] = np.nan
    elif kind == "small-cell":
        frames[1].cell, frames[1].pbc = np.eye(3) * 0.3, True
    elif kind == "pbc-no-cell":
        frames[1].pbc = True  # with ASE's default zero cell
    ase.io.write(path, frames, format="extxyz")
    return path


@pytest.mark.parametrize("kind, words", [
    ("nan", "frame 1: atom 2 has non-finite coordinates"),
    ("small-cell", "frame 1: cell is too small"),
    ("pbc-no-cell", "frame 1: pbc is True along axis 0 but the cell's lattice vector 0 is zero"),
])
@pytest.mark.parametrize("command", ["energy", "optimize", "md"])
def test_bad_structures_are_one_line_naming_file_and_frame(capsys, tmp_path, kind, words, command):
    # Before: Python tracebacks (NaN, small cell), or a number for pbc without a cell.
    path = bad_file(tmp_path, kind)
    out = tmp_path / "out.txt"
    out.write_text(SENTINEL)
    extra = ["--frame", "1", "--steps", "2"] if command == "md" else []
    status, err = run(capsys, command, path, *extra, "-o", out, "-d", "cpu", "--no-progress")
    assert status == 1 and f"{path}, {words}" in err and err.count("\n") == 1
    assert out.read_text() == SENTINEL  # the user's file is untouched


# -- 2. outputs: complete or .partial, never a truncated file ------------------------------
def test_energy_writes_through_partial_and_keeps_finished_work_when_interrupted(
        capsys, tmp_path, monkeypatch):
    frames = waters(2) + [molecule("CH4")]  # with -b 2, two batches: the waters, then methane
    path = tmp_path / "in.xyz"
    ase.io.write(path, frames, format="extxyz")
    out = tmp_path / "out.json"
    status, _ = run(capsys, "energy", path, "-o", out, "-d", "cpu", "-t", "f64", "--no-progress")
    assert status == 0 and not Path(str(out) + ".partial").exists()
    complete = json.loads(out.read_text())
    assert len(complete["energies"]) == 3 and "complete" not in complete

    import torchani_fast.evaluate

    real = torchani_fast.evaluate.energies_forces
    calls = []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(torchani_fast.evaluate, "energies_forces", interrupted)
    out.write_text(SENTINEL)
    status, err = run(capsys, "energy", path, "--forces", "-b", "2", "-o", out, "-d", "cpu", "-t", "f64",
                      "--no-progress")
    assert status == 130 and "partial results" in err
    assert out.read_text() == SENTINEL
    partial = json.loads(Path(str(out) + ".partial").read_text())
    assert partial["complete"] is False
    assert partial["energies"][:2] == pytest.approx(complete["energies"][:2], rel=1e-12)
    assert partial["energies"][2] is None


def test_md_failure_leaves_the_users_files_untouched(capsys, tmp_path, monkeypatch):
    # Before: md truncated -o and its log before the first evaluation.
    path = tmp_path / "w.xyz"
    ase.io.write(path, waters(1), format="extxyz")
    traj, log = tmp_path / "md.xyz", tmp_path / "md.log"
    traj.write_text(SENTINEL)
    log.write_text(SENTINEL)
    from torchani_fast.ase import Calculator

    def broken(self, *args):
        raise RuntimeError("the evaluation failed")

    monkeypatch.setattr(Calculator, "_unstepped", broken)  # (periodic atoms, other models)
    monkeypatch.setattr(Calculator, "_stepped", broken)  # (a molecule, an eager patched model)
    status, err = run(capsys, "md", path, "-o", traj, "--steps", "5", "-d", "cpu", "--no-progress")
    assert status == 1 and "the evaluation failed" in err
    assert traj.read_text() == SENTINEL and log.read_text() == SENTINEL


def test_md_success_renames_and_leaves_no_partial(capsys, tmp_path):
    path = tmp_path / "w.xyz"
    ase.io.write(path, waters(1), format="extxyz")
    traj = tmp_path / "md.xyz"
    traj.write_text(SENTINEL)
    status, _ = run(capsys, "md", path, "-o", traj, "--steps", "4", "--interval", "2", "-d", "cpu",
                    "--no-progress", "--seed", "1")
    assert status == 0
    assert len(ase.io.read(traj, index=":")) == 3  # steps 0, 2, 4
    assert len((tmp_path / "md.log").read_text().splitlines()) == 4  # header + 3 lines
    assert not list(tmp_path.glob("*.partial"))


def test_optimize_error_in_structure_k_keeps_the_finished_ones(capsys, tmp_path, monkeypatch):
    # Before: an error in structure k threw away structures 0..k-1.
    path = tmp_path / "in.xyz"
    ase.io.write(path, waters(4), format="extxyz")
    out = tmp_path / "opt.xyz"
    real = cli._optimize_one

    def fails_third(args, calc, p, frame, atoms):
        if frame == 2:
            raise ValueError("structure 2 exploded")
        return real(args, calc, p, frame, atoms)

    monkeypatch.setattr(cli, "_optimize_one", fails_third)
    status, err = run(capsys, "optimize", path, "-o", out, "-d", "cpu", "--no-progress", "--per-structure")
    assert status == 1 and f"{path}, frame 2: structure 2 exploded" in err
    assert not out.exists()
    done = ase.io.read(str(out) + ".partial", index=":", format="extxyz")
    assert [a.info["frame"] for a in done] == [0, 1] and all(a.info["converged"] for a in done)


# -- SIGINT on the real command in a subprocess --------------------------------------------
def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TORCHANI_NO_WARN_EXTENSIONS", "1")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _interrupt_when(proc, ready, timeout=90):
    """Send SIGINT once ``ready()`` holds; (exit status, stderr)."""
    start = time.monotonic()
    while not ready():
        if proc.poll() is not None or time.monotonic() - start > timeout:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the run ended or hung before it could be interrupted: {err[-2000:]}")
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def _frames_in(path):
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 0
    return text.count("Properties=")


@pytest.mark.parametrize("command", ["optimize", "md"])
def test_sigint_leaves_a_readable_partial_file_and_the_old_output(tmp_path, command):
    """Ctrl-C after a few structures (optimize) or frames (md): exit status 130,
    NAME untouched, NAME.partial readable with only complete frames."""
    # Before: optimize lost everything; md left a truncated NAME that looked complete.
    path = tmp_path / "in.xyz"
    ase.io.write(path, waters(40) if command == "optimize" else waters(1), format="extxyz")
    out = tmp_path / "out.xyz"
    out.write_text(SENTINEL)
    options = (["--fmax", "1e-5", "--steps", "300", "--per-structure"] if command == "optimize"
               else ["--steps", "1000000", "--interval", "1", "--seed", "3"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchani_fast.cli", command, str(path), "-o", str(out), "-d", "cpu",
         "-m", "ANI1x", "--no-progress", *options],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path)
    partial = Path(str(out) + ".partial")
    status, err = _interrupt_when(proc, lambda: _frames_in(partial) >= 2)
    assert status == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert out.read_text() == SENTINEL
    frames = ase.io.read(partial, index=":", format="extxyz")
    assert len(frames) >= 2
    assert all(np.isfinite(a.get_potential_energy()) for a in frames)
    if command == "md":
        log = Path(str(tmp_path / "out.log") + ".partial")
        assert log.read_text().splitlines()[0].split()[0] == "Time[ps]"
