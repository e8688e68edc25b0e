"""The tests' fixtures and session set-up (offline TorchANI, 2 threads).

Plain helpers (molecules, reference models, tolerances) are in support.py,
which test modules import; no test module imports this file or another test
module.
"""
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHANI_NO_WARN_EXTENSIONS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import torchani_fast  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # support.py, for tests in subfolders too
from support import DEADLINE_S, ISA_LEVELS, WEIGHTS_HINT, devices, has_weights  # noqa: E402


def pytest_configure(config):
    # A test run started in the background by a script (`cmd &`, no job control)
    # ignores SIGINT, and the CLI processes the tests start would inherit that:
    # the tests that interrupt a run with SIGINT, as Ctrl-C does, need them to
    # start with the default disposition (a handled signal resets at exec).
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def weights():
    """Skip the test unless the published ANI-2x/ANI-1x weights are available."""
    if not (has_weights("ANI2x") and has_weights("ANI1x")):
        pytest.skip(WEIGHTS_HINT)


torch.set_num_threads(2)


@pytest.fixture(params=devices)
def device(request):
    return request.param


# -- instruction-set levels of the CPU kernels ------------------------------------------------


@pytest.fixture(params=ISA_LEVELS[::-1])
def isa(request):
    """Each instruction-set level the kernels have (capped), restored afterwards."""
    before = torchani_fast.cpu_isa()
    if ISA_LEVELS.index(request.param) > ISA_LEVELS.index(before):
        pytest.skip(f"the CPU runs {before}")
    torchani_fast.cpu_isa(request.param)
    yield request.param
    torchani_fast.cpu_isa("avx512")
    assert torchani_fast.cpu_isa() == before


@pytest.fixture
def levels():
    """The levels this CPU runs, lowest first; the cap is restored afterwards."""
    before = torchani_fast.cpu_isa()
    best = torchani_fast.cpu_isa("avx512")
    try:
        yield ISA_LEVELS[: ISA_LEVELS.index(best) + 1]
    finally:
        torchani_fast.cpu_isa(before)



@pytest.fixture
def deadline():
    """Fail the test after DEADLINE_S seconds (SIGALRM) instead of hanging
    (``pytestmark = pytest.mark.usefixtures("deadline")``)."""
    def expired(signum, frame):
        raise TimeoutError(f"test ran past its {DEADLINE_S} s deadline")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(DEADLINE_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)
