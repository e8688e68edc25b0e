"""The old import path of :mod:`torchani_fast.apps.openmm`: OpenMM integration
(``MLPotential("ani2x-fast")``, PythonForce and TorchForce modules). Its modules
``force``, ``mlpotential`` and ``torchforce`` are the apps' own (kept for imports,
entry points and pickles made by 0.1.0)."""
from ..apps.openmm import (HARTREE_TO_KJ_PER_MOL, MODELS, ANIComputation, ANITorchForceModule,  # noqa: F401
                           create_python_force, create_torch_force, torch_force_module)
from ..apps.openmm import __all__  # noqa: F401
