"""python -m torchani_fast.lammps build DIR | save MODEL FILE | env"""
import argparse
import os
import sys


def _env() -> str:
    """Shell lines that let `lmp` and `mpiexec` run the plugin at full speed."""
    from . import environment

    return "\n".join(f"export {k}={v}${{{k}:+:${k}}}" for k, v in environment().items())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchani_fast.lammps",
                                     description="The torchani_fast LAMMPS plugin (docs/lammps.md).")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the plugin into DIR (prints the .so path)")
    b.add_argument("directory")
    b.add_argument("-v", "--verbose", action="store_true")
    s = sub.add_parser("save", help="save a TorchANI model for pair_style torchani_fast")
    s.add_argument("model", help="ANI2x, ANI1x, ANI1ccx, ANI2xr, ANI2dr, ...")
    s.add_argument("path")
    s.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    sub.add_parser("env", help="print the environment lines for lmp/mpiexec (eval them)")
    args = parser.parse_args(argv)
    if args.cmd == "build":
        from . import build

        print(build(args.directory, verbose=args.verbose))
    elif args.cmd == "save":
        import torch

        from ... import models, registry
        from . import save

        try:
            name = registry.by_name(args.model).name
        except ValueError as exc:
            parser.error(f"model: {exc}")
        save(models.MODELS[name](dtype=getattr(torch, args.dtype)), args.path)
        print(args.path)
    else:
        print(_env())
    return 0


if __name__ == "__main__":
    sys.exit(main())
