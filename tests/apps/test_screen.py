"""Screening on a real Dask cluster (2 single-threaded worker processes on 127.0.0.1).

The reference is the local ``torchani-fast energy|optimize`` command run in this
process on the same file: the cluster's output file must be the same bytes
(so the same float bits, layout and input order).
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import ase.build
import ase.io
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

distributed = pytest.importorskip("distributed")

from torchani_fast import cli, screen as screen_fn  # noqa: E402

screen_module = sys.modules["torchani_fast.screen"]
files_module = sys.modules["torchani_fast.apps.screen_files"]  # OUTPUT.partial and the final file
DATA = Path(__file__).resolve().parents[1] / "data"
ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = Path(os.environ.get("TORCHANI_DATA_DIR", "~/.local/share/Torchani")).expanduser() / "StateDicts"
pytestmark = pytest.mark.skipif(not (WEIGHTS / "ani2x_state_dict.pt").exists(),
                                reason=f"ANI-2x weights not in {WEIGHTS} (set TORCHANI_DATA_DIR)")


@pytest.fixture(autouse=True)
def time_limit(request):
    """Every test ends within its ``time_limit`` mark's seconds (SIGALRM), hung or not."""
    mark = request.node.get_closest_marker("time_limit")
    seconds = mark.args[0] if mark else 120

    def expire(signum, frame):
        raise TimeoutError(f"{request.node.name} ran past its {seconds} s limit")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _wait(condition, timeout, what):
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as lc, Client(lc, timeout=60) as client:
        client.wait_for_workers(2, timeout=60)
        yield client


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """CH4 frames, molecules of other sizes and two periodic frames (own cell group)."""
    frames = ase.io.read(DATA / "screen_ch4.xyz", index=":40")
    for name in ("H2O", "C6H6", "CH3CH2OH", "NH3"):
        frames.insert(len(frames) // 2, ase.build.molecule(name))
    for shift in (0.0, 0.3):
        box = ase.build.molecule("CH4")
        box.positions += 2.0 + shift
        box.cell = [8.0, 8.0, 8.0]
        box.pbc = True
        frames.insert(7, box)
    path = tmp_path_factory.mktemp("screen") / "mixed.xyz"
    ase.io.write(path, frames, format="extxyz")
    return path


def _local(tmp_path, *argv):
    """The local command's output file, run in this process with one thread as each
    worker runs: the forces' last bit (~1e-17 Ha/Å) depends on the thread count."""
    out = tmp_path / "local.out"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli.main([str(a) for a in argv] + ["-d", "cpu", "--no-progress", "-o", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return out.read_bytes()


def _loads(client):
    return client.run(screen_module._worker_loads)


@pytest.mark.time_limit(240)
@pytest.mark.parametrize("dtype,extra", [("float64", ["-f"]), ("float32", [])])
def test_energy_on_scheduler_equals_local_bit_for_bit(cluster, mixed, tmp_path, dtype, extra):
    expected = _local(tmp_path, "energy", mixed, "-t", dtype, "-b", "4", *extra)
    before = _loads(cluster)
    out = tmp_path / "dask.json"
    assert cli.main(["energy", str(mixed), "-t", dtype, "-b", "4", *extra, "-d", "cpu",
                     "--no-progress", "--scheduler", cluster.scheduler.address, "-o", str(out)]) == 0
    assert out.read_bytes() == expected  # same bits, same layout, input order
    assert not Path(str(out) + ".partial").exists()
    data = json.loads(expected)
    assert len(data["energies"]) == 46 and all(e is not None for e in data["energies"])
    # 12 batches ran, and each worker built this model at most once, with one thread.
    after = _loads(cluster)
    assert all(after[w] - before.get(w, 0) <= 1 for w in after), (before, after)
    assert set(cluster.run(lambda: __import__("torch").get_num_threads()).values()) == {1}


@pytest.mark.time_limit(240)
def test_api_returns_results_in_input_order(cluster, mixed):
    results = screen_fn([mixed], client=cluster, dtype="float64", device="cpu", forces=True,
                        batch_size=4)
    frames = ase.io.read(mixed, index=":")
    assert [r["frame"] for r in results] == list(range(len(frames)))
    assert [r["natoms"] for r in results] == [len(a) for a in frames]
    assert all(np.array(r["forces"]).shape == (len(a), 3) for r, a in zip(results, frames))


@pytest.mark.time_limit(120)
def test_client_that_is_not_the_default_one(cluster, mixed):
    """screen(client=...) with a newer client around (Dask's default). The given
    client's futures used to be tracked on the default client's event loop, whose
    callbacks then ran late or never (a benchmark waited forever): every future is
    now tracked on its own client's loop."""
    from distributed import Client, as_completed, default_client

    loops = []
    update = as_completed.update

    def checked_update(self, futures):
        futures = list(futures)
        loops.extend((self.loop, f.client.loop) for f in futures)
        return update(self, futures)

    expected = screen_fn([mixed], client=cluster, device="cpu", batch_size=4)
    with Client(cluster.scheduler.address, timeout=60) as other, \
            pytest.MonkeyPatch.context() as mp:
        assert default_client() is other and other.loop is not cluster.loop
        mp.setattr(as_completed, "update", checked_update)
        assert screen_fn([mixed], client=cluster, device="cpu", batch_size=4) == expected
    assert loops and all(tracked is own for tracked, own in loops)


@pytest.mark.time_limit(300)
def test_optimize_on_scheduler_equals_local(cluster, tmp_path):
    frames = ase.io.read(DATA / "screen_ch4.xyz", index=":3") + [ase.build.molecule("H2O")]
    path = tmp_path / "start.xyz"
    ase.io.write(path, frames, format="extxyz")
    args = ["optimize", path, "--fmax", "0.05", "--steps", "30"]
    expected = _local(tmp_path, *args)
    out = tmp_path / "dask.xyz"
    assert cli.main([str(a) for a in args] + ["-d", "cpu", "--no-progress", "--scheduler",
                                              cluster.scheduler.address, "-o", str(out)]) == 0
    assert out.read_bytes() == expected


@pytest.mark.time_limit(300)
def test_killed_worker_loses_nothing(cluster, tmp_path):
    path = DATA / "screen_ch4.xyz"
    expected = _local(tmp_path, "energy", path, "-t", "float64", "-f", "-b", "2")
    pids = cluster.run(os.getpid)
    killed = []

    def kill_one(records):  # at the first result: 40+ batches are queued or running
        if not killed:
            victim = sorted(pids.values())[0]
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)

    out = tmp_path / "dask.json"
    results = screen_fn([path], client=cluster, dtype="float64", device="cpu", forces=True,
                        batch_size=2, output=out, callback=kill_one)
    assert killed
    assert out.read_bytes() == expected
    assert [r["frame"] for r in results] == list(range(96))  # each structure once, in order
    cluster.wait_for_workers(2, timeout=60)  # the nanny restarted the killed one
    assert killed[0] not in cluster.run(os.getpid).values()


def _cli_process(*argv):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "torchani_fast.cli", *map(str, argv)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _records(partial: Path) -> list:
    """The structures of the complete task lines (a JSON list each) after the header."""
    lines = partial.read_bytes().split(b"\n")[1:-1]  # the last: empty, or being written
    return [rec["i"] for line in lines for rec in json.loads(line)]


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """480 small frames: with one structure per task the run lasts a few seconds."""
    frames = ase.io.read(DATA / "screen_ch4.xyz", index=":") * 5
    path = tmp_path_factory.mktemp("many") / "many.xyz"
    ase.io.write(path, frames, format="extxyz")
    return path


@pytest.mark.time_limit(300)
def test_resume_after_sigint(cluster, many, tmp_path):
    out = tmp_path / "dask.json"
    partial = Path(str(out) + ".partial")
    proc = _cli_process("energy", many, "-t", "float64", "-b", "1", "-d", "cpu", "--no-progress",
                        "--scheduler", cluster.scheduler.address, "-o", out)
    try:
        _wait(lambda: partial.exists() and len(_records(partial)) >= 5, 120, "first records")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not out.exists()  # nothing that looks complete
    first = _records(partial)
    assert 5 <= len(first) < 480 and len(set(first)) == len(first)

    computed = []
    results = screen_fn([many], client=cluster, dtype="float64", device="cpu", batch_size=1,
                        output=out, resume=True, callback=lambda recs: computed.extend(r["i"] for r in recs))
    assert not set(computed) & set(first)  # nothing recomputed
    assert sorted(computed + first) == list(range(480))  # nothing missing or twice
    assert len(results) == 480 and not partial.exists()
    assert out.read_bytes() == _local(tmp_path, "energy", many, "-t", "float64", "-b", "1")


@pytest.mark.time_limit(240)
def test_bad_structures_are_reported_and_do_not_stop_the_run(cluster, tmp_path):
    good = ase.io.read(DATA / "screen_ch4.xyz", index=":12")
    frames = [a.copy() for a in good]
    frames[3].numbers[2] = 26  # iron, atom 3
    frames[8].positions[1, 0] = np.nan
    bad = tmp_path / "bad.xyz"
    ase.io.write(bad, frames, format="extxyz")
    out = tmp_path / "dask.json"
    assert cli.main(["energy", str(bad), "-t", "f64", "-d", "cpu", "--no-progress", "--scheduler",
                     cluster.scheduler.address, "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    # The local command's messages (torchani_fast.apps.structures.check_structure).
    assert (f"{bad}, frame 3: element Fe (atomic number 26) at atom 2 (counting from 0) is not "
            "supported by ANI2x") in data["structures"][3]["error"]
    assert f"{bad}, frame 8: atom 1 has non-finite coordinates" in data["structures"][8]["error"]
    assert data["energies"][3] is None and data["energies"][8] is None
    assert [k for k, s in enumerate(data["structures"]) if "error" in s] == [3, 8]
    # The others: the same bits as the local command on the good frames alone.
    ok = [a for k, a in enumerate(ase.io.read(bad, index=":")) if k not in (3, 8)]
    ase.io.write(tmp_path / "ok.xyz", ok, format="extxyz")
    ref = json.loads(_local(tmp_path, "energy", tmp_path / "ok.xyz", "-t", "f64"))
    assert [e for k, e in enumerate(data["energies"]) if k not in (3, 8)] == ref["energies"]


@pytest.mark.time_limit(240)
def test_partial_file_is_never_overwritten_or_mixed(cluster, tmp_path):
    path = DATA / "screen_ch4.xyz"
    out = tmp_path / "o.json"
    partial = Path(str(out) + ".partial")
    partial.write_text(json.dumps({"torchani_fast_screen": {"files": ["other.xyz"]}}) + "\n")
    with pytest.raises(screen_module.ScreenError, match="pass --resume"):
        screen_fn([path], client=cluster, output=out)
    with pytest.raises(screen_module.ScreenError, match="other inputs or options"):
        screen_fn([path], client=cluster, output=out, resume=True)
    partial.write_text(json.dumps({"torchani_fast_screen": {"version": 1, "files": [str(path)]}}) + "\n")
    with pytest.raises(screen_module.ScreenError, match=r"another torchani_fast \(partial file "
                                                         r"format 1, this one writes 3\)"):
        screen_fn([path], client=cluster, output=out, resume=True)
    with pytest.raises(SystemExit) as exc:  # needs a cluster: a usage error
        cli.main(["energy", str(path), "--resume", "-o", str(out)])
    assert exc.value.code == 2


@pytest.mark.time_limit(180)
def test_scheduler_going_away_leaves_a_resumable_partial(many, tmp_path):
    sched_file = tmp_path / "scheduler.json"
    dask = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT="3s")
    procs = [subprocess.Popen(dask + ["--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                                      "--scheduler-file", str(sched_file)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait(lambda: sched_file.exists() and sched_file.stat().st_size > 0, 60, "the scheduler")
        address = json.loads(sched_file.read_text())["address"]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1",
             "--nworkers", "1", "--host", "127.0.0.1", "--no-dashboard"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        out = tmp_path / "dask.json"
        partial = Path(str(out) + ".partial")
        run = subprocess.Popen([sys.executable, "-m", "torchani_fast.cli", "energy", str(many),
                                "-b", "1", "-d", "cpu", "--no-progress", "--scheduler", address,
                                "-o", str(out)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        procs.append(run)
        _wait(lambda: partial.exists() and len(_records(partial)) >= 3, 120, "first records")
        procs[0].kill()  # the scheduler goes away
        _, err = run.communicate(timeout=90)
        assert run.returncode == 1, err
        assert "--resume" in err and "error" in err
        assert not out.exists() and len(_records(partial)) >= 3
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


@pytest.mark.time_limit(240)
def test_joined_batches_give_the_same_results(cluster, mixed):
    """Batches travel joined into tasks (fewer round trips); the results do not depend on it."""
    runs = {}
    for task_atoms in (0, 30, screen_module._TASK_ATOMS):
        tasks = []
        runs[task_atoms] = screen_fn([mixed], client=cluster, dtype="float64", device="cpu",
                                     forces=True, batch_size=4, task_atoms=task_atoms,
                                     callback=lambda recs: tasks.append(len(recs)))
        runs[task_atoms, "tasks"] = tasks
    assert runs[0] == runs[30] == runs[screen_module._TASK_ATOMS]
    assert len(runs[0, "tasks"]) == 12  # one batch of up to 4 per task: 46 structures
    assert 1 < len(runs[screen_module._TASK_ATOMS, "tasks"]) < 12
    assert len(runs[screen_module._TASK_ATOMS, "tasks"]) < len(runs[30, "tasks"]) < 12
    with pytest.raises(screen_module.ScreenError, match="task_atoms must be an integer >= 0, got -1"):
        screen_fn([mixed], client=cluster, task_atoms=-1)
    with pytest.raises(screen_module.ScreenError, match="hessian must be 'lindh' or 'ase', got 'unit'"):
        screen_fn([mixed], "optimize", client=cluster, hessian="unit")


@pytest.mark.time_limit(240)
def test_final_file_from_kept_records_or_from_the_partial_file(cluster, mixed, tmp_path, monkeypatch):
    """The final file is the same whether its records were kept in memory, read back
    from OUTPUT.partial, or some of each."""
    texts = []
    for keep in (files_module._KEEP_BYTES, 0, 3000):
        monkeypatch.setattr(files_module, "_KEEP_BYTES", keep)
        out = tmp_path / f"keep{keep}.json"
        screen_fn([mixed], client=cluster, dtype="float64", device="cpu", forces=True,
                  batch_size=4, task_atoms=0, output=out, return_results=False)
        texts.append(out.read_bytes())
    assert texts[0] == texts[1] == texts[2]
    assert len(json.loads(texts[0])["energies"]) == len(ase.io.read(mixed, index=":"))


def _batches(sizes):
    items = iter(range(10 ** 6))
    return [[{"natoms": n, "i": next(items)} for n in batch] for batch in sizes]


@pytest.mark.parametrize("nthreads", [1, 2, 8])
def test_join_batches_largest_first_single_batches_last(nthreads):
    batches = _batches([[5] * 64] * 125 + [[46] * 64] * 3)
    tasks = screen_module._join_batches(batches, 8192, nthreads)
    assert [b for task in tasks for b in task] == batches  # every batch once, in order
    atoms = [sum(i["natoms"] for b in task for i in b) for task in tasks]
    assert max(atoms) <= 8192 + 46 * 64  # the cap, overshot by at most one batch
    assert len(tasks[-1]) == 1 and len(tasks[-2]) == 1  # the last tasks: single batches
    assert len(tasks) < 40  # instead of 128
    assert screen_module._join_batches(batches, 0, nthreads) == [[b] for b in batches]


def test_task_results_travel_as_one_pickle():
    """A task's records reach the client in one message frame, not one per record."""
    from distributed.protocol import deserialize, serialize, to_serialize

    records = [{"i": i, "energy": -40.5 - i} for i in range(1000)]
    _, frames = serialize(to_serialize(records))
    assert len(frames) >= 1000  # what Dask does with a list: the reason for _Shipped
    header, frames = serialize(to_serialize(screen_module._Shipped(records)))
    assert len(frames) <= 2
    assert deserialize(header, frames).records == records


@pytest.mark.parametrize("indent", [None, 0, 2, 4])
@pytest.mark.parametrize("forces", [False, True])
def test_energy_file_is_json_dumps(indent, forces):
    """The final energy file (templated structure entries) is json.dumps of its dict."""
    import io

    files = ["a.xyz", 'we"ird %d é.xyz']
    items = [{"file": files[i % 2], "frame": i // 2, "natoms": 3 + i % 4} for i in range(9)]
    recs = [{"energy": -40.5 - i / 7, "forces": [[0.1 * i, -0.5, 1e-300]] * item["natoms"]}
            for i, item in enumerate(items)]
    recs[4] = {"error": "a.xyz, frame 2: no element Xx"}
    recs[7]["energy"] = float("nan")
    out = io.StringIO()
    files_module._write_energy(out, items, recs.__getitem__, {"forces": forces, "hessians": False},
                                indent)
    expected = {"energies": [r.get("energy") for r in recs]}
    if forces:
        expected["forces"] = [r.get("forces") for r in recs]
    expected["structures"] = [dict(item, **({"error": r["error"]} if "error" in r else {}))
                              for item, r in zip(items, recs)]
    assert out.getvalue() == json.dumps(expected, indent=indent) + "\n"


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=20),
       st.integers(0, 4), st.integers(0, 3))
@settings(max_examples=300, deadline=None)
def test_dumps_is_json_dumps(value, indent, level):
    """The energy file's encoder writes what json.dumps(indent=...) writes, NaN and all."""
    expected = json.dumps(value, indent=indent).replace("\n", "\n" + " " * (indent * level))
    assert files_module._dumps(value, indent, level) == expected


@pytest.mark.time_limit(120)
def test_local_cluster_workers_run_without_the_profiler():
    """--workers N: one-thread workers without Dask's 10 ms stack sampler, slower ticks."""
    from distributed import Client

    with screen_module.local_cluster(1) as cluster, Client(cluster) as client:
        import dask

        (config,) = client.run(lambda: {k: dask.config.get(k)
                                        for k in screen_module._LOCAL_CLUSTER_CONFIG}).values()
        (threads,) = client.nthreads().values()
    assert config == screen_module._LOCAL_CLUSTER_CONFIG and threads == 1
    assert config["distributed.worker.profile.enabled"] is False


@pytest.mark.time_limit(240)
def test_files_of_other_formats_travel_with_their_tasks(cluster, mixed, tmp_path):
    """A trajectory file (not extended XYZ: read on the client, shipped) beside a lazy XYZ."""
    import ase.io.trajectory

    traj = tmp_path / "frames.traj"
    with ase.io.trajectory.Trajectory(str(traj), "w") as writer:
        for atoms in ase.io.read(DATA / "screen_ch4.xyz", index="40:46") + [ase.build.molecule("C6H6")]:
            writer.write(atoms)
    expected = _local(tmp_path, "energy", traj, mixed, "-t", "float64", "-f", "-b", "3")
    out = tmp_path / "dask.json"
    results = screen_fn([traj, mixed], client=cluster, dtype="float64", device="cpu", forces=True,
                        batch_size=3, output=out)
    assert out.read_bytes() == expected
    assert [r["file"] for r in results[:7]] == [str(traj)] * 7 and results[6]["natoms"] == 12
