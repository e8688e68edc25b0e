"""Large periodic water boxes: time per energy+forces and peak memory.

Cubic boxes of randomly oriented water molecules on a grid at liquid density
(0.1 atoms/Å^3, a little jitter), ``per_side**3`` molecules. Each
(implementation, size) runs in a fresh subprocess so that its peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) is its own; the subprocess
warms up on an 81-atom box first (one-time packing and allocator costs), then
times ``repeats`` energy+forces evaluations of the large box. Usage::

    python benchmarks/benchmark_large.py                    # default sizes and implementations
    python benchmarks/benchmark_large.py --sizes 10 22      # molecules per box edge
    python benchmarks/benchmark_large.py --breakdown 22     # torchani_fast stage by stage
    python benchmarks/benchmark_large.py --check 10         # float64 exactness vs TorchANI

Implementations: ``fast`` (``torchani_fast.patch``, neighbour strategy "auto"),
``torchani-cell_list`` (``ANI2x(neighborlist="cell_list")``, TorchANI's pure
PyTorch cell list: one molecule, full pbc) and ``torchani-all_pairs`` (TorchANI's
default, O(N^2) memory under pbc). TorchANI runs only up to ``--torchani-max``
atoms (``--all-pairs-max`` for all_pairs), each run under a time limit and an
address-space limit so that it cannot exhaust a shared machine.

Needs TORCHANI_DATA_DIR pointing at the offline ANI weights (see ../shared).
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("TORCHANI_FAST_SHARED", HERE.parent / ".." / "shared")).resolve()
os.environ.setdefault("TORCHANI_DATA_DIR", str(SHARED / "torchani-data"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHANI_NO_WARN_EXTENSIONS", "1")

# Liquid water: 0.0334 molecules/Å^3 (about 0.1 atoms/Å^3), i.e. one molecule per
# (3.104 Å)^3 grid cell.
WATER_SPACING = (1.0 / 0.03343) ** (1.0 / 3.0)


def water_box(per_side, spacing=WATER_SPACING, jitter=0.1, seed=0):
    """A cubic periodic box of ``per_side**3`` randomly oriented water molecules.

    Returns (atomic numbers (N,) int64, positions (N, 3) float64, cell edge in Å).
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    # Gas-phase geometry (O-H 0.958 Å, H-O-H 104.5°), oxygen at the origin.
    mol = np.array([[0.0, 0.0, 0.0], [0.0, 0.7572, -0.5865], [0.0, -0.7572, -0.5865]])
    n = per_side ** 3
    q = rng.normal(size=(n, 4))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    w, x, y, z = q.T
    rot = np.stack([
        np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)], -1),
        np.stack([2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)], -1),
        np.stack([2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)], -1),
    ], 1)  # (n, 3, 3)
    grid = np.stack(np.meshgrid(*(np.arange(per_side),) * 3, indexing="ij"), -1).reshape(-1, 3)
    centres = (grid + 0.5) * spacing + rng.uniform(-jitter, jitter, size=(n, 3))
    pos = centres[:, None, :] + np.einsum("nij,aj->nai", rot, mol)
    numbers = np.tile(np.array([8, 1, 1]), n)
    return numbers, pos.reshape(-1, 3), per_side * spacing


IMPLS = ("fast", "torchani-cell_list", "torchani-all_pairs")


# ----------------------------------------------------------------------------- worker side

def _status(key):
    """VmRSS / VmHWM of this process in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _reset_peak():
    """Reset VmHWM to the current RSS (Linux >= 4.0); False if not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _build_model(impl, dtype):
    import torchani

    nl = "cell_list" if impl == "torchani-cell_list" else "all_pairs"
    model = torchani.models.ANI2x(neighborlist=nl).to(dtype)
    if impl == "fast":
        import torchani_fast

        torchani_fast.patch(model)
    return model


def _system(per_side, dtype):
    import torch

    numbers, pos, edge = water_box(per_side)
    species = torch.tensor(numbers).unsqueeze(0)
    coords = torch.tensor(pos, dtype=dtype).unsqueeze(0)
    cell = torch.eye(3, dtype=dtype) * edge
    pbc = torch.tensor([True, True, True])
    return species, coords, cell, pbc


def _energy_forces(model, species, coords, cell, pbc):
    import torch

    x = coords.detach().clone().requires_grad_(True)
    e = model((species, x), cell=cell, pbc=pbc).energies
    (g,) = torch.autograd.grad(e.sum(), x)
    return e.detach(), -g


def run_worker(impl, per_side, dtype_name, repeats, threads):
    import torch

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    model = _build_model(impl, dtype)
    _energy_forces(model, *_system(3, dtype))  # warm-up, same elements
    system = _system(per_side, dtype)
    n = system[0].shape[1]
    rss_before = _status("VmRSS")
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        energy, forces = _energy_forces(model, *system)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        del forces
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    nn = type(model.potentials["nnp"].neural_networks).__name__
    return dict(impl=impl, atoms=n, dtype=dtype_name, threads=threads, times_s=times,
                cpu_s=cpu, best_s=min(times), us_per_atom=1e6 * min(times) / n,
                cpu_us_per_atom=1e6 * min(cpu) / n, peak_rss_mb=peak,
                rss_before_mb=rss_before, energy=float(energy.sum()), networks=nn)


def _saved_tensor_bytes(root):
    """Bytes held by autograd for backward, by node type (tensors counted once)."""
    import torch

    seen_nodes, seen_data, by_node = set(), set(), {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)
            except Exception:  # noqa: BLE001  (released or unreadable)
                continue
            values = value if isinstance(value, (tuple, list)) else (value,)
            for v in values:
                if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in seen_data:
                    seen_data.add(v.untyped_storage().data_ptr())
                    name = type(node).__name__
                    by_node[name] = by_node.get(name, 0) + v.untyped_storage().nbytes()
        stack.extend(f for f, _ in node.next_functions)
    return by_node


def run_breakdown(per_side, dtype_name, threads):
    """torchani_fast stage by stage: time, RSS before/after and peak RSS of each stage.

    Also the bytes that autograd keeps for the backward pass after the forward,
    by the kind of node that keeps them (read from the nodes' ``_saved_*``
    attributes; the compiled AEV op's own saved inputs are not visible there and
    are the neighbour list's tensors).
    """
    import torch

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    model = _build_model("fast", dtype)
    _energy_forces(model, *_system(3, dtype))
    species, coords, cell, pbc = _system(per_side, dtype)
    nnp = model.potentials["nnp"]
    stages = []
    can_reset = _reset_peak()

    def stage(name, fn):
        before = _status("VmRSS")
        _reset_peak()
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        # VmHWM was reset at the start of the stage: it is the stage's own peak.
        stages.append(dict(stage=name, seconds=dt, cpu_seconds=cpu, rss_before_mb=before,
                           rss_after_mb=_status("VmRSS"),
                           peak_mb=_status("VmHWM") if can_reset else None))
        return out

    x = coords.detach().clone().requires_grad_(True)
    elem = model.species_converter(species)
    nb = stage("neighbour list", lambda: model.neighborlist(model.cutoff, elem, x, cell, pbc))
    aev = stage("aev", lambda: nnp.aev_computer.compute_from_neighbors(elem, x, nb))
    energies = stage("networks", lambda: nnp.neural_networks(elem, aev, False, False))
    saved = _saved_tensor_bytes(energies.grad_fn)
    num_pairs = nb.indices.shape[1]
    del nb
    aev_mb = aev.untyped_storage().nbytes() / 2**20
    del aev
    stage("backward", lambda: torch.autograd.grad(energies.sum(), x))
    return dict(atoms=species.shape[1], dtype=dtype_name, threads=threads, pairs=num_pairs,
                aev_mb=aev_mb, networks=type(nnp.neural_networks).__name__,
                stages=stages, saved_for_backward_mb={k: v / 2**20 for k, v in
                                                      sorted(saved.items(), key=lambda kv: -kv[1])},
                # ru_maxrss is reset along with VmHWM, so the peak is the stages' largest.
                peak_rss_mb=max((st["peak_mb"] or 0.0) for st in stages) if can_reset else None)


def run_check(per_side, threads, impls):
    """float64: torchani_fast against TorchANI on the same box."""
    import torch

    torch.set_num_threads(threads)
    system = _system(per_side, torch.float64)
    fast = _build_model("fast", torch.float64)
    t0 = time.perf_counter()
    e1, f1 = _energy_forces(fast, *system)
    t_fast = time.perf_counter() - t0
    del fast
    out = dict(atoms=system[0].shape[1], fast_s=t_fast, energy=float(e1.sum()), references=[])
    for impl in impls:
        ref = _build_model(impl, torch.float64)
        t0 = time.perf_counter()
        e0, f0 = _energy_forces(ref, *system)
        out["references"].append(dict(
            impl=impl, seconds=time.perf_counter() - t0,
            energy_rel_diff=float(((e1 - e0).abs() / e0.abs()).max()),
            forces_max_abs_diff=float((f1 - f0).abs().max()),
            forces_max_abs=float(f0.abs().max())))
        del ref
    return out


# ----------------------------------------------------------------------------- driver side

def _limit_memory(gb):
    def apply():
        limit = int(gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return apply


def spawn(argv, timeout, memory_gb):
    """Run this script in a subprocess; its JSON result, or an error dict."""
    cmd = [sys.executable, str(Path(__file__).resolve())] + argv
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=_limit_memory(memory_gb))
    except subprocess.TimeoutExpired:
        return dict(error=f"over the {timeout:.0f} s limit")
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return dict(error=f"exit {proc.returncode}: {tail[:200]}",
                    wall_s=time.perf_counter() - t0)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[7, 10, 14, 22, 32],
                        help="water molecules per box edge (atoms = 3 * n^3)")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=0,
                        help="timed evaluations per size (default: 3, 1 above 50k atoms)")
    parser.add_argument("--torchani-max", type=int, default=9000,
                        help="largest box (atoms) given to TorchANI's cell_list")
    parser.add_argument("--all-pairs-max", type=int, default=1100,
                        help="largest box (atoms) given to TorchANI's all_pairs")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--memory-gb", type=float, default=12.0, help="address space per run")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--breakdown", type=int, metavar="PER_SIDE",
                        help="stage-by-stage time and memory of torchani_fast")
    parser.add_argument("--check", type=int, metavar="PER_SIDE",
                        help="float64 energies and forces against TorchANI")
    parser.add_argument("--worker", choices=IMPLS + ("breakdown", "check"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:  # inside the subprocess: one JSON line on stdout
        n = args.sizes[0]
        if args.worker == "breakdown":
            result = run_breakdown(n, args.dtype, args.threads)
        elif args.worker == "check":
            result = run_check(n, args.threads, [i for i in args.impls if i != "fast"])
        else:
            result = run_worker(args.worker, n, args.dtype, args.repeats, args.threads)
        print(json.dumps(result))
        return 0

    common = ["--dtype", args.dtype, "--threads", str(args.threads)]
    if args.breakdown:
        result = spawn(["--worker", "breakdown", "--sizes", str(args.breakdown)] + common,
                       args.timeout, args.memory_gb)
        print(json.dumps(result, indent=1))
        return 0
    if args.check:
        atoms = 3 * args.check ** 3
        impls = [i for i in args.impls if i != "fast" and
                 atoms <= (args.all_pairs_max if i == "torchani-all_pairs" else args.torchani_max)]
        result = spawn(["--worker", "check", "--sizes", str(args.check), "--impls", "fast"] + impls
                       + ["--threads", str(args.threads)], args.timeout, args.memory_gb)
        print(json.dumps(result, indent=1))
        return 0

    rows = []
    print("| atoms | implementation | networks | time/E+F (s) | µs/atom | CPU µs/atom "
          "| peak RSS (MB) |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for per_side in args.sizes:
        atoms = 3 * per_side ** 3
        repeats = args.repeats or (3 if atoms <= 50000 else 1)
        for impl in args.impls:
            limit = {"torchani-cell_list": args.torchani_max,
                     "torchani-all_pairs": args.all_pairs_max}.get(impl)
            if limit is not None and atoms > limit:
                result = dict(impl=impl, atoms=atoms, error=f"skipped (> {limit} atoms)")
            else:
                result = spawn(["--worker", impl, "--sizes", str(per_side), "--repeats",
                                str(repeats)] + common, args.timeout, args.memory_gb)
                result.setdefault("impl", impl)
                result.setdefault("atoms", atoms)
            rows.append(result)
            if "error" in result:
                print(f"| {atoms} | {impl} | | {result['error']} | | | |", flush=True)
            else:
                print(f"| {atoms} | {impl} | {result['networks']} | {result['best_s']:.3f} | "
                      f"{result['us_per_atom']:.1f} | {result['cpu_us_per_atom']:.1f} | "
                      f"{result['peak_rss_mb']:.0f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
