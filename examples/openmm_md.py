"""Molecular dynamics in OpenMM with MLPotential("ani2x-fast").

Two runs with a Langevin integrator and a StateDataReporter:

1. the 2iuz ligand (46 atoms, examples/2iuz_ligand.xyz) in vacuum;
2. a periodic box of ANI-2x water with a Monte Carlo barostat (the box
   changes every few steps).

    pip install torchani_fast openmm openmmml
    python examples/openmm_md.py --steps 300

Before trusting any ML potential in OpenMM, compare its forces with a finite
difference of OpenMM's own energy (docs/openmm.md shows the check):
openmm-ml 1.8's own "ani2x" fails it by a factor of 10.
"""
import argparse
import sys
from pathlib import Path

import torch

import openmm
import openmm.app as app
from openmm import unit
from openmmml import MLPotential

from torchani_fast.testing import water_box

HERE = Path(__file__).resolve().parent


def topology_of(symbols, box_nm=None, residue_size=None):
    top = app.Topology()
    chain = top.addChain()
    res = None
    for i, s in enumerate(symbols):
        if res is None or (residue_size and i % residue_size == 0):
            res = top.addResidue("HOH" if residue_size == 3 else "LIG", chain)
        top.addAtom(f"{s}{i}", app.Element.getBySymbol(s), res)
    if box_nm is not None:
        top.setPeriodicBoxVectors([openmm.Vec3(*row) for row in box_nm])
    return top


def run(title, topology, positions_nm, steps, barostat=False, seed=1):
    system = MLPotential("ani2x-fast").createSystem(topology)  # float32 on the CPU (or CUDA)
    if barostat:
        system.addForce(openmm.MonteCarloBarostat(1 * unit.bar, 300 * unit.kelvin, 5))
    integrator = openmm.LangevinMiddleIntegrator(300 * unit.kelvin, 1 / unit.picosecond,
                                                 0.5 * unit.femtosecond)
    integrator.setRandomNumberSeed(seed)
    simulation = app.Simulation(topology, system, integrator, openmm.Platform.getPlatformByName("CPU"))
    simulation.context.setPositions(positions_nm)
    simulation.minimizeEnergy(maxIterations=50)
    simulation.context.setVelocitiesToTemperature(300 * unit.kelvin, seed)
    print(f"# {title}: {topology.getNumAtoms()} atoms, {steps} steps of 0.5 fs")
    simulation.reporters.append(app.StateDataReporter(
        sys.stdout, max(1, steps // 6), step=True, potentialEnergy=True, temperature=True,
        volume=barostat, speed=True, separator="  "))
    simulation.step(steps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--waters", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        MLPotential("ani2x-fast")
    except KeyError:  # run from a source tree: no installed entry points
        from torchani_fast.openmm.mlpotential import register

        register()

    import ase.io

    ligand = ase.io.read(HERE / "2iuz_ligand.xyz")
    run("2iuz ligand in vacuum", topology_of(ligand.get_chemical_symbols()), ligand.positions / 10.0,
        args.steps)

    z, x, cell, _ = water_box(args.waters)
    symbols = ["O" if int(k) == 8 else "H" for k in z[0]]
    box = cell.numpy() / 10.0
    run("periodic water box, barostat", topology_of(symbols, box, residue_size=3), x[0].numpy() / 10.0,
        args.steps, barostat=True)


if __name__ == "__main__":
    main()
