"""The one output writer (torchani_fast.apps.output) of the command line and the
screening driver: it refuses to overwrite an input, writes through symbolic
links, and never lets two runs write into one file.

Before issue 60: ``energy in.xyz -o in.xyz`` overwrote its input and exited 0;
``-o link`` replaced the link by a file; two runs with the same ``-o`` opened the
same ``NAME.partial`` (the second truncated it under the first: one run exited 0
with a file of NUL bytes and frames of both).
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import ase.io
import pytest
import torch
from ase.build import molecule
from hypothesis import given, settings
from hypothesis import strategies as st

from torchani_fast import cli, models
from torchani_fast.apps import output as _output
from torchani_fast.apps.screen_files import _Partial

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def model_cache(monkeypatch, weights):
    """The CLI's model cache served with ANI-2x member 0 (no weights read per run)."""
    from torchani_fast.models import ANI2x

    for dtype in ("float32", "float64"):
        monkeypatch.setitem(models._LOADED, models.cache_key("ANI2x", dtype=getattr(torch, dtype)),
                            ANI2x(model_index=0, dtype=getattr(torch, dtype)))


def _run(capsys, *argv):
    try:
        status = cli.main([str(a) for a in argv])
    except SystemExit as exc:
        status = exc.code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return status, captured.err


@pytest.fixture
def water(tmp_path):
    path = tmp_path / "in.xyz"
    ase.io.write(path, [molecule("H2O"), molecule("H2O")], format="extxyz")
    return path


@pytest.mark.parametrize("command", ["energy", "optimize", "md"])
@pytest.mark.parametrize("through_link", [False, True])
def test_output_that_is_the_input_is_refused(capsys, water, command, through_link):
    before = water.read_bytes()
    out = water
    if through_link:
        out = water.with_name("link.xyz")
        out.symlink_to(water)
    status, err = _run(capsys, command, water, "-o", out, "-d", "cpu", "--no-progress")
    assert status == 2 and "overwrite" in err and str(water.name) in err
    assert water.read_bytes() == before
    assert not Path(str(water) + ".partial").exists()


def test_output_through_a_link_fills_the_linked_file(capsys, model_cache, water, tmp_path):
    real = tmp_path / "results" / "energies.json"
    real.parent.mkdir()
    link = tmp_path / "latest.json"
    link.symlink_to(real)
    status, err = _run(capsys, "energy", water, "-o", link, "-d", "cpu", "--no-progress")
    assert status == 0, err
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert len(json.loads(real.read_text())["energies"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.xyz", "latest.json", "results"]
    assert [p.name for p in real.parent.iterdir()] == ["energies.json"]


def test_partial_file_is_locked_while_a_run_writes_it(tmp_path):
    out = tmp_path / "out.xyz"
    first = _output.PartialFile(out)
    first.write("first run\n")
    with pytest.raises(OSError, match=r"out\.xyz\.partial is being written by another run"):
        _output.PartialFile(out)
    first.write("still the first run\n")
    first.commit()
    assert out.read_text() == "first run\nstill the first run\n"
    second = _output.PartialFile(out)  # free again once the first run committed
    second.write("second run\n")
    second.commit()
    assert out.read_text() == "second run\n"


def test_screen_partial_file_is_locked_while_a_run_writes_it(tmp_path):
    out = tmp_path / "out.json"
    header = {"version": 0}
    first = _Partial(out, header, resume=False)
    with pytest.raises(OSError, match="being written by another run"):
        _Partial(out, header, resume=True)
    first.write([{"i": 0, "energy": 1.0}])
    first.close()
    again = _Partial(out, header, resume=True)
    assert set(again.done) == {0}
    again.close()


def test_write_atomic_from_concurrent_writers_leaves_one_complete_text(tmp_path):
    out = tmp_path / "out.json"
    texts = [json.dumps({"writer": k, "data": [k] * 20000}) + "\n" for k in range(4)]
    errors = []

    def write(text):
        try:
            for _ in range(10):
                _output.write_atomic(out, text)
        except Exception as exc:  # pragma: no cover (the failure the test looks for)
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert out.read_text() in texts
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary left


def test_written_file_has_the_mode_of_a_new_file(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("x")
    _output.write_atomic(tmp_path / "atomic", "x")
    partial = _output.PartialFile(tmp_path / "streamed")
    partial.commit()
    mode = plain.stat().st_mode & 0o777
    assert (tmp_path / "atomic").stat().st_mode & 0o777 == mode
    assert (tmp_path / "streamed").stat().st_mode & 0o777 == mode


NAMES = st.sampled_from(["a.xyz", "b.xyz", "a.xyz.partial", "sub/a.xyz", "link", "sub/link2"])


@settings(max_examples=60, deadline=None)
@given(inputs=st.lists(NAMES, min_size=1, max_size=3, unique=True), output=NAMES)
def test_check_not_input_agrees_with_the_files_it_would_replace(tmp_path_factory, inputs, output):
    """Property: an output is refused exactly when it, its ``.partial`` or the file a
    link of it points to is one of the inputs (compared as real files)."""
    root = tmp_path_factory.mktemp("names")
    (root / "sub").mkdir()
    for name in ("a.xyz", "b.xyz", "a.xyz.partial", "sub/a.xyz"):
        (root / name).write_text(name)
    (root / "link").symlink_to(root / "a.xyz")
    (root / "sub" / "link2").symlink_to(root / "b.xyz")
    ins = [root / n for n in inputs]
    out = root / output
    target = Path(os.path.realpath(out))
    replaced = {str(target), os.path.realpath(str(target) + ".partial")}
    expected = any(os.path.realpath(p) in replaced for p in ins)
    try:
        _output.check_not_input(out, ins)
        refused = False
    except OSError:
        refused = True
    assert refused == expected


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_second_run_on_the_same_output_fails_and_the_first_keeps_its_file(capsys, model_cache, tmp_path):
    """A long md run writes out.xyz.partial; a second run with the same -o exits 1
    naming the file, and the first run's partial holds only its own whole frames."""
    start = tmp_path / "in.xyz"
    ase.io.write(start, molecule("H2O"), format="extxyz")
    out = tmp_path / "out.xyz"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchani_fast.cli", "md", str(start), "-o", str(out), "-d", "cpu",
         "-m", "ANI1x", "--no-progress", "--steps", "1000000", "--interval", "1", "--seed", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path)
    partial = Path(str(out) + ".partial")
    try:
        deadline = time.monotonic() + 120
        while "Properties=" not in (partial.read_text() if partial.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.1)
        status, err = _run(capsys, "md", start, "-o", out, "-d", "cpu", "--no-progress",
                           "--steps", "5", "--interval", "1", "--seed", "2")
        assert status == 1 and "being written by another run" in err
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    assert proc.returncode == 130
    data = partial.read_bytes()
    assert b"\0" not in data
    frames = ase.io.read(partial, index=":", format="extxyz")
    assert len(frames) >= 1 and not out.exists()
