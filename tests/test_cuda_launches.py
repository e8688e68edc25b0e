"""Kernel launches of one energy + forces step on the GPU path, counted on the CPU.

The step runs on CPU tensors down the device paths
(``_device_paths.DEVICE_PATHS_ON_CPU``) with torchani_fast's ops sent to their
emulated CUDA kernels (tests/cuda_emulation, ``torchani_fast_emu``), whose
launches the emulator counts exactly. The ATen work around them (the networks,
the pair vectors, the backward, the fills and scans inside the ops' host code)
is counted with the profiler: each ATen op that computes something and calls no
other such op is one launch (views, allocations and metadata are none;
:func:`aten_launches`). On a GPU cuBLAS may
launch more than one kernel per product, so the ATen part is a lower bound.
Needs the emulator build: TORCHANI_FAST_EMULATE_CUDA=1 (minutes).
"""
import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import torchani_fast
from torchani_fast import _device_paths
from torchani_fast.step import EnergyForcesStep
from torchani_fast.nn import fused
from torchani_fast.testing import random_model, random_molecule
from support_cuda import Emulated, load_emulator

pytestmark = [
    pytest.mark.skipif(os.environ.get("TORCHANI_FAST_EMULATE_CUDA") != "1",
                       reason="set TORCHANI_FAST_EMULATE_CUDA=1 to run the CUDA kernels in the CPU emulator"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

# Innermost ATen ops that launch nothing on a GPU.
NO_KERNEL = {
    "aten::empty", "aten::empty_strided", "aten::view", "aten::_reshape_alias", "aten::as_strided",
    "aten::t", "aten::transpose", "aten::permute", "aten::expand", "aten::unsqueeze",
    "aten::squeeze", "aten::select", "aten::slice", "aten::detach", "aten::alias",
    "aten::_unsafe_view", "aten::resize_", "aten::lift_fresh", "aten::set_", "aten::narrow",
    "aten::reshape", "aten::flatten", "aten::contiguous", "aten::unbind", "aten::split",
    "aten::split_with_sizes", "aten::chunk", "aten::view_as", "aten::expand_as", "aten::result_type",
    "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::numpy_T",
    "aten::to", "aten::requires_grad_", "aten::detach_", "aten::zeros_like", "aten::empty_like",
    "aten::ones_like", "aten::new_empty", "aten::new_empty_strided", "aten::dim",
}

# Launches of one 46-atom energy + forces call of ANI-2x (8 members, float64) as
# measured (emulated kernels, ATen ops): bounds that a change may lower, not raise.
# The target is <= 20 in all. The networks are the ensemble_dense op:
# 3 kernels on a GPU (group, networks, the members' sum), of which the
# emulator's build, which splits the members over blocks only below 2 tiles
# (tests/cuda_emulation/build.py), launches 2 here: the bounds count 3. The warp AEV
# kernels (csrc/aev/cuda/aev_warp.cuh) launch 2 kernels forward and 2 backward; the
# neighbour search is three kernels and the pair vectors one, their backward two.
# The step (13 + 5 = 18) applies the chain rule itself (EnergyForcesStep's
# _energies_forces_by_hand): its ATen ops are the clamp of the padded pairs, the
# zero fills of the AEV's slot counters and of the pair vectors' backward's edge
# counters, the energies' sum over atoms and the self energies' subtraction. The model
# API adds its input checks and species conversion (25), TorchANI's composition
# (zeros, add, the self energies' index, eq, masked_fill, sum, add) and autograd's
# sum, seed, product and negation. Before (the members' mean a division, the
# composition from zeros, autograd in the step) the step was 13 + 19 and the model
# API 13 + 43. With the old kernels (TORCHANI_FAST_CUDA_NETWORKS=aten,
# TORCHANI_FAST_CUDA_AEV=old, TORCHANI_FAST_CUDA_NEIGHBORS=old) the step was 13 + 221
# and the model API 13 + 250, and the networks alone 0 + 202 (counted without clamp
# and index).
STEP_LAUNCHES = (13, 5)
MODEL_API_LAUNCHES = (13, 40)
NETWORKS_LAUNCHES = (3, 4)  # the networks alone (test_networks_launches)


@pytest.fixture(scope="module")
def emu():
    return load_emulator()


device_paths = _device_paths.on_cpu  # (CPU tensors down the GPU code paths)


def launches(emu, fn, *args):
    """(emulated kernel launches, ATen launches, fn's result) of one call."""
    start = emu.launch_count()
    with profile(activities=[ProfilerActivity.CPU]) as prof, Emulated(emu):
        out = fn(*args)
    kernels = emu.launch_count() - start
    return kernels, len(aten_launches(prof.events())), out


def aten_launches(events):
    """The ATen ops among profiler ``events`` that launch a kernel: those that
    compute (not in NO_KERNEL) and have no such op below them (an op whose
    children are only views, allocations or no-op ``to`` computes itself:
    ``clamp``, ``index``; one that calls a computing op launches through it)."""
    computes = lambda e: e.name.startswith("aten::") and e.name not in NO_KERNEL
    counted = set()

    def visit(e):  # whether e or an op below it was counted
        below = False
        for c in e.cpu_children:
            below = visit(c) or below
        if not below and computes(e):
            counted.add(id(e))
            return True
        return below

    roots = [e for e in events if e.cpu_parent is None]
    for e in roots:
        visit(e)
    return [e for e in events if id(e) in counted]


@pytest.fixture(scope="module")
def system():
    model = torchani_fast.patch(random_model("ANI2x", dtype=torch.float64))
    species, coords = random_molecule(46)
    return model, species, coords


def test_step_launches(emu, system):
    model, species, coords = system
    x = coords + 0.01
    with device_paths():
        step = EnergyForcesStep(model, species, coords, check_every=0)  # (CPU kernels: fast)
        kernels, aten, (energies, forces) = launches(emu, step, x)
    print(f"EnergyForcesStep, 46 atoms, ANI-2x: {kernels} emulated kernels + {aten} ATen ops")
    want = model.energies_forces(species, x)
    torch.testing.assert_close(energies, want.energies, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(forces, want.forces, rtol=1e-12, atol=1e-12)
    if os.environ.get("TORCHANI_FAST_CUDA_NEIGHBORS") != "old":
        assert kernels <= STEP_LAUNCHES[0] and aten <= STEP_LAUNCHES[1]


def test_model_api_launches(emu, system):
    model, species, coords = system
    with device_paths():
        model.energies_forces(species, coords)  # (weight packs cached; CPU kernels: fast)
        kernels, aten, got = launches(emu, model.energies_forces, species, coords)
    print(f"model.energies_forces, 46 atoms, ANI-2x: {kernels} emulated kernels + {aten} ATen ops")
    want = model.energies_forces(species, coords)
    torch.testing.assert_close(got.energies, want.energies, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.forces, want.forces, rtol=1e-12, atol=1e-12)
    if os.environ.get("TORCHANI_FAST_CUDA_NEIGHBORS") != "old":
        assert kernels <= MODEL_API_LAUNCHES[0] and aten <= MODEL_API_LAUNCHES[1]


def test_networks_launches(emu, system):
    # The networks alone, energies and their AEV gradient: the ensemble_dense op
    # against the ATen path (fused.CUDA_NETWORKS, TORCHANI_FAST_CUDA_NETWORKS).
    model, species, coords = system
    nnp = model.potentials["nnp"]
    elem = model.species_converter(species)
    aevs = nnp.aev_computer(elem, coords)

    def energies_and_grad():
        x = aevs.detach().requires_grad_(True)
        return torch.autograd.grad(nnp.neural_networks(elem, x).sum(), x)[0]

    counts = {}
    for path in ("fused", "aten"):
        fused.CUDA_NETWORKS = path
        try:
            with device_paths(), nnp.neural_networks.pinned(nnp.neural_networks.fixed_groups(elem)):
                energies_and_grad()  # (packs cached)
                kernels, aten, grad = launches(emu, energies_and_grad)
        finally:
            fused.CUDA_NETWORKS = "fused"
        counts[path] = (kernels, aten, grad)
        print(f"networks ({path}), 46 atoms, ANI-2x, energies + AEV gradient: "
              f"{kernels} emulated kernels + {aten} ATen ops")
    torch.testing.assert_close(counts["fused"][2], counts["aten"][2], rtol=1e-12, atol=1e-12)
    assert counts["fused"][0] <= NETWORKS_LAUNCHES[0] and counts["fused"][1] <= NETWORKS_LAUNCHES[1]
