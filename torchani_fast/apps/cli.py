"""The ``torchani-fast`` command: single points, geometry optimisation and MD.

Subcommands (``torchani-fast SUBCOMMAND --help`` explains every option)::

    torchani-fast energy FILE... [--forces] [--hessians] [-o out.json]
    torchani-fast optimize FILE... [--fmax 0.01] [--optimizer BFGS] [-o optimized.xyz]
    torchani-fast md FILE [--steps 1000] [--dt 0.5] [--temperature 300] [-o md.xyz]

Any format ASE reads is accepted; extended XYZ ``Lattice=``/``pbc=`` (and the cell
of any other periodic format) is honoured. Options, input files and output
paths are checked before any work; errors are one line on stderr naming the
file and frame (exit status 1). Output files are written as ``NAME.partial``
and renamed to ``NAME`` when the run succeeds (see ``torchani_fast.apps.output``):
an interrupted run leaves ``NAME.partial`` with the finished structures or
frames and never touches an existing ``NAME``. Model weights are read by TorchANI
from ``$TORCHANI_DATA_DIR/StateDicts`` (default ``~/.local/share/Torchani``);
on machines without network access also set ``HF_HUB_OFFLINE=1``.
"""
import argparse
import json
import math
import os
import sys
import time
import typing as tp
from pathlib import Path

from .output import PartialFile, check_writable, terminate_as_interrupt, write_atomic
from .structures import (MODEL_NAMES, batch_key, batch_results, check_structure, evaluate_batch, frozen_copy,
                         ase_optimizer, parse_index, plan_batches, progress, read_frames)

__all__ = ["main", "CLIError"]

ENERGY_DOC = """\
Single-point energies (and optionally forces) of every structure in the input
files, written as JSON in the layout of TorchANI's `ani sp`:

  {"energies": [E, ...],            # Hartree, one per structure
   "forces":   [[[fx, fy, fz], ...], ...],   # Hartree/Å, with --forces
   "hessians": [[[...]...]...],     # Hartree/Å², with --hessians
   "structures": [{"file": ..., "frame": ..., "natoms": ...}, ...]}

Structures appear in input order (file by file, frame by frame). Structures
that share a cell (or have none) are evaluated together as padded batches of
similar sizes (--batch-size).
"""

OPTIMIZE_DOC = """\
Relax atomic positions (the cell is kept fixed) until the largest force is
below --fmax. All structures are relaxed together (torchani_fast.batched:
structures that converge leave the batch and waiting ones join, up to
--max-atoms padded atoms per model call), each taking the steps of ASE's
optimizer of that name on it alone; --per-structure relaxes one structure at a
time through ASE. BFGS starts from Lindh's model Hessian of the starting
geometry on both paths (--hessian ase: ASE's own start). Writes every
optimised structure to one extended XYZ file (energy in eV and forces in eV/Å,
plus the source file, frame, step count and convergence flag in each frame's
comment line) and prints a summary table. Exit status 0 even if some structures did not converge (the table says
so); 1 on errors.
"""

MD_DOC = """\
Molecular dynamics of one structure: velocities are drawn from a
Maxwell-Boltzmann distribution at --temperature (centre-of-mass motion removed,
and rotation too for non-periodic systems), then integrated with velocity
Verlet (nve) or Langevin dynamics (langevin, which also thermostats at
--temperature). Every --interval steps a frame is appended to the extended XYZ
trajectory (energy, forces, velocities via momenta) and a line to the log
(time/ps, Etot/eV, Epot/eV, Ekin/eV, T/K).
"""


class CLIError(Exception):
    """An error the command reports as one line on stderr (exit status 1)."""


# ---------------------------------------------------------------- helpers
_DTYPES = {"float32": "float32", "f32": "float32", "float": "float32",
           "float64": "float64", "f64": "float64", "double": "float64"}


def _model_name(text: str) -> str:
    try:
        return MODEL_NAMES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"unknown model {text!r}; choose one of {', '.join(MODEL_NAMES.values())}"
        ) from None


def _dtype_name(text: str) -> str:
    try:
        return _DTYPES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; use float32 or float64") from None


def _load_model(name: str, device: tp.Optional[str], dtype: str):
    """The patched model (loaded once per process and arguments: models.load)."""
    import torch

    from .. import models


    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise CLIError(f"--device {device}: CUDA is not available in this torch build or machine")
    try:
        return models.load(name, device=device, dtype=getattr(torch, dtype))
    except Exception as exc:  # the weights are the usual culprit
        data = os.environ.get("TORCHANI_DATA_DIR", "~/.local/share/Torchani (default)")
        raise CLIError(
            f"could not load {name} ({type(exc).__name__}: {exc}). TorchANI reads the "
            f"weights from $TORCHANI_DATA_DIR/StateDicts (TORCHANI_DATA_DIR={data}); "
            "offline, also set HF_HUB_OFFLINE=1"
        ) from exc


def _read(path: Path, index: str) -> list:
    """``[(frame, atoms)]`` for the frames of ``path`` that ``index`` selects
    (:func:`~torchani_fast.apps.structures.read_frames`, screening's reader too)."""
    _index(index)
    try:
        return read_frames(path, index)
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def _index(index: str):
    """ase.io.read's index (int or slice) from ``index``, or CLIError naming -i."""
    try:
        return parse_index(index)
    except ValueError:
        raise CLIError(f"invalid frame index -i {index!r}; use e.g. 0, -1, :, 2:5 or ::10") from None


def _structures(paths: tp.Sequence[Path], index: str, name: str) -> list:
    """[(path, frame, atoms)] for every selected frame of every file, checked.

    Files are read and checked before the model is loaded, so bad input fails fast.
    """
    out = []
    for path in paths:
        for frame, atoms in _read(path, index):
            try:
                check_structure(name, f"{path}, frame {frame}", atoms)
            except ValueError as exc:
                raise CLIError(str(exc)) from None
            out.append((path, frame, atoms))
    return out


# ---------------------------------------------------------------- energy
def _run_energy(args) -> int:
    if _on_cluster(args):
        return _run_screen(args)
    structures = _structures(args.files, args.index, args.model)
    model = _load_model(args.model, args.device, args.dtype)
    n = len(structures)
    energies: list = [None] * n
    forces: list = [None] * n
    hessians: list = [None] * n
    bar = progress(total=n, desc="energy", unit="structure",
                    disable=args.no_progress or n < 2)

    def document(complete: bool) -> str:
        output: dict = {"energies": energies}
        if args.hessians:
            output["hessians"] = hessians
        if args.forces or args.hessians:
            output["forces"] = forces
        output["structures"] = [{"file": str(p), "frame": fr, "natoms": len(a)}
                                for p, fr, a in structures]
        if not complete:  # null for the structures not evaluated
            output["complete"] = False
        return json.dumps(output, indent=4 if args.output else None)

    try:
        sizes = [len(a) for _, _, a in structures]
        keys = [batch_key(a) for _, _, a in structures]
        for idxs in plan_batches(sizes, keys, args.batch_size):
            batch = [structures[i][2] for i in idxs]
            try:
                e, f, h = evaluate_batch(model, batch, args.forces, args.hessians)
            except NotImplementedError as exc:
                raise CLIError(f"--hessians: {exc}") from exc
            except (ValueError, RuntimeError) as exc:
                names = "; ".join(f"{structures[i][0]}, frame {structures[i][1]}" for i in idxs[:3])
                more = f" and {len(idxs) - 3} more" if len(idxs) > 3 else ""
                raise CLIError(f"{names}{more}: {exc}") from exc
            for i, rec in zip(idxs, batch_results(batch, e, f, h)):
                energies[i] = rec["energy"]
                forces[i] = rec.get("forces")
                hessians[i] = rec.get("hessians")
            bar.update(len(idxs))
    except BaseException:
        # Interrupted or failed: what was computed goes to OUTPUT.partial
        # (null for the rest, "complete": false); OUTPUT itself is not touched.
        if args.output and any(e is not None for e in energies):
            partial = PartialFile(args.output)
            partial.write(document(False) + "\n")
            partial.close()
            print(f"partial results -> {partial.partial}", file=sys.stderr)
        raise
    finally:
        bar.close()
    text = document(True)
    if args.output:
        write_atomic(args.output, text + "\n")
        print(f"{n} structure(s) -> {args.output}", file=sys.stderr)
    else:
        print(text)
    return 0


# ---------------------------------------------------------------- optimize
def _extxyz(atoms) -> str:
    """One extended XYZ frame as text: written with a single write() call, so an
    interruption (a signal handler runs between calls) never leaves half a frame."""
    import io

    import ase.io

    buffer = io.StringIO()
    ase.io.write(buffer, atoms, format="extxyz")
    return buffer.getvalue()


def _run_optimize(args) -> int:
    from .ase import Calculator

    if _on_cluster(args):
        return _run_screen(args)
    structures = _structures(args.files, args.index, args.model)
    model = _load_model(args.model, args.device, args.dtype)
    if not args.per_structure:  # all structures in one batch
        from . import optimize_batched

        return optimize_batched.run(args, structures, model, _extxyz, _print_table, CLIError)
    calc = Calculator(model)
    rows = []
    # Each optimised structure is appended to OUTPUT.partial as it finishes;
    # renamed to OUTPUT once all are done (an interrupted run keeps the file).
    with PartialFile(args.output) as out:
        outer = progress(structures, desc="structures", unit="structure",
                          disable=args.no_progress or len(structures) < 2)
        try:
            for path, frame, atoms in outer:
                try:
                    final, row = _optimize_one(args, calc, path, frame, atoms)
                except (ValueError, RuntimeError) as exc:
                    raise CLIError(f"{path}, frame {frame}: {exc}; the {len(rows)} structure(s) "
                                   f"finished are in {out.partial}") from exc
                except KeyboardInterrupt:
                    print(f"interrupted: the {len(rows)} structure(s) finished are in {out.partial}",
                          file=sys.stderr)
                    raise
                out.write(_extxyz(final))
                rows.append(row)
        finally:
            outer.close()
        out.commit()
    _print_table(rows, args)
    return 0


def _optimize_one(args, calc, path, frame, atoms):
    """Optimise one structure: (the final frame with its results, the table row)."""
    import numpy as np

    atoms = atoms.copy()
    atoms.calc = calc
    e0 = atoms.get_potential_energy()
    bar = progress(total=args.steps, desc=f"{path.name}[{frame}]", unit="step",
                    leave=False, disable=args.no_progress)

    def tick():
        if opt.nsteps == 0:  # ASE also calls observers before the first step
            return
        fmax = float(np.sqrt((atoms.get_forces() ** 2).sum(axis=1).max()))
        bar.set_postfix(E=f"{atoms.get_potential_energy():.4f} eV", fmax=f"{fmax:.4f}", refresh=False)
        bar.update(1)

    opt = ase_optimizer(args.optimizer, atoms, args.hessian, logfile=None)
    opt.attach(tick, interval=1)
    start = time.perf_counter()
    try:
        converged = bool(opt.run(fmax=args.fmax, steps=args.steps))
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    e1 = atoms.get_potential_energy()
    fmax = float(np.sqrt((atoms.get_forces() ** 2).sum(axis=1).max()))
    final = frozen_copy(atoms, calc.results)
    # Keep real metadata but not the flags ASE makes of a plain XYZ comment line.
    final.info = {k: v for k, v in final.info.items() if v is not True}
    final.info.update(source=str(path), frame=frame, optimizer=args.optimizer,
                      steps=opt.nsteps, converged=converged, fmax=fmax)
    return final, (str(path), frame, len(atoms), opt.nsteps, converged, e0, e1, fmax, seconds)


def _print_table(rows: list, args) -> None:
    head = ("file", "frame", "atoms", "steps", "converged", "E_start/eV", "E_final/eV",
            "dE/eV", "fmax/(eV/Å)", "time/s")
    cells = [(f, str(fr), str(n), str(s), "yes" if c else "NO", f"{e0:.6f}", f"{e1:.6f}",
              f"{e1 - e0:.6f}", f"{fm:.5f}", f"{sec:.2f}")
             for f, fr, n, s, c, e0, e1, fm, sec in rows]
    widths = [max(len(h), *(len(r[k]) for r in cells)) for k, h in enumerate(head)]
    line = "  ".join(h.rjust(w) if k else h.ljust(w) for k, (h, w) in enumerate(zip(head, widths)))
    print(line)
    print("-" * len(line))
    for r in cells:
        print("  ".join(c.rjust(w) if k else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths))))
    bad = sum(1 for r in rows if not r[4])
    print(f"{len(rows) - bad}/{len(rows)} converged to fmax < {args.fmax} eV/Å with "
          f"{args.optimizer} ({args.model}, {args.dtype}); structures in {args.output}")


# ---------------------------------------------------------------- md
def _maxwell_boltzmann(atoms, temperature_K: float, rng) -> None:
    """Momenta drawn at ``temperature_K``: ASE's ``thermalize_momenta`` (3.29+), else
    ``MaxwellBoltzmannDistribution`` (which 3.29 deprecates; the same draw)."""
    try:
        from ase.md.velocitydistribution import thermalize_momenta
    except ImportError:
        from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

        MaxwellBoltzmannDistribution(atoms, temperature_K=temperature_K, rng=rng)
        return
    thermalize_momenta(atoms, temperature_K, rng=rng)


def _run_md(args) -> int:
    import ase.units as units
    import numpy as np
    from ase.md.langevin import Langevin
    from ase.md.logger import MDLogger
    from ase.md.velocitydistribution import Stationary, ZeroRotation
    from ase.md.verlet import VelocityVerlet

    from .ase import Calculator

    ((_, frame, atoms),) = _structures([args.file], str(args.frame), args.model)
    atoms = atoms.copy()
    model = _load_model(args.model, args.device, args.dtype)
    atoms.calc = Calculator(model, cuda_graphs=not args.no_cuda_graphs)
    rng = np.random.default_rng(args.seed)
    if args.temperature > 0 and not args.keep_velocities:
        _maxwell_boltzmann(atoms, args.temperature, rng)
        Stationary(atoms)
        if not atoms.pbc.any():
            ZeroRotation(atoms)
    dt = args.dt * units.fs
    if args.ensemble == "nve":
        dyn = VelocityVerlet(atoms, dt)
    else:
        dyn = Langevin(atoms, dt, temperature_K=args.temperature,
                       friction=args.friction / units.fs, rng=rng)
    log_path = _md_log_path(args)
    try:
        e_start = atoms.get_total_energy()  # the first evaluation, before any file is opened
    except (ValueError, RuntimeError) as exc:
        raise CLIError(f"{args.file}, frame {frame}: {exc}") from exc
    # Frames and log lines go to OUTPUT.partial and LOG.partial as they come;
    # both are renamed when every step is done (see torchani_fast.apps.output).
    traj = PartialFile(args.output)
    log = PartialFile(log_path)
    logger = MDLogger(dyn, atoms, log.file, header=True, stress=False, peratom=False)

    def write_frame():
        traj.write(_extxyz(frozen_copy(atoms, atoms.calc.results)))
        log.flush()

    dyn.attach(logger, interval=args.interval)
    dyn.attach(write_frame, interval=args.interval)
    bar = progress(total=args.steps, desc="md", unit="step", disable=args.no_progress)

    def tick():
        if dyn.nsteps == 0:  # ASE also calls observers before the first step
            return
        bar.update(1)
        if dyn.nsteps % max(1, args.interval) == 0:
            bar.set_postfix(T=f"{atoms.get_temperature():.0f} K",
                            Etot=f"{atoms.get_total_energy():.4f} eV", refresh=False)

    dyn.attach(tick, interval=1)
    start = time.perf_counter()
    try:
        dyn.run(args.steps)
        traj.commit()
        log.commit()
    except (ValueError, RuntimeError) as exc:
        raise CLIError(f"{args.file}, frame {frame}, MD step {dyn.nsteps}: {exc}; the frames so far "
                       f"are in {traj.partial}") from exc
    except KeyboardInterrupt:
        print(f"interrupted at step {dyn.nsteps}: the frames so far are in {traj.partial}, "
              f"the log in {log.partial}", file=sys.stderr)
        raise
    finally:
        bar.close()
        traj.close()
        log.close()
    seconds = time.perf_counter() - start
    e_end = atoms.get_total_energy()
    ns_day = args.steps * args.dt * 1e-6 / max(seconds, 1e-9) * 86400
    print(f"{args.steps} {args.ensemble} steps of {args.dt} fs on {len(atoms)} atoms in {seconds:.1f} s "
          f"({ns_day:.2f} ns/day, {1e3 * seconds / max(args.steps, 1):.3f} ms/step); Etot {e_start:.6f} -> {e_end:.6f} eV "
          f"(change {e_end - e_start:+.2e} eV), final T {atoms.get_temperature():.1f} K")
    print(f"trajectory: {args.output}  log: {log_path}")
    return 0


def _md_log_path(args) -> Path:
    return args.log if args.log is not None else args.output.with_suffix(".log")


# ---------------------------------------------------------------- options
def _option_errors(args) -> tp.List[str]:
    """What is wrong with the options and paths of ``args`` (checked before any work)."""
    errors = []
    for name in ("batch_size", "steps", "interval", "workers", "max_atoms"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            errors.append(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    seed = getattr(args, "seed", None)
    if seed is not None and seed < 0:
        errors.append(f"--seed must be an integer >= 0, got {seed}")
    if getattr(args, "resume", False) and not (args.scheduler or args.workers):
        errors.append("--resume needs --scheduler or --workers (it continues a cluster run's "
                      "OUTPUT.partial)")
    fmax = getattr(args, "fmax", 1.0)
    if not (math.isfinite(fmax) and fmax > 0):
        errors.append(f"--fmax must be a finite number > 0 (eV/Å), got {fmax}")
    temperature = getattr(args, "temperature", 0.0)
    if not (math.isfinite(temperature) and temperature >= 0):
        errors.append(f"--temperature must be a finite number >= 0 (K), got {temperature}")
    elif temperature > 1e5:
        errors.append(f"--temperature {temperature} K is far beyond what an ANI model describes "
                      "(at most 100000 K accepted)")
    dt = getattr(args, "dt", 1.0)
    if not (math.isfinite(dt) and 0 < dt <= 10):
        errors.append(f"--dt must be in (0, 10] fs (0.5-1 fs is usual with hydrogens), got {dt}")
    friction = getattr(args, "friction", 0.0)
    if not (math.isfinite(friction) and friction >= 0):
        errors.append(f"--friction must be a finite number >= 0 (1/fs), got {friction}")
    index = getattr(args, "index", None)
    if index is not None:
        try:
            _index(index)
        except CLIError as exc:
            errors.append(str(exc))
    if args.command == "md":
        if _same_file(args.output, _md_log_path(args)):
            errors.append(f"-o {args.output} and the log {_md_log_path(args)} are the same file; "
                          "pass --log with another name")
        if _same_file(args.output, args.file) or _same_file(_md_log_path(args), args.file):
            errors.append(f"the output would overwrite the input {args.file}")
    if args.command in ("energy", "optimize") and args.output is not None:
        errors += [f"-o {args.output} would overwrite the input file {p}"
                   for p in args.files if _same_file(args.output, p)][:1]
    return errors


def _check_paths(args) -> None:
    """CLIError unless every input exists and every output can be created."""
    for path in getattr(args, "files", None) or [getattr(args, "file", None)]:
        if path is not None and not path.exists():
            raise CLIError(f"{path}: no such file")
        if path is not None and path.is_dir():
            raise CLIError(f"{path}: is a directory")
    outputs = [("-o", args.output)] if getattr(args, "output", None) is not None else []
    if args.command == "md":
        outputs.append(("--log", _md_log_path(args)))
    inputs = [p for p in getattr(args, "files", None) or [getattr(args, "file", None)] if p is not None]
    for option, path in outputs:
        try:
            check_writable(path, option, inputs)
        except OSError as exc:
            raise CLIError(str(exc)) from None


def _same_file(a: Path, b: Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


# ---------------------------------------------------------------- parser
def _common(p: argparse.ArgumentParser, default_dtype: str) -> None:
    p.add_argument("-m", "--model", type=_model_name, default="ANI2x",
                   help="ANI model: ANI2x (H C N O S F Cl, default), ANI1x, ANI1ccx or ANI1xnr "
                        "(H C N O), ANI2xr, ANI2dr, ANImbis, SnnANI2xr, ANIr2s, ANIr2s_water, "
                        "ANIr2s_ch3cn, ANIr2s_chcl3 (H C N O S F Cl); case-insensitive. Weights "
                        "are read from $TORCHANI_DATA_DIR/StateDicts")
    p.add_argument("-d", "--device", default=None,
                   help="torch device: cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("-t", "--dtype", type=_dtype_name, default=default_dtype,
                   help=f"float32 (f32) or float64 (f64) (default: {default_dtype})")
    p.add_argument("--no-progress", action="store_true", help="do not show progress bars (on stderr)")


def _cluster(p: argparse.ArgumentParser) -> None:
    """--scheduler/--workers/--resume: run on a Dask cluster (torchani_fast.screen)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--scheduler", metavar="ADDRESS", default=None,
                   help="run on the Dask cluster of this scheduler (e.g. tcp://host:8786)")
    g.add_argument("--workers", type=int, metavar="N", default=None,
                   help="run on a local Dask cluster of N single-threaded worker processes")
    p.add_argument("--resume", action="store_true",
                   help="with --scheduler/--workers: continue the run that left OUTPUT.partial")


def _on_cluster(args) -> bool:
    if args.resume and not (args.scheduler or args.workers):
        raise CLIError("--resume needs --scheduler or --workers")
    return bool(args.scheduler or args.workers)


def _run_screen(args) -> int:
    """``torchani-fast energy|optimize`` with ``--scheduler`` or ``--workers``."""
    from types import SimpleNamespace

    from .screen import ScreenError, _write_energy, screen

    common = dict(client=None, scheduler=args.scheduler, workers=args.workers, model=args.model,
                  dtype=args.dtype, device=args.device, index=args.index, resume=args.resume,
                  progress=not args.no_progress)
    try:
        if args.command == "energy":
            results = screen(args.files, "energy", forces=args.forces, hessians=args.hessians,
                             batch_size=args.batch_size, output=args.output,
                             indent=4 if args.output else None, **common)
            if args.output is None:  # the JSON goes to stdout, as the local command's
                spec = {"forces": args.forces or args.hessians, "hessians": args.hessians}
                _write_energy(sys.stdout, results, results.__getitem__, spec, None)
            else:
                print(f"{len(results)} structure(s) -> {args.output}", file=sys.stderr)
        else:
            results = screen(args.files, "optimize", fmax=args.fmax, steps=args.steps,
                             optimizer=args.optimizer, hessian=args.hessian, per_structure=args.per_structure,
                             output=args.output, **common)
            rows = [(r["file"], r["frame"], r["natoms"], r["steps"], r["converged"],
                     r["energy_start"], r["energy_final"], r["fmax"], r["seconds"])
                    for r in results if "error" not in r]
            if rows:
                _print_table(rows, SimpleNamespace(fmax=args.fmax, optimizer=args.optimizer,
                                                   model=args.model, dtype=args.dtype,
                                                   output=args.output))
    except ScreenError as exc:
        raise CLIError(str(exc)) from exc
    failed = [r["error"] for r in results if "error" in r]
    for message in failed:
        print(f"torchani-fast {args.command}: failed: {message}", file=sys.stderr)
    if failed:
        print(f"{len(failed)} of {len(results)} structure(s) failed (reported in the output)",
              file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``torchani-fast`` argument parser (subcommands energy, optimize, md)."""
    from ..compat import __version__

    parser = argparse.ArgumentParser(
        prog="torchani-fast",
        description="ANI energies, forces, geometry optimisation and molecular dynamics with "
                    "torchani_fast's kernels. Reads any file ASE reads (periodic cells are "
                    "honoured). Weights: $TORCHANI_DATA_DIR/StateDicts (TorchANI's data folder, "
                    "default ~/.local/share/Torchani); offline, set HF_HUB_OFFLINE=1.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"torchani_fast {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{energy,optimize,md}")

    p = sub.add_parser("energy", help="single-point energies (Ha), forces (Ha/Å) as JSON",
                       description=ENERGY_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path, metavar="FILE", help="structure file(s), any ASE format")
    p.add_argument("-f", "--forces", action="store_true", help="also output forces -dE/dx in Hartree/Å")
    p.add_argument("-s", "--hessians", action="store_true",
                   help="also output Hessians d2E/dx2 in Hartree/Å² (3N x 3N per structure; implies "
                        "--forces). Fails cleanly while second derivatives are not supported")
    p.add_argument("-i", "--index", default=":",
                   help="frames to read from each file, as ase.io.read's index (default ':' = all)")
    p.add_argument("-b", "--batch-size", type=int, default=64,
                   help="most structures per model call; structures with the same cell (or none) are batched, padded (default 64)")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="write the JSON here (default: print it to stdout)")
    _common(p, "float32")
    _cluster(p)
    p.set_defaults(run=_run_energy)

    p = sub.add_parser("optimize", help="relax geometries with BFGS, LBFGS or FIRE",
                       description=OPTIMIZE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path, metavar="FILE", help="structure file(s), any ASE format")
    p.add_argument("--fmax", type=float, default=0.01,
                   help="convergence: largest force on any atom, eV/Å (default 0.01)")
    p.add_argument("--steps", type=int, default=1000, help="maximum optimiser steps per structure (default 1000)")
    p.add_argument("--optimizer", type=str.upper, choices=["BFGS", "LBFGS", "FIRE"], default="BFGS",
                   help="ASE's optimiser of that name, step for step (default BFGS)")
    p.add_argument("--hessian", choices=["lindh", "ase"], default="lindh",
                   help="BFGS's starting Hessian: Lindh's model Hessian (default; fewer steps) "
                        "or ASE's 70 eV/Å² x identity")
    p.add_argument("--per-structure", action="store_true",
                   help="relax one structure at a time through ASE (default: all together)")
    p.add_argument("--max-atoms", type=int, default=4096,
                   help="batched: padded atoms per model call at most (default 4096)")
    p.add_argument("-i", "--index", default=":",
                   help="frames to optimise from each file, as ase.io.read's index (default ':' = all)")
    p.add_argument("-o", "--output", type=Path, default=Path("optimized.xyz"),
                   help="extended XYZ file for the optimised structures (default optimized.xyz)")
    _common(p, "float64")
    _cluster(p)
    p.set_defaults(run=_run_optimize)

    p = sub.add_parser("md", help="molecular dynamics (NVE or Langevin) with a trajectory and log",
                       description=MD_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", type=Path, metavar="FILE", help="starting structure, any ASE format")
    p.add_argument("--frame", type=int, default=-1,
                   help="frame of FILE to start from (default -1, the last, as ase.io.read)")
    p.add_argument("--steps", type=int, default=1000, help="number of MD steps (default 1000)")
    p.add_argument("--dt", type=float, default=0.5, help="time step in fs (default 0.5)")
    p.add_argument("--temperature", type=float, default=300.0,
                   help="K: initial Maxwell-Boltzmann velocities and Langevin bath (default 300)")
    p.add_argument("--ensemble", choices=["nve", "langevin"], default="nve",
                   help="nve: velocity Verlet; langevin: NVT Langevin thermostat (default nve)")
    p.add_argument("--friction", type=float, default=0.01,
                   help="Langevin friction in 1/fs (default 0.01)")
    p.add_argument("--keep-velocities", action="store_true",
                   help="start from the velocities stored in FILE instead of drawing new ones")
    p.add_argument("--seed", type=int, default=None, help="random seed for velocities and Langevin noise")
    p.add_argument("--interval", type=int, default=10,
                   help="write a trajectory frame and a log line every N steps (default 10)")
    p.add_argument("-o", "--output", type=Path, default=Path("md.xyz"),
                   help="extended XYZ trajectory (default md.xyz)")
    p.add_argument("--log", type=Path, default=None,
                   help="MD log file (default: the trajectory name with .log)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="on a GPU, evaluate every step eagerly instead of replaying a CUDA graph "
                        "captured at the first step (molecules; periodic systems run eagerly anyway)")
    _common(p, "float64")
    p.set_defaults(run=_run_md)
    return parser


def main(argv: tp.Optional[tp.Sequence[str]] = None) -> int:
    """Run ``torchani-fast`` with ``argv`` (default ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status: 0 on success, 1 on errors (reported on stderr as one
        line naming the file, frame and element where relevant), 2 on bad
        command-line usage.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    errors = _option_errors(args)
    if errors:
        parser.error("; ".join(errors))  # exit status 2, before any work
    terminate_as_interrupt()
    try:
        _check_paths(args)
        return args.run(args)
    except (CLIError, OSError) as exc:
        print(f"torchani-fast {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"torchani-fast {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
