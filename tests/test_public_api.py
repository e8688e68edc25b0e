"""What ``import torchani_fast`` alone makes reachable: every public name a user
reaches by attribute. Before issue 60 ``torchani_fast.models.ANI2x()`` after a
plain ``import torchani_fast`` raised AttributeError (only
``from torchani_fast.models import ANI2x`` worked).
"""
import subprocess
import sys


def test_public_names_reachable_after_a_plain_import():
    # A fresh interpreter: in this one another test may already have imported the submodules.
    code = ("import torchani_fast\n"
            "missing = [n for n in torchani_fast.__all__ if not hasattr(torchani_fast, n)]\n"
            "m = torchani_fast.models\n"
            "missing += [n for n in m.__all__ if not hasattr(m, n)]\n"
            "assert callable(m.ANI2x) and 'ANI2x' in m.MODELS\n"
            "print('missing', missing)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "missing []"
