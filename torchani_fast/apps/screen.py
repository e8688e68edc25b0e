"""Screening on a Dask cluster: ``torchani-fast energy|optimize --scheduler/--workers``.

The structures of the input files are described (size, cell) by tasks that read
the frames lazily by byte offset, grouped into the same batches as the local
command (same cell, sorted by size, at most ``batch_size`` structures), and the
batches are evaluated by Dask workers. Each worker process builds the model once
(:data:`_WORKER_MODELS`), runs torch with one thread and keeps the model between
tasks. Results are appended, one JSON line per structure, to ``OUTPUT.partial``
as they arrive and the final file (the local command's layout, in input order)
is written only once every structure is done, then renamed into place; an
interrupted run leaves just the ``.partial`` file, which ``resume=True`` continues.

>>> from distributed import Client
>>> results = torchani_fast.screen(["confs.xyz"], client=Client("tcp://host:8786"))
>>> results[0]["energy"]                                      # doctest: +SKIP
"""
import functools
import io
import os
import sys
import time
import typing as tp
import uuid
from pathlib import Path

from .output import atomic_file, check_not_input
from .screen_files import ScreenError, _Memory, _Partial, _entry, _write_energy
from .structures import (MODEL_NAMES, batch_key, batch_results, check_structure, evaluate_batch, frozen_copy,
                         ase_optimizer, plan_batches, read_frames, select_frames)
from .structures import progress as _progress_bar

__all__ = ["screen", "ScreenError", "local_cluster"]

_FORMAT_VERSION = 3  # 2: a line per task; 3: the inputs' fingerprints in the header
_DESCRIBE_CHUNK = 1000  # frames described per task
_TASK_ATOMS = 8192  # atoms per energy task, at most (consecutive batches joined)
_WORKER_MODELS: set = set()  # the (model, device, dtype) this worker process has used
_WORKER_LOADS = [0]  # how many models this process built (the tests read it)


# ---------------------------------------------------------------- reading frames
def _format(path: Path) -> str:
    from ase.io.formats import filetype

    try:
        return filetype(str(path), read=True)
    except Exception as exc:
        raise ScreenError(f"{path}: cannot be read by ASE ({type(exc).__name__}: {exc})") from exc


_NO_CELL = ((False, False, False), b"")  # the batching key of a structure without a cell


@functools.lru_cache(maxsize=4096)  # the comment lines of a file's frames are often all equal
def _header_key(comment: bytes):
    """The batching key of an extended XYZ frame from its comment line, if that
    shows it has no cell (ASE: no ``Lattice=`` and no true ``pbc=``); else None."""
    if b"=" not in comment:
        return _NO_CELL
    from ase.io.extxyz import key_val_str_to_dict

    try:
        info = key_val_str_to_dict(comment.decode())
    except Exception:
        return None  # let the parse of the whole frame say what is wrong
    if "Lattice" in info:
        return None
    pbc = info.get("pbc", False)
    try:
        return _NO_CELL if not any(bool(p) for p in (pbc if hasattr(pbc, "__len__") else [pbc])) else None
    except TypeError:
        return None


def _xyz_frames(path: Path) -> tp.List[tp.Tuple[int, int, tp.Any]]:
    """``[(byte offset, natoms, batching key or None)]`` of every frame of an
    (extended) XYZ file.

    Only the atom-count and comment lines are parsed, so the scan is fast and
    needs no memory for the structures; the frames themselves are parsed by the
    workers (and here only the keys of periodic frames are left to them).
    """
    frames = []
    with open(path, "rb") as f:
        pos = 0
        lineno = 0
        while True:
            line = f.readline()
            if not line:
                return frames
            lineno += 1
            if not line.strip():  # blank lines between or after frames
                pos += len(line)
                continue
            try:
                natoms = int(line.split()[0])
            except ValueError:
                raise ScreenError(f"{path}: line {lineno} should hold a frame's atom count, "
                                  f"found {line[:40].decode(errors='replace')!r}") from None
            start = pos
            pos += len(line)
            comment = f.readline()
            pos += len(comment)
            for _ in range(natoms):
                line = f.readline()
                if not line:
                    raise ScreenError(f"{path}: frame {len(frames)} (line {lineno}) is truncated")
                pos += len(line)
            lineno += natoms + 1
            frames.append((start, natoms, _header_key(comment)))


def _read_frame(item: dict):
    """The ``ase.Atoms`` of one work item (parsed from its bytes, or carried along)."""
    atoms = _read_frames([item])[0]
    if isinstance(atoms, Exception):
        raise atoms
    return atoms


def _read_frames(items: list) -> list:
    """The ``ase.Atoms`` of ``items``, or an exception in place of a frame that
    cannot be parsed. The frames' texts are joined and parsed by one
    ``ase.io.read`` (65 instead of 107 us a CH4 frame with one call per frame;
    the same structures), frame by frame only when that fails."""
    import ase.io

    files: dict = {}
    try:
        lazy = [item for item in items if "atoms" not in item]
        texts = []
        for item in lazy:
            f = files.get(item["file"])
            if f is None:
                f = files[item["file"]] = open(item["file"], "rb")
            f.seek(item["offset"])
            texts.append(b"".join(f.readline() for _ in range(item["natoms"] + 2)))
        try:
            parsed = ase.io.read(io.StringIO(b"".join(texts).decode()), index=":", format="extxyz")
            if len(parsed) != len(lazy):
                raise ValueError("frame count")
        except Exception:  # find the frames that fail, one by one
            parsed = []
            for text in texts:
                try:
                    parsed.append(ase.io.read(io.StringIO(text.decode()), format="extxyz"))
                except Exception as exc:
                    parsed.append(exc)
        it = iter(parsed)
        return [item["atoms"] if "atoms" in item else next(it) for item in items]
    finally:
        for f in files.values():
            f.close()


def _select(path, count: int, index: str) -> tp.List[int]:
    """Frame numbers that ``index`` selects of ``count`` (structures.select_frames)."""
    try:
        return select_frames(path, count, index)
    except ValueError as exc:
        raise ScreenError(str(exc)) from None


def _inputs(files) -> tp.List[tp.Union[Path, tp.Tuple[str, list]]]:
    """``files`` as a list of inputs: a ``Path`` per file, and ``(name, [Atoms...])``
    per run of consecutive ``ase.Atoms`` (named ``<atoms[i:j]>`` by their places
    in ``files``). Accepts a path (str or ``os.PathLike``), an ``Atoms``, or a
    sequence mixing them; anything else is a ``TypeError`` naming it."""
    import ase

    if isinstance(files, (str, bytes, os.PathLike, ase.Atoms)):
        files = [files]
    try:
        given = list(files)
    except TypeError:
        raise TypeError(f"files must be a path, an ase.Atoms or a sequence of them, got "
                        f"{type(files).__module__}.{type(files).__name__}") from None
    if not given:
        raise ScreenError("files is empty: nothing to screen")
    inputs: tp.List[tp.Union[Path, tp.Tuple[str, list]]] = []
    run: list = []

    def close_run(end: int) -> None:
        if run:
            inputs.append((f"<atoms[{end - len(run)}:{end}]>", list(run)))
            run.clear()

    for k, f in enumerate(given):
        if isinstance(f, ase.Atoms):
            run.append(f)
            continue
        close_run(k)
        if isinstance(f, bytes):
            f = os.fsdecode(f)
        if not isinstance(f, (str, os.PathLike)):
            raise TypeError(f"files[{k}] must be a path (str or os.PathLike) or an ase.Atoms, got "
                            f"{type(f).__module__}.{type(f).__name__}")
        inputs.append(Path(f))
    close_run(len(given))
    return inputs


def _fingerprint(source) -> dict:
    """What a resumed run checks its inputs against: size, modification time and
    a SHA-256 of a file's bytes (of the structures' numbers, positions, cell and
    pbc for ``Atoms``)."""
    import hashlib

    digest = hashlib.sha256()
    if isinstance(source, Path):
        stat = source.stat()
        with open(source, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return {"file": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                "sha256": digest.hexdigest()}
    name, frames = source
    for atoms in frames:
        for array in (atoms.numbers, atoms.positions, atoms.cell.array, atoms.pbc):
            digest.update(array.tobytes())
    return {"file": name, "size": len(frames), "sha256": digest.hexdigest()}


def _items(paths: tp.Sequence[tp.Union[Path, tp.Tuple[str, list]]], index: str) -> tp.List[dict]:
    """One work item per selected frame: file, frame and where to read it (or the
    structure itself, for the inputs that are ``Atoms``)."""
    items = []
    for path in paths:
        if isinstance(path, tuple):  # (name, [Atoms]) from _inputs
            name, frames = path
            for k in _select(name, len(frames), index):
                items.append({"file": name, "frame": k, "atoms": frames[k],
                              "natoms": len(frames[k]), "key": batch_key(frames[k])})
            continue
        if not path.exists():
            raise ScreenError(f"{path}: no such file")
        fmt = _format(path)
        if fmt == "extxyz":
            frames = _xyz_frames(path)
            for k in _select(path, len(frames), index):
                items.append({"file": str(path), "frame": k, "offset": frames[k][0],
                              "natoms": frames[k][1], "key": frames[k][2]})
        else:  # other formats: read here and ship the structures (not lazy)
            try:
                frames = read_frames(path, index)
            except ValueError as exc:
                raise ScreenError(str(exc)) from None
            for k, atoms in frames:
                items.append({"file": str(path), "frame": k, "atoms": atoms,
                              "natoms": len(atoms), "key": batch_key(atoms)})
    return items


def _problem(atoms, item: dict, model: str) -> tp.Optional[str]:
    """Why ``atoms`` cannot be evaluated by ``model`` (the local command's message), or None."""
    try:
        check_structure(model, f"{item['file']}, frame {item['frame']}", atoms)
    except ValueError as exc:
        return str(exc)
    return None


class _Shipped:
    """A task's result as it travels back to the client. Dask sends a list,
    tuple or dict a task returns element by element (one message frame and one
    ``pickle.loads`` each): for 20 000 CH4 energies the client's CPU per
    2-worker run was 0.65-0.9 s, and 0.3-0.45 s with the records in one object,
    which goes as one pickle."""

    __slots__ = ("records",)

    def __init__(self, records: list):
        self.records = records


def _shipped(fn, spec: dict, payload) -> _Shipped:
    """What the workers run: the task ``fn(spec, payload)``, its result shipped."""
    return _Shipped(fn(spec, payload))


def _describe(spec: dict, packed: tuple) -> list:
    """Worker task: ``[(natoms, cell key, problem or None)]`` of each item of
    ``packed`` (:func:`_pack`; the periodic frames, whose cell the comment-line
    scan leaves to a full parse)."""
    model = spec["model"]
    items = _unpack(packed, spec["files"])
    out = []
    for item, atoms in zip(items, _read_frames(items)):
        if isinstance(atoms, Exception):
            out.append((item["natoms"], None, f"{item['file']}, frame {item['frame']}: "
                                              f"cannot be parsed ({type(atoms).__name__}: {atoms})"))
            continue
        out.append((len(atoms), batch_key(atoms), _problem(atoms, item, model)))
    return out


def _plan(meta: list, batch_size: int, max_slots: int = 32768) -> tp.List[tp.List[int]]:
    """Batches of item indices, exactly as the local command forms them
    (:func:`~torchani_fast.apps.structures.plan_batches`), so results are the same bits;
    items with a problem are left out."""
    return plan_batches([m[0] for m in meta], [m[1] if m[2] is None else None for m in meta],
                        batch_size, max_slots)


# ---------------------------------------------------------------- worker side
def _worker_model(name: str, device: tp.Optional[str], dtype: str):
    """The patched model of this worker process, built on first use and kept."""
    import torch

    from .. import models

    torch.set_num_threads(1)  # one worker process = one core
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    key = (name, device, dtype)
    if key not in _WORKER_MODELS:  # (built by models.load, the one cache, on first use)
        _WORKER_MODELS.add(key)
        _WORKER_LOADS[0] += 1
    return models.load(name, device=device, dtype=getattr(torch, dtype))


def _worker_loads() -> int:
    """How many models this process has built (``client.run(_worker_loads)``)."""
    return _WORKER_LOADS[0]


def _energy_records(model, spec: dict, items: list, atoms_list: list) -> list:
    """Energies (forces, Hessians) of one batch, computed as the local command does."""
    e, f, h = evaluate_batch(model, atoms_list, spec["forces"], spec["hessians"])
    return [dict(i=item["i"], **rec) for item, rec in zip(items, batch_results(atoms_list, e, f, h))]


def _energy_task(spec: dict, batches: list) -> list:
    """Worker task: one record per item of each batch (a task holds a few
    consecutive batches, so that its scheduling costs little beside its work)."""
    model = _worker_model(spec["model"], spec["device"], spec["dtype"])
    records: list = []
    for packed in batches:
        records.extend(_energy_batch(model, spec, _unpack(packed, spec["files"])))
    return records


def _energy_batch(model, spec: dict, items: list) -> list:
    """The records of one batch; a failing batch is retried structure by
    structure so one bad structure costs only its own result."""
    records, good, atoms_list = _checked(spec, items)
    items = good
    if not items:
        return records
    try:
        return records + _energy_records(model, spec, items, atoms_list)
    except Exception as exc:
        if len(items) == 1:
            return records + [_error_record(items[0], f"{type(exc).__name__}: {exc}")]
    for item, atoms in zip(items, atoms_list):
        try:
            records.extend(_energy_records(model, spec, [item], [atoms]))
        except Exception as exc:
            records.append(_error_record(item, f"{type(exc).__name__}: {exc}"))
    return records


def _checked(spec: dict, items: list) -> tuple:
    """``(error records, good items, their atoms)``: a frame that cannot be parsed or
    evaluated (element, coordinates) is reported and left out of the batch."""
    records, good, atoms_list = [], [], []
    for item, atoms in zip(items, _read_frames(items)):
        if isinstance(atoms, Exception):
            records.append(_error_record(item, f"cannot be parsed ({type(atoms).__name__}: {atoms})"))
            continue
        problem = _problem(atoms, item, spec["model"])
        if problem is not None:
            records.append(_error_record(item, problem))
            continue
        good.append(item)
        atoms_list.append(atoms)
    return records, good, atoms_list


def _optimize_task(spec: dict, batches: list) -> list:
    """Worker task: relax each item as the local ``optimize`` command does."""
    import ase.io
    import numpy as np

    from .ase import Calculator

    model = _worker_model(spec["model"], spec["device"], spec["dtype"])
    calc = Calculator(model)
    records, items, atoms_list = _checked(spec, [item for packed in batches
                                                 for item in _unpack(packed, spec["files"])])
    if spec.get("batched"):
        from .optimize_batched import task_records

        return records + task_records(spec, items, atoms_list, model)
    for item, atoms in zip(items, atoms_list):
        try:
            atoms = atoms.copy()
            atoms.calc = calc
            e0 = atoms.get_potential_energy()
            opt = ase_optimizer(spec["optimizer"], atoms, spec.get("hessian", "ase"), logfile=None)
            start = time.perf_counter()
            converged = bool(opt.run(fmax=spec["fmax"], steps=spec["steps"]))
            seconds = time.perf_counter() - start
            e1 = atoms.get_potential_energy()
            fmax = float(np.sqrt((atoms.get_forces() ** 2).sum(axis=1).max()))
        except Exception as exc:
            records.append(_error_record(item, f"{type(exc).__name__}: {exc}"))
            continue
        final = frozen_copy(atoms, calc.results)
        final.info = {k: v for k, v in final.info.items() if v is not True}
        final.info.update(source=item["file"], frame=item["frame"], optimizer=spec["optimizer"],
                          steps=opt.nsteps, converged=converged, fmax=fmax)
        text = io.StringIO()
        ase.io.write(text, final, format="extxyz")
        records.append({"i": item["i"], "xyz": text.getvalue(),
                        "row": [item["file"], item["frame"], len(atoms), opt.nsteps, converged,
                                e0, e1, fmax, seconds]})
    return records


def _error_record(item: dict, message: str) -> dict:
    if not message.startswith(item["file"]):
        message = f"{item['file']}, frame {item['frame']}: {message}"
    return {"i": item["i"], "error": message}


def _pack(items: list, file_ids: dict) -> tuple:
    """A batch's items as a task carries them: an int64 array of (index, file,
    frame, byte offset, atoms) rows, and the structures of items read on the
    client (None if there are none). Pickling 20 000 item dicts cost the client
    0.3 s per run."""
    import numpy as np

    table = np.array([(item["i"], file_ids[item["file"]], item["frame"], item.get("offset", -1),
                       item["natoms"]) for item in items], dtype=np.int64).reshape(-1, 5)
    shipped = [item.get("atoms") for item in items]
    return table, (shipped if any(a is not None for a in shipped) else None)


def _unpack(packed: tuple, files: tp.Sequence[str]) -> list:
    """The work items of :func:`_pack` (the worker's side)."""
    table, shipped = packed
    items = []
    for k, (i, f, frame, offset, natoms) in enumerate(table.tolist()):
        item = {"i": i, "file": files[f], "frame": frame, "natoms": natoms}
        if shipped is None or shipped[k] is None:
            item["offset"] = offset
        else:
            item["atoms"] = shipped[k]
        items.append(item)
    return items


def _join_batches(batches: list, task_atoms: int, nthreads: int) -> tp.List[list]:
    """Consecutive batches joined into Dask tasks, largest first (guided
    self-scheduling): each task takes about a ``2 * nthreads``-th of the atoms
    still to hand out, at most ``task_atoms``, so there are few tasks (each costs
    the scheduler, the client and a worker several milliseconds over loopback)
    while the last ones are single batches that keep every worker busy to the
    end. Results do not depend on it: the batches are the same."""
    sizes = [sum(item["natoms"] for item in items) for items in batches]
    remaining = sum(sizes)
    tasks, task, atoms = [], [], 0
    for items, size in zip(batches, sizes):
        task.append(items)
        atoms += size
        if atoms >= min(task_atoms, remaining / (2 * nthreads)):
            tasks.append(task)
            remaining -= atoms
            task, atoms = [], 0
    if task:
        tasks.append(task)
    return tasks


# ---------------------------------------------------------------- driver
# Dask's periodic work that a screening cluster on one machine does without:
# the statistical profiler samples each running task's stack every 10 ms on the
# worker's event loop (0.05-0.1 s of CPU per worker in a 2 s run here), and the
# event-loop tick (20 ms), memory monitor (100 ms) and system monitor (500 ms)
# took 0.10 of the 2 cores with a scheduler and 2 idle workers (0.02 with these).
_LOCAL_CLUSTER_CONFIG = {
    "distributed.worker.profile.enabled": False,
    "distributed.admin.tick.interval": "1s",
    "distributed.worker.memory.monitor-interval": "1s",
    "distributed.admin.system-monitor.interval": "5s",
}


def local_cluster(workers: int):
    """The ``distributed.LocalCluster`` of ``--workers N``: N single-threaded worker
    processes on 127.0.0.1, no dashboard, and less of Dask's periodic work
    (``_LOCAL_CLUSTER_CONFIG``: no profiler, slower ticks and monitors)."""
    import dask
    from distributed import LocalCluster

    with dask.config.set(_LOCAL_CLUSTER_CONFIG):
        return LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                            host="127.0.0.1", dashboard_address=None)


def _connect(client, scheduler: tp.Optional[str], workers: tp.Optional[int], timeout: float):
    """``(client, close)``: the given client, one connected to ``scheduler``, or a
    local cluster of ``workers`` single-threaded processes on 127.0.0.1."""
    from distributed import Client

    if client is not None:
        return client, lambda: None
    if scheduler:
        try:  # timeout None: dask's distributed.comm.timeouts.connect (also how long to reconnect)
            client = Client(scheduler, **({} if timeout is None else {"timeout": timeout}))
        except (OSError, TimeoutError, ValueError) as exc:
            raise ScreenError(f"--scheduler {scheduler}: cannot connect to a Dask scheduler "
                              f"({type(exc).__name__}: {exc})") from exc
        return client, client.close
    if workers is None or workers < 1:
        raise ScreenError(f"--workers must be at least 1, got {workers!r}")
    cluster = local_cluster(workers)
    client = Client(cluster)

    def close():
        client.close()
        cluster.close()

    return client, close


def _execute(client, fn, spec: dict, tasks: list, sink, bar, callback) -> None:
    """Run ``fn(spec, items)`` for every task with a bounded number in flight,
    handing each result to ``sink`` as it arrives (in completion order)."""
    from distributed import as_completed

    from distributed import CancelledError

    tag = uuid.uuid4().hex[:10]
    nthreads = sum(client.nthreads().values()) or 1
    # Enough queued per worker to hide the round trips, few enough for the
    # scheduler's memory; submitted in bulk (each submit call is a round trip
    # to the client's event loop).
    window = max(32, 8 * nthreads)
    submitted = 0
    # On this client's event loop: as_completed's default is the default client's
    # (the newest one), and futures tracked on another client's loop never complete.
    running = as_completed(loop=client.loop, with_results=True, raise_errors=False)
    in_flight = 0

    def refill() -> None:
        nonlocal submitted, in_flight
        if in_flight > window // 2 or submitted == len(tasks):
            return
        chunk = tasks[submitted:submitted + window - in_flight]
        keys = [f"torchani-fast-{tag}-{b}" for b in range(submitted, submitted + len(chunk))]
        running.update(client.map(_shipped, [fn] * len(chunk), [spec] * len(chunk), chunk,
                                  key=keys, pure=False))
        submitted += len(chunk)
        in_flight += len(chunk)

    refill()
    for future, records in running:
        in_flight -= 1
        if future.status == "cancelled" or isinstance(records, CancelledError):
            raise ScreenError("lost the Dask scheduler (its connection closed); the results so "
                              "far are kept, rerun the same command with --resume")
        if future.status == "error":  # KilledWorker after repeated deaths, or a bug
            raise ScreenError(f"a Dask task failed ({type(records).__name__}: {records}); the "
                              "results so far are kept, rerun the same command with --resume")
        future.release()
        records = records.records
        sink(records)
        bar.update(len(records))
        if callback is not None:
            callback(records)
        refill()


def _write_optimized(out, items: list, get) -> None:
    import ase.io

    for i, item in enumerate(items):
        rec = get(i)
        if "xyz" in rec:
            out.write(rec["xyz"])
            continue
        try:  # the input structure, flagged, so the failure is in the output
            atoms = _read_frame(item).copy()
        except Exception:
            continue
        atoms.info = {k: v for k, v in atoms.info.items() if v is not True}
        atoms.info.update(source=item["file"], frame=item["frame"], converged=False,
                          error=rec["error"])
        ase.io.write(out, atoms, format="extxyz")


def _result(item: dict, rec: dict, command: str) -> dict:
    """The per-structure result the API returns."""
    import ase.io

    res = _entry(item, rec)
    if command == "energy":
        res.update({k: rec[k] for k in ("energy", "forces", "hessians") if k in rec})
    elif "row" in rec:
        res.update(zip(("steps", "converged", "energy_start", "energy_final", "fmax", "seconds"),
                       rec["row"][3:]))
        res["atoms"] = ase.io.read(io.StringIO(rec["xyz"]), format="extxyz")
    return res


def screen(files: tp.Sequence[tp.Union[str, Path]], command: str = "energy", *, client=None,
           scheduler: tp.Optional[str] = None, workers: tp.Optional[int] = None,
           model: str = "ANI2x", dtype: tp.Optional[str] = None, device: tp.Optional[str] = None,
           forces: bool = False, hessians: bool = False, index: str = ":", batch_size: int = 64,
           fmax: float = 0.01, steps: int = 1000, optimizer: str = "BFGS", hessian: str = "lindh",
           per_structure: bool = False, output: tp.Union[str, Path, None] = None, indent: tp.Optional[int] = 4,
           resume: bool = False, progress: bool = False, return_results: bool = True,
           callback: tp.Optional[tp.Callable[[list], None]] = None,
           timeout: tp.Optional[float] = None, task_atoms: int = _TASK_ATOMS) -> tp.Optional[tp.List[dict]]:
    """Energies or relaxed geometries of every structure of ``files`` on a Dask cluster.

    Parameters
    ----------
    files : str, Path, ase.Atoms, or a sequence of them
        Structure files, any format ASE reads; extended XYZ is read lazily by the
        workers (frame by byte offset), other formats are read here and shipped.
        ``Atoms`` are shipped as they are; a run of consecutive ones is one input
        named ``<atoms[i:j]>`` (their places in ``files``), whose frames
        ``index`` selects like a file's.
    command : {"energy", "optimize"}
        What the ``torchani-fast`` subcommand of that name computes.
    client : distributed.Client, optional
        A connected client. Otherwise one is made for ``scheduler`` (an address,
        ``tcp://host:8786``) or for a local cluster of ``workers`` processes.
    model, dtype, device, forces, hessians, index, batch_size, fmax, steps, optimizer, hessian
        As the command's options (``dtype`` defaults to float32 for energy and
        float64 for optimize; ``device`` to cuda if the worker has it, else cpu).
        Each task relaxes its 64 structures as one batch
        (:mod:`torchani_fast.batched`; the steps of ASE's optimiser on each
        alone); ``per_structure=True`` relaxes 4 per task one at a time with ASE.
    output : str or Path, optional
        Final file: JSON (energy, with ``indent``) or extended XYZ (optimize),
        written at the end; records stream to ``OUTPUT.partial`` meanwhile.
        Without it nothing is written (and nothing can be resumed).
    resume : bool
        Continue the run that left ``OUTPUT.partial`` (same arguments). Refused
        if an input changed since (its size or SHA-256 differs from the
        fingerprint stored in the partial file).
    progress : bool
        Show a progress bar over structures (with throughput) on stderr.
    return_results : bool
        Return the per-structure results (False for runs too big for memory).
    callback : callable, optional
        Called with the records of every finished batch (as they arrive); they
        are what the output file is written from, so it must not modify them.
    timeout : float, optional
        Seconds to wait for the scheduler when connecting (and reconnecting);
        default dask's ``distributed.comm.timeouts.connect``.
    task_atoms : int
        Energy batches are sent to the workers joined into tasks of up to about
        this many atoms, smaller towards the end of the run so that the workers
        finish together; 0 sends one batch per task. Results do not depend on it.

    Returns
    -------
    list of dict or None
        One dict per structure, in input order: ``file``, ``frame``, ``natoms``,
        then ``energy`` (Hartree), ``forces`` (Hartree/Å), ``hessians`` or, for
        optimize, ``atoms``, ``steps``, ``converged``, ``energy_start``,
        ``energy_final`` (eV), ``fmax``; ``error`` (a message) for a structure
        that could not be evaluated.

    Raises
    ------
    ScreenError
        Unreadable input, a foreign ``.partial`` file, a lost scheduler.
    """
    if command not in ("energy", "optimize"):
        raise ScreenError(f"command must be 'energy' or 'optimize', got {command!r}")
    model = MODEL_NAMES.get(str(model).lower(), model)
    if model not in MODEL_NAMES.values():
        raise ScreenError(f"unknown model {model!r}; choose one of {', '.join(MODEL_NAMES.values())}")
    if batch_size < 1:
        raise ScreenError(f"batch_size must be at least 1, got {batch_size!r}")
    if not isinstance(task_atoms, int) or task_atoms < 0:
        raise ScreenError(f"task_atoms must be an integer >= 0, got {task_atoms!r}")
    if resume and output is None:
        raise ScreenError("resume needs an output file (-o): the partial results live next to it")
    if client is None and not scheduler and (isinstance(workers, bool) or not isinstance(workers, int)
                                             or workers < 1):
        # (checked before OUTPUT.partial is made: a refused run leaves no file behind)
        raise ScreenError(f"--workers must be at least 1, got {workers!r} (or pass client= or scheduler=)")
    dtype = dtype or ("float32" if command == "energy" else "float64")
    sources = _inputs(files)
    paths = [p for p in sources if isinstance(p, Path)]
    items = _items(sources, index)
    for i, item in enumerate(items):
        item["i"] = i
    names = [str(p) if isinstance(p, Path) else p[0] for p in sources]
    spec = {"version": _FORMAT_VERSION, "command": command, "files": names,
            "index": index, "structures": len(items), "model": model, "dtype": dtype,
            "device": device}
    if command == "energy":
        spec.update(forces=bool(forces or hessians), hessians=bool(hessians), batch_size=batch_size)
    else:
        if hessian not in ("lindh", "ase"):
            raise ScreenError(f"hessian must be 'lindh' or 'ase', got {hessian!r}")
        spec.update(fmax=float(fmax), steps=int(steps), optimizer=str(optimizer).upper(), hessian=hessian)
        # Each task's structures relaxed as one batch (torchani_fast.batched).
        spec.update(batched=not per_structure)
    output = None if output is None else Path(output)
    if output is not None:
        try:
            check_not_input(output, paths, "output")
        except OSError as exc:
            raise ScreenError(str(exc)) from None
    # The partial file's header: the spec and a fingerprint of every input, so
    # that a resumed run never mixes results of inputs edited since.
    sink = _Memory() if output is None else _Partial(
        output, dict(spec, inputs=[_fingerprint(p) for p in sources]), resume)
    close = lambda: None  # noqa: E731
    try:
        client, close = _connect(client, scheduler, workers, timeout)
        n = len(items)
        if sink.done:
            print(f"resuming {sink.path}: {len(sink.done)} of {n} structure(s) already done",
                  file=sys.stderr)
        # Sizes and cells (to batch as the local command does): from the scan, or
        # for periodic frames from the workers.
        # Tasks carry their items as _pack's tables; file k is spec["files"][k].
        file_ids = {f: k for k, f in enumerate(spec["files"])}
        meta = [(item["natoms"], item["key"], None) for item in items]
        todo = [item for item in items if item["key"] is None]
        chunks = [todo[s:s + _DESCRIBE_CHUNK] for s in range(0, len(todo), _DESCRIBE_CHUNK)]
        parts = client.gather([client.submit(_shipped, _describe, spec, _pack(c, file_ids),
                                             pure=False) for c in chunks])
        for chunk, part in zip(chunks, parts):
            for item, m in zip(chunk, part.records):
                meta[item["i"]] = m
        sink.write([_error_record(items[i], m[2]) for i, m in enumerate(meta)
                    if m[2] is not None and i not in sink.done])
        if command == "energy":
            fn, batches = _energy_task, _plan(meta, batch_size)
        else:
            good = [i for i, m in enumerate(meta) if m[2] is None]
            size = 64 if spec["batched"] else 4
            fn, batches = _optimize_task, [good[s:s + size] for s in range(0, len(good), size)]
        batches = [[items[i] for i in b] for b in batches if any(i not in sink.done for i in b)]
        if command == "energy" and not hessians:
            tasks = _join_batches(batches, task_atoms, sum(client.nthreads().values()) or 1)
        else:
            tasks = [[b] for b in batches]
        tasks = [[_pack(batch, file_ids) for batch in task] for task in tasks]
        bar = _progress_bar(total=n, initial=len(sink.done), desc=command, unit="structure",
                            disable=not progress)
        try:
            _execute(client, fn, spec, tasks, sink.write, bar, callback)
        finally:
            bar.close()
    except BaseException:
        sink.close()
        raise
    finally:
        close()
    try:  # (the partial file stays locked until the final file replaced it)
        return _finish(sink, items, spec, output, indent, return_results)
    finally:
        sink.close()


def _finish(sink, items: list, spec: dict, output: tp.Optional[Path], indent, return_results):
    """Write the final file (then drop the partial one) and the API's results."""
    get = sink.records()
    try:
        if output is not None:
            with atomic_file(output, [f for f in spec["files"] if not f.startswith("<atoms[")]) as out:
                if spec["command"] == "energy":
                    _write_energy(out, items, get, spec, indent)
                else:
                    _write_optimized(out, items, get)
            sink.path.unlink()
        if not return_results:
            return None
        return [_result(item, get(i), spec["command"]) for i, item in enumerate(items)]
    finally:
        get.close()
