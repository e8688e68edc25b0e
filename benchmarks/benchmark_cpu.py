"""Side-by-side CPU benchmark: TorchANI 2.9 vs torchani_fast (ANI-2x, float32 or float64).

Times one energy+forces evaluation (``autograd.grad`` of the summed energy) of

- ``torchani``: TorchANI 2.9 ``ANI2x()`` as it comes;
- ``torchani-infer``: ``torch.jit.script(ANI2x().to_infer_model())`` (its BMM
  ensemble; unscripted it calls CUDA NVTX and fails on CPU-only torch);
- ``fast``: ``torchani_fast.patch(ANI2x())``;
- ``fast-jit``: ``torch.jit.script`` of the patched model,

on 2iuz (46 atoms), 3o99 (78), small.xyz (264), 1hz5 (973), a 3000-atom water
grid, and the periodic benzene and water-0.8nm cells, plus one water molecule
(3 atoms: the per-call overhead). All implementations live in one process and
are timed interleaved (one call each per round, in a shuffled order), so a
noisy machine slows them alike; the table gives medians. The order is shuffled
anew every round (seeded), so that each implementation follows each of the
others about equally often and never itself: every implementation runs
fastest right after its own call, whose weights are still in the caches
(2iuz: TorchANI 18.7 ms after itself, 19.8-20.3 after the others; fast 2.7
ms after itself, 3.0-3.3 after the others). Peak RSS is measured
separately, each implementation in its own subprocess.

GFLOP/s counts only the networks' multiply-adds that cannot be skipped: layer 1
restricted to the AEV columns of the elements present ("zero-block aware"),
forward plus the input-gradient backward (2 x 2 x MACs). It is divided by the
whole call's time (AEV, neighbour list and Python included) and compared with
this machine's GEMM peak, measured here on 2048^2 matrices of the benchmark's
dtype as the better of ``torch.mm`` (MKL) and oneDNN's linear (see ``sgemm_peak``);
"nets alone" divides it by the networks stage's own time (forward + backward
of the networks, timed without the AEV).

The two "ceiling" columns bound what faster network kernels alone could give:
the call's time with the networks stage (timed alone) replaced by its FLOPs at
the GEMM peak, everything else (AEV, neighbour list, Python) as measured. A
target above the ceiling needs a faster AEV or less overhead, not faster
networks.

Never part of the tests or CI. Usage::

    python benchmarks/benchmark_cpu.py                  # writes benchmarks/RESULTS.md
    python benchmarks/benchmark_cpu.py --threads 1 --no-write
    python benchmarks/benchmark_cpu.py --quick          # fewer rounds, no 3000-atom grid
    python benchmarks/benchmark_cpu.py --profile        # + torch.profiler table (1hz5, fast)
    python benchmarks/benchmark_cpu.py --contention 2   # beside 2 busy processes of its own
    python benchmarks/benchmark_cpu.py --calls 4        # each round: 4 calls in a row, 3 timed
    python benchmarks/benchmark_cpu.py --loop 1         # each round: 1 s of calls in a row each
    python benchmarks/benchmark_cpu.py --model ANI2dr   # another torchani.models factory
    python benchmarks/benchmark_cpu.py --dtype float64  # both implementations in float64

``--dtype float64`` runs TorchANI and torchani_fast both in float64 (models,
coordinates and cells; the GEMM peak is DGEMM's); the default is float32.
``--model NAME`` times any ``torchani.models`` factory (ANI2xr, ANI2dr, ANImbis,
...) instead of ANI-2x. Their published weights cannot be downloaded here, so
those models get TorchANI's exact architecture with seeded random weights
(``torchani_fast.testing.random_model``; speed does not depend on the values).
The table then also gives the time of the model's pair potentials (repulsion,
dispersion: forward + backward on the model's neighbour list) and their share
of the patched call, and the parts that torchani_fast still leaves to TorchANI.

Needs the offline ANI weights (TORCHANI_DATA_DIR, default ../shared/torchani-data).
Other jobs on the machine inflate every number; the load average is recorded.
"""
import argparse
import copy
import datetime
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("TORCHANI_FAST_SHARED", HERE.parent / ".." / "shared")).resolve()
os.environ.setdefault("TORCHANI_DATA_DIR", str(SHARED / "torchani-data"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHANI_NO_WARN_EXTENSIONS", "1")
warnings.filterwarnings("ignore", category=DeprecationWarning)  # torch.jit in torch >= 2.10

import torch  # noqa: E402

MOLECULES = SHARED / "molecules"
IMPLS = ["torchani", "torchani-infer", "fast", "fast-jit"]
# (label, source): an .xyz file under ../shared/molecules, or a generated system.
SYSTEMS = [
    ("water (3)", "water-1"),
    ("2iuz (46)", "2iuz_ligand.xyz"),
    ("3o99 (78)", "3o99_ligand.xyz"),
    ("small (264)", "small.xyz"),
    ("1hz5 (973)", "1hz5.xyz"),
    ("water grid (3000)", "water-grid"),
    ("benzene, periodic (48)", "benzene.xyz"),
    ("water-0.8nm, periodic (30)", "water-0.8nm.xyz"),
]
RESULTS_BEGIN, RESULTS_END = "<!-- BEGIN cpu benchmark -->", "<!-- END cpu benchmark -->"


# -- inputs ------------------------------------------------------------------------------

def water_grid(per_side=10, spacing=3.104, seed=0):
    """``per_side**3`` randomly oriented waters on a cubic grid at liquid density (no cell)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    r, half = 0.9572, np.deg2rad(104.52) / 2
    local = np.array([[0, 0, 0], [r * np.sin(half), r * np.cos(half), 0], [-r * np.sin(half), r * np.cos(half), 0]])
    numbers, positions = [], []
    for idx in np.ndindex(per_side, per_side, per_side):
        q, _ = np.linalg.qr(rng.normal(size=(3, 3)))  # a random rotation
        positions.append(local @ q.T + spacing * np.array(idx))
        numbers += [8, 1, 1]
    return np.array(numbers), np.concatenate(positions)


def load_system(source, dtype=None):
    """(species (1, N), coords (1, N, 3), cell or None, pbc or None), in ``dtype`` (default: --dtype)."""
    dtype = dtype or DTYPE
    cell = pbc = None
    if source == "water-grid":
        numbers, positions = water_grid()
    else:
        import ase.io

        atoms = ase.io.read(MOLECULES / ("water-0.8nm.xyz" if source == "water-1" else source))
        if source == "water-1":
            atoms = atoms[:3]
            atoms.pbc = False
        numbers, positions = atoms.numbers, atoms.positions
        if atoms.pbc.any():
            cell = torch.tensor(atoms.cell.array, dtype=dtype)
            pbc = torch.tensor(atoms.pbc)
    species = torch.tensor(numbers, dtype=torch.long).unsqueeze(0)
    coords = torch.tensor(positions, dtype=dtype).unsqueeze(0)
    return species, coords, cell, pbc


# -- implementations -------------------------------------------------------------------------

MODEL = "ANI2x"  # --model
DTYPE = torch.float32  # --dtype


def base_model(name=None):
    """TorchANI's model ``name`` in --dtype: published weights for ANI-2x, else random ones."""
    import torchani

    name = name or MODEL
    if name == "ANI2x":
        return torchani.models.ANI2x().to(DTYPE)
    from torchani_fast.testing import random_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return random_model(name, seed=0).to(DTYPE)


def build(impl, base=None):
    """The model for ``impl`` (in --dtype), or raise with TorchANI's own error."""
    import torchani_fast

    model = copy.deepcopy(base) if base is not None else base_model()
    if impl == "torchani":
        return model
    if impl == "torchani-infer":
        return torch.jit.script(model.to_infer_model())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the kept parts are reported from kept_parts()
        if impl == "fast":
            return torchani_fast.patch(model)
        if impl == "fast-jit":
            return torch.jit.script(torchani_fast.patch(model))
    raise ValueError(impl)


def energy_forces(model, species, coords, cell, pbc):
    x = coords.detach().requires_grad_(True)
    e = model((species, x), cell=cell, pbc=pbc).energies
    (g,) = torch.autograd.grad(e.sum(), x)
    return e.detach(), -g


# -- measurements ------------------------------------------------------------------------------

def sgemm_peak(n=2048, tries=20):
    """GEMM rate (GFLOP/s, --dtype) of each GEMM inside torch; the roofline is the best.

    torch.mm calls MKL, which on AMD CPUs runs its AVX2 code even where AVX-512 is
    there (Zen 5, 2 cores: 200-233 GFLOP/s, against 457-521 for oneDNN's SGEMM
    and 533 for a register-only FMA loop). oneDNN picks its kernels from the CPU's
    features. Taking the better of the two, no machine's peak is set by a vendor
    check.
    """
    a, b = torch.randn(n, n, dtype=DTYPE), torch.randn(n, n, dtype=DTYPE)
    gemms = {"torch.mm (MKL)": lambda: a @ b}
    if torch.backends.mkldnn.is_available() and DTYPE == torch.float32:  # (oneDNN has no float64)
        am, bm = a.to_mkldnn(), b.t().contiguous().to_mkldnn()
        gemms["oneDNN linear"] = lambda: torch._C._nn.mkldnn_linear(am, bm, None)
    rates = {}
    for name, fn in gemms.items():
        try:
            for _ in range(3):
                fn()
            rates[name] = 2 * n ** 3 / min(_timed(fn) for _ in range(tries)) / 1e9
        except RuntimeError as err:  # a torch without oneDNN's linear: MKL alone
            print(f"{name}: {err}", file=sys.stderr)
    return rates


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def network_flops(fused, species_idx):
    """Zero-block-aware multiply-add FLOPs of forward + input-gradient backward."""
    counts = torch.bincount(species_idx.flatten() + 1, minlength=fused.num_species + 1)[1:].tolist()
    mask = sum(1 << e for e, c in enumerate(counts) if c > 0)
    k = fused._column_index(mask, torch.device("cpu")).numel()
    members = fused.get_active_members_num()
    macs = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        ws = fused._member_weights()[0][e]
        dims = [w.shape for w in ws[0::2]]  # (out, in) of each layer
        macs += count * (k * dims[0][0] + sum(d[0] * d[1] for d in dims[1:]))
    return 2 * 2 * members * macs


def stage_times(model, species, coords, cell, pbc, rounds):
    """Median ms of torchani_fast's AEV (forward+backward) and networks (forward+backward)."""
    nnp = model.potentials["nnp"]
    elem = model.species_converter(species)

    def aev_step():
        x = coords.detach().requires_grad_(True)
        if cell is None:
            aev = nnp.aev_computer(elem, x)
        else:
            neighbors = model.neighborlist(model.cutoff, elem, x, cell, pbc)
            aev = nnp.aev_computer.compute_from_neighbors(elem, x, neighbors)
        torch.autograd.grad(aev, x, torch.ones_like(aev))
        return aev.detach()

    aev = aev_step()

    def nets_step():
        a = aev.detach().requires_grad_(True)
        torch.autograd.grad(nnp.neural_networks(elem, a).sum(), a)

    out = []
    for fn in (aev_step, nets_step):
        fn()
        out.append(1e3 * statistics.median(_timed(fn) for _ in range(rounds)))
    return out


def pair_potential_ms(model, species, coords, cell, pbc, rounds):
    """Median ms of the model's potentials other than the networks (forward +
    backward to the coordinates), each on the model's one neighbour list narrowed
    to its cutoff as TorchANI does; the neighbour search itself is not counted.
    None if the model has none."""
    from torchani.neighbors import discard_outside_cutoff

    extra = [p for k, p in model.potentials.items() if k != "nnp" and p._enabled]
    if not extra:
        return None
    elem = model.species_converter(species)

    def step():
        x = coords.detach().requires_grad_(True)
        neighbors = model.neighborlist(model.cutoff, elem, x, cell, pbc)
        e = sum(p.compute_from_neighbors(elem, x, discard_outside_cutoff(neighbors, p.cutoff)).energies
                for p in extra)
        torch.autograd.grad(e.sum(), x)

    def search():
        x = coords.detach().requires_grad_(True)
        neighbors = model.neighborlist(model.cutoff, elem, x, cell, pbc)
        torch.autograd.grad(neighbors.distances.sum(), x)

    step(), search()
    both = statistics.median(_timed(step) for _ in range(rounds))
    alone = statistics.median(_timed(search) for _ in range(rounds))
    return 1e3 * max(both - alone, 0.0)


def eager_infer_probe(base):
    """What TorchANI's unscripted ``to_infer_model()`` does on this machine."""
    species, coords, cell, pbc = load_system("water-1")
    try:
        energy_forces(copy.deepcopy(base).to_infer_model(), species, coords, cell, pbc)
        return "runs"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def time_all(systems, impls, rounds, budget_s, calls=1, gap_s=0.0, loop_s=0.0):
    base = base_model()
    models, errors = {}, {}
    if "torchani-infer" in impls:
        errors["torchani-infer, unscripted (not timed)"] = eager_infer_probe(base)
    for impl in impls:
        try:
            models[impl] = build(impl, base)
        except Exception as exc:  # report what TorchANI raises, keep benchmarking the rest
            errors[impl] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    rows = []
    for label, source in systems:
        species, coords, cell, pbc = load_system(source)
        active = {}
        for impl, model in models.items():
            try:
                for _ in range(3):  # warm-up: packing, allocator, TorchScript profiling runs
                    energy_forces(model, species, coords, cell, pbc)
                active[impl] = model
            except Exception as exc:
                errors.setdefault(impl, f"{label}: {type(exc).__name__}: {exc}".splitlines()[0][:200])
        # Rounds adapted to the slowest implementation, within the time budget.
        once = {impl: _timed(lambda m=m: energy_forces(m, species, coords, cell, pbc)) for impl, m in active.items()}
        # --loop: each implementation's turn is a loop of its own calls lasting about loop_s.
        turn = {impl: max(3, int(loop_s / max(t, 1e-9))) if loop_s else calls for impl, t in once.items()}
        per_round = sum(once[impl] * turn[impl] for impl in active)
        n = max(5, min(rounds, int(budget_s / max(per_round, 1e-9))))
        times = {impl: [] for impl in active}
        order = list(active)
        shuffle = random.Random(0).shuffle
        for _ in range(n):
            last = order[-1]
            shuffle(order)
            if order[0] == last and len(order) > 1:  # never right after itself
                order[0], order[1] = order[1], order[0]
            for impl in order:
                call = lambda m=active[impl]: energy_forces(m, species, coords, cell, pbc)  # noqa: E731
                if gap_s:  # the previous implementation's OpenMP team stops spinning meanwhile
                    time.sleep(gap_s)
                if loop_s:  # a loop of its own calls: the median of all but the first
                    call()
                    times[impl].append(statistics.median(_timed(call) for _ in range(turn[impl] - 1)))
                elif calls > 1:  # a loop of its own calls: the first (after another's) untimed
                    call()
                    times[impl].append(sum(_timed(call) for _ in range(calls - 1)) / (calls - 1))
                else:
                    times[impl].append(_timed(call))
        row = {"system": label, "atoms": species.shape[1], "rounds": n,
               "ms": {impl: 1e3 * statistics.median(t) for impl, t in times.items()}}
        if "fast" in active:
            fast = active["fast"]
            nets = fast.potentials["nnp"].neural_networks
            row["gflop"] = None  # networks kept as TorchANI's (not fused): no count
            if hasattr(nets, "_column_index"):
                row["gflop"] = network_flops(nets, fast.species_converter(species)) / 1e9
            row["aev_ms"], row["nets_ms"] = stage_times(fast, species, coords, cell, pbc, max(3, n // 2))
            pairs_ms = pair_potential_ms(fast, species, coords, cell, pbc, max(3, n // 2))
            if pairs_ms is not None:
                row["pairs_ms"] = pairs_ms
            if "torchani" in active:
                e0, f0 = energy_forces(active["torchani"], species, coords, cell, pbc)
                e1, f1 = energy_forces(fast, species, coords, cell, pbc)
                row["dE"] = (e1 - e0).abs().max().item()
                row["dF"] = (f1 - f0).abs().max().item()
        row["load"] = os.getloadavg()[0]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows, errors


def rss_child(impl, systems):
    """Run in a subprocess: peak RSS (MB) after each system, for one implementation."""
    out = {}
    model = build(impl)
    for label, source in systems:
        species, coords, cell, pbc = load_system(source)
        try:
            for _ in range(3):
                energy_forces(model, species, coords, cell, pbc)
        except Exception as exc:
            out[label] = f"{type(exc).__name__}"
            continue
        out[label] = peak_rss_mb()
    print("RSS " + json.dumps(out), flush=True)


def peak_rss_mb():
    # VmHWM starts afresh at exec; getrusage's ru_maxrss would carry over the
    # parent's peak, since Linux preserves it across fork + execve.
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_rss(impls, systems, threads, quick):
    result = {}
    for impl in impls:
        cmd = [sys.executable, __file__, "--rss-child", impl, "--threads", str(threads), "--model", MODEL,
               "--dtype", str(DTYPE).replace("torch.", "")]
        cmd += ["--quick"] if quick else []
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RSS ")]
        result[impl] = json.loads(lines[-1][4:]) if lines else {"error": proc.stderr.strip().splitlines()[-1:]}
    return result


def profile_table(label_source, rows=25):
    from torch.profiler import ProfilerActivity, profile

    model = build("fast", base_model())
    species, coords, cell, pbc = load_system(label_source[1])
    for _ in range(3):
        energy_forces(model, species, coords, cell, pbc)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            energy_forces(model, species, coords, cell, pbc)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


# -- report ---------------------------------------------------------------------------------------

def machine_description(threads):
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torchani

    import torchani_fast

    return (f"{model}, {os.cpu_count()} logical CPUs, {threads} torch threads; "
            f"torch {torch.__version__}, torchani {torchani.__version__}, torchani_fast "
            f"{torchani_fast.__version__} (CPU kernels: {torchani_fast.cpu_isa()}), "
            f"Python {platform.python_version()}")


def start_contention(n, seconds):
    """``n`` busy processes (one pure-Python loop each) that end by themselves after
    ``seconds`` even if this script dies; :func:`stop_contention` ends them sooner."""
    loop = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(n)]
    time.sleep(0.5)  # running before the first timed call
    return procs


def stop_contention(procs):
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def render(rows, errors, rss, peaks, threads, load_before, load_after, profile_text, quick, contention=0,
           calls=1, gap_ms=0.0, loop_s=0.0):
    peak = max(peaks.values())
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    # The load average counts this benchmark's own threads while it runs.
    cpus = os.cpu_count() or 1
    busy = load_before > 0.5 * cpus or max(r.get("load", 0) for r in rows) > threads + 0.5 * cpus
    noisy = " -- **other jobs were running: timings are inflated and noisy**" if busy else ""
    impls = [i for i in IMPLS if any(i in r["ms"] for r in rows)]
    begin, end = markers(contention)
    weights = "" if MODEL == "ANI2x" else " (TorchANI's architecture, seeded random weights)"
    dtype = str(DTYPE).replace("torch.", "")
    title = f"## CPU: energy + forces, {MODEL}{weights}, {dtype}"
    if contention:
        title += f", beside {contention} busy processes"
        noisy = ""  # the load is the point
    out = [begin, title, "",
           f"- Date: {now}", f"- Machine: {machine_description(threads)}",
           f"- Load average (1 min) before/after: {load_before:.2f} / {load_after:.2f}" + noisy,
           f"- Measured GEMM peak (2048^2 {dtype}, {threads} threads, the better of): "
           + ", ".join(f"{name} {rate:.1f}" for name, rate in peaks.items()) + " GFLOP/s",
           f"- Command: `python benchmarks/benchmark_cpu.py --threads {threads}{' --quick' if quick else ''}"
           + (f" --model {MODEL}" if MODEL != "ANI2x" else "")
           + (f" --dtype {dtype}" if DTYPE != torch.float32 else "")
           + (f" --contention {contention}" if contention else "")
           + (f" --loop {loop_s:g}" if loop_s else (f" --calls {calls}" if calls > 1 else ""))
           + (f" --gap {gap_ms:g}`" if gap_ms else "`"),
           *([f"- Contention: {contention} processes of the benchmark's own, one busy loop each, ran "
              "throughout the timing (started before, stopped after)"] if contention else []),
           "", "Median wall time per call in ms (rounds interleaved, each in a shuffled order"
           + (f"; in a round each implementation runs a loop of its own calls for about {loop_s:g} s, "
              "timed as the median of all but its first call" if loop_s else "")
           + (f"; in a round each implementation makes {calls} calls in a row and the last {calls - 1} are "
              "timed: a loop of its own calls" if calls > 1 and not loop_s else "")
           + (f"; {gap_ms:g} ms of sleep before each implementation's calls, so that the one before "
              "has stopped spinning" if gap_ms else "")
           + "); speedup = torchani / fast. "
           "AEV and nets: torchani_fast's two stages timed alone (forward + backward); "
           "nets alone: the network GFLOP over the nets stage's time. "
           "Ceiling: the call with the nets stage replaced by its FLOPs at the GEMM peak, the rest as measured "
           "(the most that faster network kernels alone could give). "
           "load: 1-minute load average after the row, this benchmark's own threads included.", ""]
    head = ("| system | atoms | " + " | ".join(impls) + " | speedup vs torchani | vs infer | fast-jit speedup"
            " | net GFLOP | fast GFLOP/s | % of GEMM peak | fast AEV ms | fast nets ms | nets alone: % of peak"
            " | ceiling: speedup | ceiling: % of peak | load |")
    if any("pairs_ms" in r for r in rows):
        head = head[:-len(" load |")] + " pair potentials ms | pair share of fast | load |"
    out += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ms = r["ms"]
        cells = [f"{ms[i]:.2f}" if i in ms else "-" for i in impls]
        sp = f"{ms['torchani'] / ms['fast']:.1f}x" if {"torchani", "fast"} <= ms.keys() else "-"
        spi = f"{ms['torchani-infer'] / ms['fast']:.1f}x" if {"torchani-infer", "fast"} <= ms.keys() else "-"
        spj = f"{ms['torchani'] / ms['fast-jit']:.1f}x" if {"torchani", "fast-jit"} <= ms.keys() else "-"
        gf = r.get("gflop") or 0.0
        rate = f"{gf / ms['fast'] * 1e3:.1f}" if gf and "fast" in ms else "-"
        pct = f"{100 * gf / ms['fast'] * 1e3 / peak:.0f}%" if gf and "fast" in ms else "-"
        nets_pct = ceil_sp = ceil_pct = "-"
        if gf and "fast" in ms and "nets_ms" in r:
            # The call with the networks at the GEMM peak, the rest as measured.
            nets_pct = f"{100 * gf / r['nets_ms'] * 1e3 / peak:.0f}%"
            best_ms = max(ms["fast"] - r["nets_ms"], 0.0) + gf / peak * 1e3
            ceil_pct = f"{100 * gf / best_ms * 1e3 / peak:.0f}%"
            if "torchani" in ms:
                ceil_sp = f"{ms['torchani'] / best_ms:.1f}x"
        out.append(f"| {r['system']} | {r['atoms']} | " + " | ".join(cells)
                   + f" | {sp} | {spi} | {spj} | {f'{gf:.3f}' if gf else '-'} | {rate} | {pct} | {r.get('aev_ms', 0):.2f}"
                   + f" | {r.get('nets_ms', 0):.2f} | {nets_pct} | {ceil_sp} | {ceil_pct}"
                   + (f" | {r['pairs_ms']:.2f} | {100 * r['pairs_ms'] / ms['fast']:.0f}%"
                      if "pairs_ms" in r and "fast" in ms else (" | - | -" if "pair potentials" in head else ""))
                   + f" | {r.get('load', 0):.1f} |")
    out += ["", f"Largest |ΔE| (Ha) and |ΔF| (Ha/Å) of fast vs torchani, {dtype}: "
            + ", ".join(f"{r['system']}: {r['dE']:.1e} / {r['dF']:.1e}" for r in rows if "dE" in r), ""]
    kept = kept_report()
    if kept:
        out += ["Parts of the patched model that are still TorchANI's (torchani_fast.patch.kept_parts):", ""]
        out += [f"- {part}: {why}" for part, why in kept.items()] + [""]
    if errors:
        out += ["Notes and failures:", ""] + [f"- `{k}`: {v}" for k, v in errors.items()] + [""]
    if rss:
        labels = [r["system"] for r in rows]
        out += ["Peak RSS in MB (each implementation in its own process; running maximum, systems in the "
                "order above):", "",
                "| implementation | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
        for impl, per in rss.items():
            cells = [(f"{per[l]:.0f}" if isinstance(per.get(l), float) else str(per.get(l, "-"))) for l in labels]
            out.append(f"| {impl} | " + " | ".join(cells) + " |")
        out.append("")
    if profile_text:
        out += ["torch.profiler, torchani_fast on 1hz5 (5 calls):", "", "```", profile_text.strip(), "```", ""]
    out.append(end)
    return "\n".join(out)


def markers(contention=0):
    """The RESULTS.md markers of this benchmark's section (one per model and contention level)."""
    tag = "" if MODEL == "ANI2x" else f" {MODEL}"
    tag += " float64" if DTYPE == torch.float64 else ""
    tag += f", contention {contention}" if contention else ""
    if not tag:
        return RESULTS_BEGIN, RESULTS_END
    return f"<!-- BEGIN cpu benchmark{tag} -->", f"<!-- END cpu benchmark{tag} -->"


def kept_report():
    import torchani_fast
    from torchani_fast.patch import kept_parts

    model = build("fast", base_model())
    assert torchani_fast.is_patched(model)
    return kept_parts(model)


def write_results(section, path, contention=0):
    text = path.read_text() if path.exists() else "# torchani_fast benchmark results\n\n"
    begin, end = markers(contention)
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=41, help="max timed rounds per system")
    p.add_argument("--budget", type=float, default=40.0, help="seconds of timing per system")
    p.add_argument("--quick", action="store_true", help="5 rounds, skip the 3000-atom grid and RSS")
    p.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS)
    p.add_argument("--no-rss", action="store_true")
    p.add_argument("--profile", action="store_true", help="add a torch.profiler table (1hz5, fast)")
    p.add_argument("--no-write", action="store_true", help="print, do not write RESULTS.md")
    p.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    p.add_argument("--contention", type=int, default=0, metavar="N",
                   help="time beside N busy processes started (and stopped) by the benchmark")
    p.add_argument("--calls", type=int, default=1, metavar="K",
                   help="calls per implementation and round, the last K-1 timed (a loop of its own "
                        "calls, as MD and screening run; default 1: each call after another's)")
    p.add_argument("--loop", type=float, default=0.0, metavar="S",
                   help="each implementation's turn in a round is a loop of its own calls lasting "
                        "about S seconds, timed as the median of all but its first call (MD and "
                        "screening beside other jobs: no sleep between calls, which would let the "
                        "scheduler place the next call on a shared core; overrides --calls)")
    p.add_argument("--gap", type=float, default=0.0, metavar="MS",
                   help="sleep this long before each implementation's calls in a round (TorchANI's "
                        "OpenMP threads spin for milliseconds after its call returns; default 0)")
    p.add_argument("--model", default="ANI2x",
                   help="torchani.models factory to time (ANI2x: published weights; others: "
                        "TorchANI's architecture with seeded random weights)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="dtype of both implementations (models, coordinates, cells)")
    p.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.calls < 1:
        p.error(f"--calls must be >= 1, got {args.calls}")
    if not 0 <= args.loop <= 600:
        p.error(f"--loop must be in [0, 600] s, got {args.loop}")
    if not 0 <= args.gap <= 10000:
        p.error(f"--gap must be in [0, 10000] ms, got {args.gap}")
    global MODEL, DTYPE
    MODEL = args.model
    DTYPE = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    systems = [s for s in SYSTEMS if not (args.quick and s[1] == "water-grid")]
    if args.rss_child:
        return rss_child(args.rss_child, systems)
    rounds, budget = (5, 10.0) if args.quick else (args.rounds, args.budget)
    load_before = os.getloadavg()[0]
    peaks = sgemm_peak()
    print(f"GEMM peaks (GFLOP/s): {peaks}", flush=True)
    # Bounded: the busy loops end by themselves within 2 hours even if this process is killed.
    busy = start_contention(args.contention, 7200) if args.contention else []
    try:
        rows, errors = time_all(systems, args.impls, rounds, budget, args.calls, args.gap / 1e3, args.loop)
        load_after = os.getloadavg()[0]
    finally:
        stop_contention(busy)
    rss = {} if (args.no_rss or args.quick) else measure_rss(args.impls, systems, args.threads, args.quick)
    profile_text = profile_table(SYSTEMS[4]) if args.profile else ""
    section = render(rows, errors, rss, peaks, args.threads, load_before, load_after, profile_text, args.quick,
                     args.contention, args.calls, args.gap, args.loop)
    print(section)
    if not args.no_write:
        write_results(section, args.output, args.contention)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
