"""Which code path serves a tensor's device: the CPU-only one, or the one for GPUs.

Several places take a CPU-only shortcut (a C++ op that answers with a host value,
host-side grouping) and otherwise run the device path, written to read little
or nothing back to the host. :func:`host_path` is that test, in one place, with
a switch for the test suite: ``DEVICE_PATHS_ON_CPU = True`` makes CPU tensors
take the device path, so that its host reads can be counted without a GPU
(tests/test_host_syncs.py). Scripted code ignores the switch.
"""
import contextlib

import torch
from torch import Tensor

__all__ = ["host_path", "DEVICE_PATHS_ON_CPU", "on_cpu"]

DEVICE_PATHS_ON_CPU = False


@torch.jit.unused
def _forced() -> bool:
    return DEVICE_PATHS_ON_CPU


def host_path(t: Tensor) -> bool:
    """Whether ``t``'s device takes the CPU-only path (its data is in host memory)."""
    if torch.jit.is_scripting():
        return t.device.type == "cpu"
    return t.device.type == "cpu" and not _forced()


@contextlib.contextmanager
def on_cpu():
    """Inside the block, CPU tensors take the code paths written for GPUs (tests)."""
    global DEVICE_PATHS_ON_CPU
    DEVICE_PATHS_ON_CPU = True
    try:
        yield
    finally:
        DEVICE_PATHS_ON_CPU = False
