"""The applications built on the library: the ASE calculator (:mod:`.ase`), the
command line (:mod:`.cli`), screening on Dask (:mod:`.screen`, :mod:`.screen_files`),
OpenMM (:mod:`.openmm`), and what they share (:mod:`.structures`, :mod:`.output`).

They import the library (``torchani_fast.core``, ``.step``, ``.models``...); the
library imports none of them. The old paths (``torchani_fast.ase``,
``torchani_fast.cli``, ``torchani_fast.screen``, ``torchani_fast.openmm``) are the
same modules.
"""
