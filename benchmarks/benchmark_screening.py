"""Screening throughput: the local ``torchani-fast energy`` against Dask with 1 and 2 workers.

Workloads (energies, float32, the default batches of 64):
  * CH4: 20 000 frames of CH4-5.xyz (its 2 048 frames repeated);
  * 2iuz: 2 000 conformers of the 2iuz ligand (46 atoms), Gaussian-perturbed (0.05 Å).

Each is run end to end (read, batch, evaluate, write the JSON) by the local command in
this process with one thread, then by ``torchani_fast.screen`` on a LocalCluster of 1 and
of 2 single-threaded worker processes on 127.0.0.1. Both clusters stay up; the cluster's
start and each worker's model load are timed separately, and each workload runs once on
each cluster before timing (checked against the local command's bytes), so the rounds
measure a long run's steady state. A round runs a workload locally, on 1 and on 2 workers
back to back. Printed: structures/s,
speed-up over the local process, parallel efficiency (2 workers / (2 x 1 worker)) and
per-task overhead ((1-worker wall time / tasks) - a task's mean compute, against that compute;
tasks are a few consecutive batches each, see torchani_fast.screen). Medians of --rounds runs.

    python benchmarks/benchmark_screening.py [--ch4 20000] [--conformers 2000]
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SHARED = Path(os.environ.get("TORCHANI_FAST_SHARED", Path(__file__).resolve().parents[1] / ".." / "shared"))
MOLECULES = SHARED / "molecules"  # CH4-5.xyz, 2iuz_ligand.xyz


def _inputs(folder: Path, n_ch4: int, n_conf: int) -> dict:
    import ase.io
    import numpy as np

    frames = ase.io.read(MOLECULES / "CH4-5.xyz", index=":")
    ch4 = folder / "ch4.xyz"
    ase.io.write(ch4, [frames[k % len(frames)] for k in range(n_ch4)], format="extxyz")
    ligand = ase.io.read(MOLECULES / "2iuz_ligand.xyz")
    rng = np.random.default_rng(0)
    confs = []
    for _ in range(n_conf):
        a = ligand.copy()
        a.positions += rng.normal(scale=0.05, size=a.positions.shape)
        confs.append(a)
    lig = folder / "2iuz.xyz"
    ase.io.write(lig, confs, format="extxyz")
    return {f"CH4 ({n_ch4} x 5 atoms)": (ch4, n_ch4), f"2iuz ({n_conf} x 46 atoms)": (lig, n_conf)}


def _local(path: Path, out: Path) -> float:
    import torch

    from torchani_fast import cli

    torch.set_num_threads(1)
    start = time.perf_counter()
    assert cli.main(["energy", str(path), "-d", "cpu", "--no-progress", "-o", str(out)]) == 0
    return time.perf_counter() - start


def _load_model() -> int:
    """Run on each worker: build the model the tasks will use (float32 on the CPU)."""
    import importlib

    screen = importlib.import_module("torchani_fast.screen")  # the module (the package's name is the function)
    screen._worker_model("ANI2x", "cpu", "float32")
    return screen._worker_loads()


def _dask(client, path: Path, out: Path) -> tuple:
    """(wall seconds, [compute seconds of each batch task] from Dask's task stream)."""
    from distributed import get_task_stream

    import torchani_fast

    with get_task_stream(client) as stream:
        start = time.perf_counter()
        torchani_fast.screen([path], client=client, device="cpu", output=out, return_results=False)
        wall = time.perf_counter() - start
    compute = [sum(ss["stop"] - ss["start"] for ss in t["startstops"] if ss["action"] == "compute")
               for t in stream.data if str(t["key"]).startswith("torchani-fast-")]
    return wall, compute


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ch4", type=int, default=20000)
    parser.add_argument("--conformers", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3, help="median of this many runs of each")
    args = parser.parse_args()

    import importlib

    from distributed import Client

    local_cluster = importlib.import_module("torchani_fast.screen").local_cluster  # as --workers N

    import ase.io

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        inputs = _inputs(tmp, args.ch4, args.conformers)
        warm = tmp / "warm.xyz"
        ase.io.write(warm, ase.io.read(MOLECULES / "CH4-5.xyz", index=":8"), format="extxyz")
        _local(warm, tmp / "w.json")  # loads the model in this process
        runs: dict = {name: {"local": [], 1: [], 2: []} for name in inputs}
        tasks: dict = {name: [] for name in inputs}  # 1 worker: compute seconds of each task
        expected = {}  # the local command's bytes (1 thread), which each cluster must give
        for name, (path, _) in inputs.items():
            _local(path, tmp / "check.json")
            expected[name] = (tmp / "check.json").read_bytes()
        with contextlib.ExitStack() as stack:
            clients = {}
            for workers in (1, 2):  # both clusters stay up (an idle one: ~0.02 of a core)
                t0 = time.perf_counter()
                cluster = stack.enter_context(local_cluster(workers))
                client = stack.enter_context(Client(cluster))
                client.wait_for_workers(workers)
                started = time.perf_counter() - t0
                t1 = time.perf_counter()
                client.run(_load_model)  # on every worker: imports torch, loads the model
                _dask(client, warm, tmp / "w.json")
                loaded = time.perf_counter() - t1
                print(f"{workers} worker(s): cluster start {started:.1f} s, first run (imports, "
                      f"model load) {loaded:.1f} s", flush=True)
                for name, (path, n) in inputs.items():  # a long run's steady state: warm, checked
                    out = tmp / f"dask{workers}.json"
                    _dask(client, path, out)
                    assert out.read_bytes() == expected[name], f"{name}: results differ"
                clients[workers] = client
            # Rounds: this VM's speed drifts by 10-20% from minute to minute, so each
            # round runs a workload locally, on 1 and on 2 workers back to back.
            for r in range(args.rounds):
                for name, (path, _) in inputs.items():
                    runs[name]["local"].append(_local(path, tmp / "local.json"))
                    for workers, client in clients.items():
                        wall, compute = _dask(client, path, tmp / f"dask{workers}.json")
                        runs[name][workers].append(wall)
                        if workers == 1:
                            tasks[name].append((wall, compute))
        times = {name: {k: statistics.median(v) for k, v in d.items()} for name, d in runs.items()}
        print(f"\n{'workload':26} {'local/s':>8} {'1w/s':>8} {'2w/s':>8} {'str/s local':>11} "
              f"{'1w':>7} {'2w':>7} {'2w/1w':>6} {'eff':>5} {'2w/local':>8} {'tasks':>5} "
              f"{'task/ms':>8} {'ovh/ms':>7} {'ovh%':>5}")
        for name, (path, n) in inputs.items():
            t = times[name]
            pair = statistics.median(a / b for a, b in zip(runs[name][1], runs[name][2]))
            # 1 worker, the median round: wall = the tasks' compute + what is not overlapped
            wall, compute = sorted(tasks[name])[len(tasks[name]) // 2]
            per_task = sum(compute) / len(compute)
            overhead = wall / len(compute) - per_task
            print(f"{name:26} {t['local']:8.2f} {t[1]:8.2f} {t[2]:8.2f} {n / t['local']:11.0f} "
                  f"{n / t[1]:7.0f} {n / t[2]:7.0f} {pair:6.2f} {pair / 2:5.2f} "
                  f"{t['local'] / t[2]:8.2f} {len(compute):5d} {per_task * 1e3:8.1f} "
                  f"{overhead * 1e3:7.1f} {100 * overhead / per_task:5.1f}")
        print("2 workers / 1 worker per round:", {name: [round(a / b, 2) for a, b in zip(d[1], d[2])]
                                                  for name, d in runs.items()})
        print(json.dumps({k: {str(w): round(v, 3) for w, v in d.items()} for k, d in times.items()}))
        print("tasks: Dask tasks (each a few consecutive batches); task/ms: their mean compute on the "
              "worker (Dask's task stream); ovh/ms: 1-worker wall time per task beyond it (scan, "
              "scheduling, transfer, writing); medians of the rounds (2w/1w: of each round's ratio)")


if __name__ == "__main__":
    sys.exit(main())
