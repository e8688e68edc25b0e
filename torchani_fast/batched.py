"""The short path of :mod:`torchani_fast.apps.batched` (the same module)."""
import sys

from .apps import batched as _module

sys.modules[__name__] = _module
