"""Installing as users install: a source checkout that shadows the installed package."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torchani_fast

# Drop an editable install's import hook (setuptools' __editable__ finder), as a
# non-editable install has none, then import from the current directory.
_IMPORT_AS_INSTALLED = (
    "import sys; sys.meta_path[:] = [f for f in sys.meta_path "
    "if 'editable' not in str(getattr(f, '__module__', ''))]; import torchani_fast"
)


def _checkout_without_compiled_ops(root: Path) -> Path:
    shutil.copytree(Path(torchani_fast.__file__).parent, root / "torchani_fast",
                    ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    (root / "setup.py").write_text("")
    (root / "csrc").mkdir()
    return root


def _import_from(cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", _IMPORT_AS_INSTALLED], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_importing_the_source_tree_names_the_cause_and_the_fix(tmp_path):
    root = _checkout_without_compiled_ops(tmp_path / "checkout")
    result = _import_from(root)
    assert result.returncode != 0
    assert f"ImportError: torchani_fast: you are importing the source tree at {root / 'torchani_fast'}" \
        in result.stderr, result.stderr
    assert "Run Python from another directory" in result.stderr
    assert "pip install --no-build-isolation -e ." in result.stderr
    assert "circular import" not in result.stderr


def test_a_copy_that_is_not_a_checkout_reports_the_missing_build(tmp_path):
    # The same files without setup.py/csrc next to them: an installed copy whose
    # _C is missing gets the build instruction instead.
    root = _checkout_without_compiled_ops(tmp_path / "site")
    (root / "setup.py").unlink()
    result = _import_from(root)
    assert result.returncode != 0
    assert "the compiled ops (torchani_fast._C) could not be loaded" in result.stderr, result.stderr
    assert "source tree" not in result.stderr
