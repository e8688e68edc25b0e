"""GPU benchmark: TorchANI's best CUDA path against torchani_fast, energy + forces.

Systems: a 46-atom molecule (not periodic) and periodic water boxes of about
1k, 10k and 100k atoms. Model: the ANI-2x architecture with random weights
(seeded), so no pretrained files are needed; speed and exactness do not depend
on the weight values.

Paths, each one energy + forces (autograd) per step, float32:

- ``torchani``: TorchANI 2.9 with strategy "cuaev" and ``to_infer_model()`` when
  its cuaev extension is loaded (else "pyaev", and the table says so); TorchANI's
  neighbour list: all_pairs for the molecule, cell_list for water.
- ``torchani+graph``: the same step captured in a CUDA graph, when TorchANI
  allows it (it synchronises inside forward, so capture is expected to fail;
  the reason is recorded).
- ``fast``: ``torchani_fast.patch(model)`` called through the model's own API,
  with TorchANI's inference networks (``to_infer_model()``) unless torchani_fast
  replaced the networks itself.
- ``fast-step``: ``torchani_fast.step.EnergyForcesStep`` (fixed-capacity
  neighbour list + AEV + the fused networks on element groups fixed once: no
  host sync), eager.
- ``fast-step+graph``: that step captured once in a CUDA graph and replayed
  (the default of ``EnergyForcesStep`` on CUDA), without and with the per-step
  pair-count check (one sync).
- ``ase``: ``get_forces`` of torchani_fast's ASE calculator (which replays a
  CUDA graph of its system's step) against TorchANI's own calculator, the
  positions moved between calls as in MD (so nothing is cached).
- ``old kernels``: the model API and the graph step again with the kernels
  that the new ones replace (TORCHANI_FAST_CUDA_NEIGHBORS=old,
  TORCHANI_FAST_CUDA_AEV=old, TORCHANI_FAST_CUDA_NETWORKS=aten; the switches
  are read at every call), in the same process: the A/B that decides which
  kernels stay.

Usage: python benchmarks/benchmark_gpu.py --out DIR [--sizes 46,1000,10000,100000]
Writes DIR/benchmark_gpu.json and DIR/benchmark_gpu.md.
"""
import argparse
import json
import math
import os
import platform
import sys
import time
import traceback

import torch

os.environ.setdefault("TORCHANI_NO_WARN_EXTENSIONS", "1")
import torchani  # noqa: E402
from torchani.csrc import CUAEV_IS_INSTALLED  # noqa: E402

import torchani_fast  # noqa: E402
from torchani_fast.step import EnergyForcesStep  # noqa: E402
from torchani_fast.testing import random_ani2x, random_molecule, water_box  # noqa: E402

DEVICE = "cuda"
DTYPE = torch.float32


# ---------------------------------------------------------------------------
# Model and systems


def ani2x_random(strategy="pyaev", neighborlist="all_pairs", seed=0):
    return random_ani2x(seed, strategy, neighborlist)


def molecule(n=46, seed=0):
    return random_molecule(n, seed) + (None, None)


def system(n_atoms):
    if n_atoms < 100:
        return "molecule", molecule(n_atoms)
    return "periodic water", water_box(round(n_atoms / 3))


# ---------------------------------------------------------------------------
# Timing


def time_step(fn, budget_s=2.0, max_reps=500):
    """Median milliseconds of fn() over repetitions timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - t0
    reps = int(min(max_reps, max(3, budget_s / max(once, 1e-6))))
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], reps


def energy_forces(model, z, x, cell, pbc):
    x = x.detach().requires_grad_(True)
    e = model((z, x), cell=cell, pbc=pbc).energies.sum()
    (g,) = torch.autograd.grad(e, x)
    return e.detach(), -g


def capture(step, x):
    static_x = x.detach().clone().requires_grad_(True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(static_x)
    return graph, static_x, out


OLD_KERNELS = {"TORCHANI_FAST_CUDA_NEIGHBORS": "old", "TORCHANI_FAST_CUDA_AEV": "old",
               "TORCHANI_FAST_CUDA_NETWORKS": "aten"}


class old_kernels:
    """The kernels the new ones replace, for the duration of a ``with`` block (the
    networks' switch is also the module attribute ``fused.CUDA_NETWORKS``)."""

    def __enter__(self):
        from torchani_fast.nn import fused

        self.saved = {k: os.environ.get(k) for k in OLD_KERNELS}
        self.networks = fused.CUDA_NETWORKS
        os.environ.update(OLD_KERNELS)
        fused.CUDA_NETWORKS = OLD_KERNELS["TORCHANI_FAST_CUDA_NETWORKS"]

    def __exit__(self, *exc):
        from torchani_fast.nn import fused

        fused.CUDA_NETWORKS = self.networks
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ase_forces_ms(calc, z, x, cell, pbc, budget_s):
    """ms per ``get_forces`` of an ASE calculator, positions moved between calls."""
    import ase

    atoms = ase.Atoms(numbers=z[0].cpu().numpy(), positions=x[0].detach().cpu().double().numpy())
    if cell is not None:
        atoms.cell = cell.cpu().double().numpy()
        atoms.pbc = pbc.cpu().numpy()
    atoms.calc = calc
    shift = [1e-4]

    def call():
        atoms.positions[0, 0] += shift[0]
        shift[0] = -shift[0]
        return atoms.get_forces()

    return time_step(call, budget_s)[0]


def short(exc):
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:160] if text else type(exc).__name__


# ---------------------------------------------------------------------------


def run(sizes, out_dir, budget_s):
    strategy = "cuaev" if CUAEV_IS_INSTALLED else "pyaev"
    dev = torch.cuda.get_device_properties(0)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": dev.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torchani": torchani.__version__,
        "torchani_fast": torchani_fast.__version__,
        "python": platform.python_version(),
        "dtype": str(DTYPE),
        "torchani_strategy": strategy,
        "torchani_networks": "to_infer_model() (BmmEnsemble)",
    }
    print(json.dumps(meta, indent=1), flush=True)
    rows = []
    for n in sizes:
        kind, (z, x, cell, pbc) = system(n)
        n_atoms = z.shape[1]
        nl_name = "all_pairs" if cell is None else "cell_list"
        z_d = z.to(DEVICE)
        x_d = x.to(DEVICE, DTYPE)
        cell_d = None if cell is None else cell.to(DEVICE, DTYPE)
        pbc_d = None if pbc is None else pbc.to(DEVICE)
        row = {"atoms": n_atoms, "system": kind}
        print(f"\n== {n_atoms} atoms ({kind}) ==", flush=True)

        # TorchANI
        e_ref = f_ref = None
        try:
            ref = ani2x_random(strategy, nl_name).to(DEVICE, DTYPE).to_infer_model()
            e_ref, f_ref = energy_forces(ref, z_d, x_d, cell_d, pbc_d)
            ms, reps = time_step(lambda: energy_forces(ref, z_d, x_d, cell_d, pbc_d), budget_s)
            row["torchani_ms"] = ms
            print(f"torchani ({strategy}+infer): {ms:.3f} ms ({reps} reps)", flush=True)
            try:
                def ref_step(xx):
                    e = ref((z_d, xx), cell=cell_d, pbc=pbc_d).energies.sum()
                    return e, torch.autograd.grad(e, xx)[0]
                graph, _, _ = capture(ref_step, x_d)
                row["torchani_graph_ms"], _ = time_step(graph.replay, budget_s)
            except Exception as exc:  # expected: TorchANI synchronises in forward
                row["torchani_graph"] = "capture failed: " + short(exc)
                torch.cuda.synchronize()
            print(f"torchani+graph: {row.get('torchani_graph_ms', row.get('torchani_graph'))}",
                  flush=True)
            del ref
        except Exception as exc:
            row["torchani"] = "failed: " + short(exc)
            traceback.print_exc()

        # torchani_fast through the model API
        base = ani2x_random("pyaev", nl_name).to(DEVICE, DTYPE)
        fast = torchani_fast.patch(base)
        nn_module = type(fast.potentials["nnp"].neural_networks).__module__
        if not nn_module.startswith("torchani_fast"):
            fast = fast.to_infer_model()
        row["fast_networks"] = type(fast.potentials["nnp"].neural_networks).__name__
        e_fast, f_fast = energy_forces(fast, z_d, x_d, cell_d, pbc_d)
        ms, reps = time_step(lambda: energy_forces(fast, z_d, x_d, cell_d, pbc_d), budget_s)
        row["fast_ms"] = ms
        print(f"torchani_fast (model API, {row['fast_networks']}): {ms:.3f} ms ({reps} reps)",
              flush=True)
        if e_ref is not None:
            row["max_dE_vs_torchani"] = (e_fast - e_ref).abs().item()
            row["max_dF_vs_torchani"] = (f_fast - f_ref).abs().max().item()

        # The sync-free step (torchani_fast.step.EnergyForcesStep: fixed-capacity
        # neighbour list, AEV, fused networks on fixed element groups), eager and
        # captured in a CUDA graph.
        try:
            step = EnergyForcesStep(fast, z_d, x_d, cell_d, pbc_d, cuda_graph=False)
            e_s, f_s = step(x_d)
            row["step_max_dE_vs_model_api"] = (e_s - e_fast).abs().item()
            row["step_max_dF_vs_model_api"] = (f_s - f_fast).abs().max().item()
            ms, reps = time_step(lambda: step(x_d), budget_s)
            row["fast_step_ms"] = ms
            print(f"torchani_fast step (eager): {ms:.3f} ms ({reps} reps)", flush=True)
            graph_step = EnergyForcesStep(fast, z_d, x_d, cell_d, pbc_d, check_every=0)
            e_g, f_g = graph_step(x_d)
            graph_step.check()
            row["graph_max_dF_vs_eager"] = (f_g - f_s).abs().max().item()
            ms, reps = time_step(lambda: graph_step(x_d), budget_s, max_reps=2000)
            row["fast_graph_ms"] = ms
            print(f"torchani_fast step (CUDA graph, no per-step check): {ms:.3f} ms ({reps} reps)",
                  flush=True)
            graph_step.check_every = 1
            ms, reps = time_step(lambda: graph_step(x_d), budget_s, max_reps=2000)
            row["fast_graph_checked_ms"] = ms
            print(f"torchani_fast step (CUDA graph, checked every step): {ms:.3f} ms", flush=True)
            del step, graph_step
        except Exception as exc:
            row["fast_step"] = "failed: " + short(exc)
            traceback.print_exc()
        # ASE: torchani_fast's calculator against TorchANI's own (the same weights)
        try:
            row["fast_ase_ms"] = ase_forces_ms(fast.ase(), z_d, x_d, cell_d, pbc_d, budget_s)
            ref = ani2x_random(strategy, nl_name).to(DEVICE, DTYPE)
            row["torchani_ase_ms"] = ase_forces_ms(ref.ase(), z_d, x_d, cell_d, pbc_d, budget_s)
            del ref
            print(f"ASE get_forces: torchani_fast {row['fast_ase_ms']:.3f} ms, TorchANI "
                  f"{row['torchani_ase_ms']:.3f} ms", flush=True)
        except Exception as exc:
            row["ase"] = "failed: " + short(exc)
            traceback.print_exc()

        # The kernels the new ones replace, in this process (A/B)
        try:
            with old_kernels():
                e_o, f_o = energy_forces(fast, z_d, x_d, cell_d, pbc_d)
                row["old_max_dF_vs_new"] = (f_o - f_fast).abs().max().item()
                row["old_fast_ms"], _ = time_step(lambda: energy_forces(fast, z_d, x_d, cell_d, pbc_d), budget_s)
                old_step = EnergyForcesStep(fast, z_d, x_d, cell_d, pbc_d, check_every=0)
                old_step(x_d)
                row["old_graph_ms"], _ = time_step(lambda: old_step(x_d), budget_s, max_reps=2000)
                del old_step
            print(f"old kernels: model API {row['old_fast_ms']:.3f} ms, graph step "
                  f"{row['old_graph_ms']:.3f} ms", flush=True)
        except Exception as exc:
            row["old_kernels"] = "failed: " + short(exc)
            traceback.print_exc()
        best_fast = min(v for k, v in row.items() if k in ("fast_ms", "fast_step_ms", "fast_graph_ms"))
        best_ref = min([v for k, v in row.items() if k in ("torchani_ms", "torchani_graph_ms")] or [math.nan])
        row["speedup_best"] = best_ref / best_fast
        row["fast_atom_steps_per_s"] = n_atoms / (best_fast * 1e-3)
        rows.append(row)
        del base, fast
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)

    result = {"meta": meta, "rows": rows}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "benchmark_gpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, "benchmark_gpu.md"), "w") as f:
        f.write(markdown(result))
    print(markdown(result))


def markdown(result):
    m = result["meta"]
    lines = [
        f"GPU benchmark, {m['date']}, {m['device']}, torch {m['torch']} (CUDA {m['cuda']}), "
        f"TorchANI {m['torchani']} ({m['torchani_strategy']} + {m['torchani_networks']}), "
        f"{m['dtype']}, ANI-2x architecture with random weights, energy + forces per step.",
        "",
        "| atoms | system | TorchANI ms | TorchANI graph | fast ms (model API) | fast step ms "
        "| fast step graph ms | graph + check ms | best speed-up | atom-steps/s | max dE / dF vs TorchANI "
        "| ASE TorchANI / fast ms | old kernels: model API / graph ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(row, key, alt=None):
        if key in row:
            return f"{row[key]:.3f}"
        return row.get(alt, "-") if alt else "-"

    for r in result["rows"]:
        lines.append(
            f"| {r['atoms']} | {r['system']} | {fmt(r, 'torchani_ms', 'torchani')} | "
            f"{fmt(r, 'torchani_graph_ms', 'torchani_graph')} | {fmt(r, 'fast_ms')} | "
            f"{fmt(r, 'fast_step_ms', 'fast_step')} | {fmt(r, 'fast_graph_ms')} | "
            f"{fmt(r, 'fast_graph_checked_ms')} | "
            f"{r['speedup_best']:.2f}x | {r['fast_atom_steps_per_s']:.3g} | "
            f"{r.get('max_dE_vs_torchani', float('nan')):.2e} / "
            f"{r.get('max_dF_vs_torchani', float('nan')):.2e} | "
            f"{fmt(r, 'torchani_ase_ms', 'ase')} / {fmt(r, 'fast_ase_ms')} | "
            f"{fmt(r, 'old_fast_ms', 'old_kernels')} / {fmt(r, 'old_graph_ms')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".")
    p.add_argument("--sizes", default="46,1000,10000,100000")
    p.add_argument("--budget", type=float, default=1.5, help="seconds of timing per case")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmark_gpu.py needs a CUDA GPU")
    run([int(s) for s in a.sizes.split(",")], a.out, a.budget)


if __name__ == "__main__":
    main()
