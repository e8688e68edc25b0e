"""``torchani-fast optimize``: every structure relaxed in one in-flight batch.

The command line's per-structure path (:func:`torchani_fast.cli._optimize_one`,
ASE's optimisers one structure at a time) and this one write the same file: one
extended XYZ frame per structure, in input order, with the same ``info`` keys,
streamed to ``OUTPUT.partial`` (each structure as soon as it and all structures
before it are done) and renamed to ``OUTPUT`` at the end. A structure that fails
inside the batch (non-finite energy or forces) is written with its last
positions and ``error=...`` and makes the exit status 1; the others are relaxed
as usual.
"""
import sys
import time

__all__ = ["run"]


def run(args, structures: list, model, extxyz, print_table, error_cls) -> int:
    """Relax ``structures`` ([(path, frame, atoms)]) with ``args``' options; the exit status."""
    import numpy as np

    from .output import PartialFile
    from .batched import iter_optimize, named_optimizer
    from .structures import frozen_copy, progress

    n = len(structures)
    rows: list = [None] * n
    frames: dict = {}
    failures = []
    written = 0
    start = time.perf_counter()
    with PartialFile(args.output) as out:
        bar = progress(total=n, desc="structures", unit="structure", disable=args.no_progress or n < 2)
        try:
            optimizer = named_optimizer(args.optimizer, args.hessian)
            for i, r in iter_optimize(model, [a for _, _, a in structures], fmax=args.fmax,
                                      steps=args.steps, optimizer=optimizer,
                                      max_atoms=args.max_atoms):
                path, frame, atoms = structures[i]
                final = atoms.copy()
                final.positions = r.positions
                final = frozen_copy(final, {"energy": r.energy, "forces": r.forces})
                final.info = {k: v for k, v in atoms.info.items() if v is not True}
                final.info.update(source=str(path), frame=frame, optimizer=args.optimizer,
                                  steps=r.steps, converged=r.converged,
                                  fmax=r.fmax if np.isfinite(r.fmax) else -1.0)
                if r.error is not None:
                    final.info["error"] = r.error
                    failures.append(f"{path}, frame {frame}: {r.error}")
                frames[i] = extxyz(final)
                rows[i] = (str(path), frame, len(atoms), r.steps, r.converged, r.energy_start,
                           r.energy, r.fmax, time.perf_counter() - start)
                while written < n and written in frames:  # the finished prefix, in input order
                    out.write(frames.pop(written))
                    written += 1
                bar.update(1)
        except KeyboardInterrupt:
            print(f"interrupted: the {written} structure(s) finished are in {out.partial}", file=sys.stderr)
            raise
        finally:
            bar.close()
        out.commit()
    print_table(rows, args)
    if failures:
        raise error_cls("; ".join(failures) + f" (written with error=... to {args.output})")
    return 0


def task_records(spec: dict, items: list, atoms_list: list, model) -> list:
    """A Dask worker's share (:func:`torchani_fast.screen`'s optimize task) relaxed
    as one batch: the records the per-structure task makes, one per item."""
    import io

    import ase.io
    import numpy as np

    from .batched import iter_optimize, named_optimizer
    from .structures import frozen_copy

    records = []
    start = time.perf_counter()
    for k, r in iter_optimize(model, atoms_list, fmax=spec["fmax"], steps=spec["steps"],
                              optimizer=named_optimizer(spec["optimizer"], spec.get("hessian", "ase")),
                              max_atoms=spec.get("max_atoms", 4096)):
        item, atoms = items[k], atoms_list[k]
        if r.error is not None:
            records.append({"i": item["i"], "error": f"{item['file']}, frame {item['frame']}: {r.error}"})
            continue
        final = atoms.copy()
        final.positions = r.positions
        final = frozen_copy(final, {"energy": r.energy, "forces": r.forces})
        final.info = {k: v for k, v in atoms.info.items() if v is not True}
        final.info.update(source=item["file"], frame=item["frame"], optimizer=spec["optimizer"],
                          steps=r.steps, converged=r.converged, fmax=float(np.float64(r.fmax)))
        text = io.StringIO()
        ase.io.write(text, final, format="extxyz")
        records.append({"i": item["i"], "xyz": text.getvalue(),
                        "row": [item["file"], item["frame"], len(atoms), r.steps, r.converged,
                                r.energy_start, r.energy, r.fmax, time.perf_counter() - start]})
    return records
