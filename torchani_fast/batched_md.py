"""The short path of :mod:`torchani_fast.apps.batched_md` (the same module)."""
import sys

from .apps import batched_md as _module

sys.modules[__name__] = _module
