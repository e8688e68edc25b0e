"""Results are bitwise the same for any number of threads, also on a busy machine.

The CPU ops share their loops between the calling thread and torchani_fast's
workers (csrc/common/parallel.h): chunks go to whichever thread is free, so
which thread computes what changes from call to call, and the results must not.
"""
import subprocess
import sys

import pytest
import torch

import torchani_fast
from torchani_fast.grad import energies_forces_and_hessians
from torchani_fast.testing import random_ani2x, random_molecule, water_box

from support import energy_forces, with_threads


@pytest.fixture(scope="module")
def model():
    return torchani_fast.patch(random_ani2x())


def _systems(dtype):
    z, x = random_molecule(46, seed=1)
    batch_z = torch.full((3, 46), -1)
    batch_x = torch.zeros(3, 46, 3, dtype=torch.float64)
    for k, n in enumerate((46, 30, 9)):
        zk, xk = random_molecule(n, seed=k)
        batch_z[k, :n], batch_x[k, :n] = zk[0], xk[0]
    wz, wx, cell, pbc = water_box(64)
    return [(z, x.to(dtype), None, None), (batch_z, batch_x.to(dtype), None, None),
            (wz, wx.to(dtype), cell.to(dtype), pbc)]


def _everything(model, dtype, hessians):
    out = []
    for z, x, cell, pbc in _systems(dtype):
        out += energy_forces(model.to(dtype), z, x, cell, pbc)
        if hessians and cell is None:
            # (the Hessian's network part runs torch.bmm, whose MKL kernels
            # differ with the thread count: only its AEV part is ours)
            out += energies_forces_and_hessians(model, z, x)[:2]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bitwise_equal_for_1_2_and_4_threads(model, dtype):
    runs = [with_threads(n, lambda: _everything(model, dtype, hessians=dtype == torch.float64))
            for n in (1, 2, 4, 2)]
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


def test_bitwise_equal_beside_busy_processes(model):
    # Two busy loops take the cores: the workers are often descheduled, and the
    # caller runs their chunks (csrc/common/parallel.h). Same bits.
    quiet = with_threads(1, lambda: _everything(model, torch.float32, hessians=False))
    loop = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end:\n    pass\n"
    busy = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(2)]
    try:
        for _ in range(3):
            loaded = with_threads(2, lambda: _everything(model, torch.float32, hessians=False))
            assert all(torch.equal(a, b) for a, b in zip(quiet, loaded))
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def test_the_pool_and_openmps_team_give_the_same_bits(model, dtype=torch.float32):
    # The pool (which a late thread turns on: csrc/common/parallel.h) is set here for
    # the whole run, so that its path is tested without depending on a busy machine's
    # timing; the counters show which threads ran the loops.
    from torchani_fast import _C

    def run(pool_regions):
        before = _C.parallel_counts(pool_regions)
        try:
            out = with_threads(2, lambda: _everything(model, dtype, hessians=False))
            after = _C.parallel_counts(-1)
        finally:
            _C.parallel_counts(0)
        return out, [a - b for a, b in zip(after[:2], before[:2])]

    team, team_counts = run(0)
    pooled, pool_counts = run(100000)
    # (mostly OpenMP's team: a team thread that a busy CI machine delays sends
    # a stretch of loops to the pool, so that part is not asserted)
    assert team_counts[0] > 0, team_counts
    assert pool_counts[0] == 0 and pool_counts[1] > 0, pool_counts
    assert all(torch.equal(a, b) for a, b in zip(team, pooled))


def test_a_machine_that_stays_busy_sends_longer_stretches_to_the_pool(model):
    # A late start of 0 ns makes every loop on OpenMP's team late, as other jobs
    # that keep descheduling a team thread do: each stretch on the pool is twice
    # the last (100, 200, 400, ... loops), one team loop between two. After 1000
    # punctual team loops (a late start that is never reached) the next stretch
    # is short again.
    from torchani_fast import _C

    z, x = random_molecule(46, seed=1)
    m, x = model.to(torch.float32), x.float()

    def calls(k):
        for _ in range(k):
            energy_forces(m, z, x, None, None)

    _C.parallel_counts(0, 0)
    try:
        before = _C.parallel_counts(-1)
        with_threads(2, lambda: calls(100))
        after = _C.parallel_counts(-1)
        team, pool = after[0] - before[0], after[1] - before[1]
        stretches = [100 * 2**k for k in range(team)]
        assert team >= 3 and after[3] == stretches[-1], (team, pool, after)
        assert sum(stretches[:-1]) <= pool <= sum(stretches), (team, pool, after)

        _C.parallel_counts(-1, 10**15)
        while _C.parallel_counts(-1)[0] - after[0] < 1000:
            with_threads(2, lambda: calls(5))
        _C.parallel_counts(-1, 0)
        with_threads(2, lambda: calls(1))
        assert _C.parallel_counts(-1)[3] == 100
    finally:
        _C.parallel_counts(0, -1)
