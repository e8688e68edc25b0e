"""The ASE calculator's old import path: the module is :mod:`torchani_fast.apps.ase`
(this name, kept for imports and pickles made by 0.1.0, is the same module)."""
import sys

from .apps import ase as _module

sys.modules[__name__] = _module
