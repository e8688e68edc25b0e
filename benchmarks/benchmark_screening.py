"""Screening throughput: the local ``torchani-fast energy`` against Dask with 1 and 2 workers.

Workloads (energies, float32, the default batches of 64):
  * CH4: 20 000 frames of CH4-5.xyz (its 2 048 frames repeated);
  * 2iuz: 2 000 conformers of the 2iuz ligand (46 atoms), Gaussian-perturbed (0.05 Å).

Each is run end to end (read, batch, evaluate, write the JSON) by the local command in
this process with one thread, then by ``torchani_fast.screen`` on a LocalCluster of 1 and
of 2 single-threaded worker processes on 127.0.0.1 (models already loaded: the
cluster's start and each worker's model load are timed separately). Printed: structures/s,
speed-up over the local process, parallel efficiency (2 workers / (2 x 1 worker)) and
per-task overhead ((1-worker time - local time) / batches, against a batch's compute).

    python benchmarks/benchmark_screening.py [--ch4 20000] [--conformers 2000]
"""
import argparse
import json
import os
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
    args = parser.parse_args()

    from distributed import Client, LocalCluster

    import ase.io

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        inputs = _inputs(tmp, args.ch4, args.conformers)
        warm = tmp / "warm.xyz"
        ase.io.write(warm, ase.io.read(MOLECULES / "CH4-5.xyz", index=":8"), format="extxyz")
        _local(warm, tmp / "w.json")  # loads the model in this process
        times = {name: {"local": _local(path, tmp / "local.json")} for name, (path, _) in inputs.items()}
        tasks: dict = {name: {} for name in inputs}
        for workers in (1, 2):
            t0 = time.perf_counter()
            with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                              host="127.0.0.1", dashboard_address=None) as cluster, \
                    Client(cluster) as client:
                client.wait_for_workers(workers)
                started = time.perf_counter() - t0
                t1 = time.perf_counter()
                for _ in range(workers):  # every worker imports torch, loads the model
                    _dask(client, warm, tmp / "w.json")
                loaded = time.perf_counter() - t1
                print(f"{workers} worker(s): cluster start {started:.1f} s, first run (imports, "
                      f"model load) {loaded:.1f} s", flush=True)
                for name, (path, n) in inputs.items():
                    out = tmp / f"dask{workers}.json"
                    times[name][workers], tasks[name][workers] = _dask(client, path, out)
                    local = tmp / "check.json"
                    _local(path, local)  # same bytes as the local command (1 thread)
                    assert out.read_bytes() == local.read_bytes(), f"{name}: results differ"
        print(f"\n{'workload':26} {'local/s':>8} {'1w/s':>8} {'2w/s':>8} {'str/s local':>11} "
              f"{'1w':>7} {'2w':>7} {'2w/1w':>6} {'eff':>5} {'2w/local':>8} {'task/ms':>8} "
              f"{'ovh/ms':>7} {'ovh%':>5}")
        for name, (path, n) in inputs.items():
            t = times[name]
            compute = tasks[name][1]  # 1 worker: wall = sum of task computes + overheads
            per_task = sum(compute) / len(compute)
            overhead = t[1] / len(compute) - per_task
            print(f"{name:26} {t['local']:8.2f} {t[1]:8.2f} {t[2]:8.2f} {n / t['local']:11.0f} "
                  f"{n / t[1]:7.0f} {n / t[2]:7.0f} {t[1] / t[2]:6.2f} {t[1] / t[2] / 2:5.2f} "
                  f"{t['local'] / t[2]:8.2f} {per_task * 1e3:8.1f} {overhead * 1e3:7.1f} "
                  f"{100 * overhead / per_task:5.1f}")
        print(json.dumps({k: {str(w): round(v, 3) for w, v in d.items()} for k, d in times.items()}))
        print("task/ms: mean compute of a batch task on the worker (Dask's task stream); ovh/ms: "
              "1-worker wall time per task beyond it (scan, scheduling, transfer, writing)")


if __name__ == "__main__":
    sys.exit(main())
