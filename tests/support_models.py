"""Helpers of the newer models' tests (seeded random TorchANI models, a compact
cluster of every element, tolerances), shared with their subprocess check."""
import copy
import warnings

import torch

import torchani_fast
from torchani_fast.testing import random_model


_STOCK = {}


def stock(name, dtype=torch.float64, model_index=0):
    """TorchANI's model ``name`` with seeded random weights (built once, then copied)."""
    key = (name, model_index)
    if key not in _STOCK:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "ANIr2s is experimental"
            _STOCK[key] = random_model(name, seed=0, model_index=model_index)
    return copy.deepcopy(_STOCK[key]).to(dtype)


def pair(name, dtype=torch.float64, model_index=0):
    ref = stock(name, dtype, model_index)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the once-only fallback warning, tested below
        fast = torchani_fast.patch(copy.deepcopy(ref))
    return ref, fast


def numbers_of(model):
    return [int(z) for z in model.atomic_numbers]


def molecule(model, n=20, seed=0, dtype=torch.float64):
    """A compact cluster holding every element of ``model`` (jittered grid, 1.4 Å)."""
    g = torch.Generator().manual_seed(seed)
    k = 4
    r = torch.arange(k, dtype=torch.float64) * 1.4
    grid = torch.stack(torch.meshgrid(r, r, r, indexing="ij"), -1).view(-1, 3)
    grid = grid - grid.mean(0)
    pos = grid[grid.norm(dim=1).argsort()[:n]]
    pos = pos + 0.12 * torch.randn(pos.shape, generator=g, dtype=torch.float64)
    zs = numbers_of(model)
    z = torch.tensor([zs[i % len(zs)] for i in range(n)])[torch.randperm(n, generator=g)]
    return z.unsqueeze(0), pos.unsqueeze(0).to(dtype)


def assert_close(got, expected, dtype, what="energies"):
    if dtype == torch.float64:
        atol = 1e-10 * max(1.0, float(expected.abs().max())) if what == "energies" else 1e-9
        torch.testing.assert_close(got, expected, rtol=0, atol=atol)
    elif what == "energies":  # a few ulps of the total energy (at least of 1 Ha: random
        # weights give some models, e.g. ANI1xnr with zero self energies, tiny totals)
        ulp = torch.finfo(torch.float32).eps * max(1.0, float(expected.abs().max()))
        assert (got - expected).abs().max() <= 8 * ulp, (got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=0, atol=5e-5)
