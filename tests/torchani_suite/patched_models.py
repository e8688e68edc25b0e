"""pytest plugin: every built-in TorchANI model comes back patched.

Run TorchANI's own tests (from the sdist of the installed version) with
``-p patched_models`` (this folder on ``PYTHONPATH``); ``.ci/torchani_suite``
runs them stock and patched and fails if any test that passes stock fails
patched. The factories in ``torchani.models`` are wrapped at configure time,
before the test modules ``from torchani.models import ANI1x``.
"""
import functools

import torchani.models

import torchani_fast

FACTORIES = ("ANI1x", "ANI1ccx", "ANI2x")


def _patched(factory):
    @functools.wraps(factory)
    def make(*args, **kwargs):
        return torchani_fast.patch(factory(*args, **kwargs))

    make.__torchani_fast_patched__ = True
    return make


def pytest_configure(config):
    for name in FACTORIES:
        factory = getattr(torchani.models, name, None)
        if factory is not None and not getattr(factory, "__torchani_fast_patched__", False):
            setattr(torchani.models, name, _patched(factory))


def pytest_report_header(config):
    return "torchani_fast: built-in models patched (" + ", ".join(FACTORIES) + ")"
