"""The short path of :mod:`torchani_fast.apps.lammps` (the same package):
``torchani_fast.lammps.save(model, path)``, ``python -m torchani_fast.lammps build DIR``."""
import sys

from ..apps import lammps as _package

sys.modules[__name__] = _package
