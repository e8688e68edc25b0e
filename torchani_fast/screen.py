"""The old import path of :mod:`torchani_fast.apps.screen` (the same module, kept for
imports and pickles made by 0.1.0)."""
import sys

from .apps import screen as _module

sys.modules[__name__] = _module
