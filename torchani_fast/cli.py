"""The old import path of :mod:`torchani_fast.apps.cli` (the same module, kept for
imports and pickles made by 0.1.0); ``python -m torchani_fast.cli`` runs the command."""
import sys

from .apps import cli as _module

if __name__ == "__main__":
    sys.exit(_module.main())
sys.modules[__name__] = _module
