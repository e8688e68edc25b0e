"""Synthetic systems and a random-weight ANI-2x, for tests and benchmarks.

They need no files: the GPU checks run where the pretrained weights and
``../shared/molecules`` are not available, and speed and exactness do not
depend on the weight values.
"""
import math
import typing as tp

import torch
from torch import Tensor

__all__ = ["random_ani2x", "random_model", "random_molecule", "water_box"]


def random_ani2x(seed: int = 0, strategy: str = "pyaev", neighborlist: str = "all_pairs"):
    """TorchANI's ANI-2x architecture (AEV, 8 x 7 networks, self energies), random weights.

    The same ``seed`` gives the same weights whatever the strategy or neighbour
    list; the global RNG is left alone. Parameters do not require grad.
    """
    from torchani.arch import Assembler
    from torchani.models import SYMBOLS_2X

    asm = Assembler(periodic_table_index=True)
    asm.set_symbols(SYMBOLS_2X)
    asm.set_global_cutoff_fn("cosine")
    asm.set_aev_computer(radial="ani2x", angular="ani2x", strategy=strategy)
    asm.set_atomic_networks(ctor="ani2x")
    asm.set_neighborlist(neighborlist)
    asm.set_gsaes_as_self_energies("wb97x-631gd")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = asm.assemble(8)
    model.requires_grad_(False)
    return model


class _NoWeights(dict):
    """What the factory's weight fetch returns under :func:`random_model`: no keys, any key."""

    def __missing__(self, key):
        return torch.zeros(())


def random_model(name: str, seed: int = 0, **kwargs):
    """A ``torchani.models`` factory's exact architecture with seeded random weights.

    ``random_model("ANI2xr", model_index=0, dtype=torch.float64)`` calls
    ``torchani.models.ANI2xr(model_index=0, dtype=torch.float64)`` with the
    weight download replaced by nothing: the networks keep the initialisation
    TorchANI's assembler gives them (drawn under ``seed``; the global RNG is left
    alone) and the self energies, charge normaliser and other constants are
    TorchANI's own. Published weights are not needed (nor read).
    """
    import torchani.models

    factory = getattr(torchani.models, name)
    fetch, load = torchani.models._fetch_state_dict, torch.nn.Module.load_state_dict

    def no_load(module, state_dict, *args, **kw):
        # Inside the factory every load is of fetched weights (or parts of them).
        return torch.nn.modules.module._IncompatibleKeys([], [])

    def no_fetch(*args, **kw):
        return _NoWeights()

    torchani.models._fetch_state_dict = no_fetch
    torch.nn.Module.load_state_dict = no_load
    try:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = factory(**kwargs)
    finally:
        torchani.models._fetch_state_dict = fetch
        torch.nn.Module.load_state_dict = load
    return model


def random_molecule(n: int = 46, seed: int = 0) -> tp.Tuple[Tensor, Tensor]:
    """A compact molecule-like cluster of H C N O S F Cl: (numbers (1, n), coords (1, n, 3) float64).

    Jittered grid points 1.4 Å apart, the ``n`` closest to the centre.
    """
    g = torch.Generator().manual_seed(seed)
    k = math.ceil((3 * n) ** (1 / 3)) + 2
    r = torch.arange(k, dtype=torch.float64) * 1.4
    grid = torch.stack(torch.meshgrid(r, r, r, indexing="ij"), -1).view(-1, 3)
    grid = grid - grid.mean(0)
    pos = grid[grid.norm(dim=1).argsort()[:n]]
    pos = pos + 0.15 * torch.randn(pos.shape, generator=g, dtype=torch.float64)
    numbers = torch.tensor([1, 6, 7, 8, 16, 9, 17])
    weights = torch.tensor([10.0, 6.0, 2.0, 2.0, 0.5, 0.5, 0.5])
    z = numbers[torch.multinomial(weights, n, replacement=True, generator=g)]
    return z.unsqueeze(0), pos.unsqueeze(0)


def water_box(n_molecules: int, seed: int = 0, density: float = 0.0334):
    """A periodic liquid-water-like box: (numbers (1, 3n), coords (1, 3n, 3), cell (3, 3), pbc (3,)).

    Oxygens on a jittered cubic grid at ``density`` molecules/Å³, randomly
    oriented H-O-H of 0.9572 Å and 104.5°; float64.
    """
    g = torch.Generator().manual_seed(seed)
    length = (n_molecules / density) ** (1 / 3)
    k = math.ceil(n_molecules ** (1 / 3))
    r = (torch.arange(k, dtype=torch.float64) + 0.5) * (length / k)
    sites = torch.stack(torch.meshgrid(r, r, r, indexing="ij"), -1).view(-1, 3)[:n_molecules]
    oxygen = sites + 0.2 * torch.randn(sites.shape, generator=g, dtype=torch.float64)
    q = torch.randn(n_molecules, 4, generator=g, dtype=torch.float64)
    q = q / q.norm(dim=1, keepdim=True)
    w, x, y, zq = q.unbind(1)
    rot = torch.stack([
        1 - 2 * (y * y + zq * zq), 2 * (x * y - zq * w), 2 * (x * zq + y * w),
        2 * (x * y + zq * w), 1 - 2 * (x * x + zq * zq), 2 * (y * zq - x * w),
        2 * (x * zq - y * w), 2 * (y * zq + x * w), 1 - 2 * (x * x + y * y),
    ], 1).view(-1, 3, 3)
    half = math.radians(104.5) / 2
    local = 0.9572 * torch.tensor([[math.sin(half), math.cos(half), 0.0],
                                   [-math.sin(half), math.cos(half), 0.0]], dtype=torch.float64)
    hydrogens = oxygen.unsqueeze(1) + torch.einsum("nij,hj->nhi", rot, local)
    coords = torch.cat([oxygen.unsqueeze(1), hydrogens], 1).view(1, -1, 3)
    numbers = torch.tensor([8, 1, 1]).repeat(n_molecules).unsqueeze(0)
    cell = torch.eye(3, dtype=torch.float64) * length
    return numbers, coords, cell, torch.tensor([True, True, True])
