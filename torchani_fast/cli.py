"""The old import path of :mod:`torchani_fast.apps.cli` (the same module, kept for
imports and pickles made by 0.1.0)."""
import sys

from .apps import cli as _module

sys.modules[__name__] = _module
