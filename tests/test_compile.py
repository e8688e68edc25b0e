"""torch.compile(fullgraph=True) and torch.export of a patched model's energies and forces.

Traced, the model branches on no value: the input checks become side-effectful
checking ops that read the values when the graph runs (ops.py, validation.py),
and the fused networks evaluate every element's network on every atom, masked
(nn/fused.py: ``_traced_atomic``). Compiled and exported results are compared
with the eager patched model and with TorchANI (same random weights, same
process), forces through the compiled graph's backward; bad input must raise
the eager error from the compiled graph, without a recompile.
"""
import pytest
import torch

import torchani_fast
from torchani_fast.testing import random_model, random_molecule, water_box

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def models(members=False):
    """(patched, TorchANI) with the same random weights: one network, or ANI-2x's eight."""
    kwargs = {} if members else {"model_index": 0}
    reference = random_model("ANI2x", dtype=torch.float64, **kwargs)
    return torchani_fast.patch(random_model("ANI2x", dtype=torch.float64, **kwargs)), reference


def batch():
    """Two molecules of 12 atoms + 3 padding slots (NaN coordinates), the second reversed."""
    z, x = random_molecule(12)
    z = torch.cat([z, torch.full((1, 3), -1)], 1)
    x = torch.cat([x, torch.full((1, 3, 3), float("nan"), dtype=x.dtype)], 1)
    return torch.cat([z, z.flip(1)]), torch.cat([x, x.flip(1) + 0.1])


def periodic():
    return water_box(5)


def energies_forces(fn, species, coords, *cell_pbc):
    x = coords.clone().requires_grad_(True)
    energies = fn(species, x, *cell_pbc)
    (grad,) = torch.autograd.grad(energies.sum(), x)
    return energies.detach(), -grad


class Energies(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, species, coords, cell=None, pbc=None):
        return self.model((species, coords), cell=cell, pbc=pbc).energies


def assert_same(got, want, reference):
    """Compiled vs eager patched: float64 to 1e-12; vs TorchANI: 1e-10 (as the eager tests)."""
    for g, w, r in zip(got, want, reference):
        real = ~torch.isnan(w)
        assert torch.equal(torch.isnan(g), ~real)
        torch.testing.assert_close(g[real], w[real], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g[real], r[real], rtol=1e-10, atol=1e-10)


@pytest.fixture(scope="module")
def single():
    return models()


@pytest.fixture(scope="module")
def compiled(single):
    return torch.compile(Energies(single[0]), fullgraph=True)


@pytest.mark.parametrize("system", [batch, periodic])
def test_compiled_fullgraph_equals_eager_and_torchani(single, compiled, system):
    model, reference = single
    args = system()
    want = energies_forces(Energies(model), *args)
    got = energies_forces(compiled, *args)
    ref = energies_forces(Energies(reference), *args)
    ref = (ref[0], torch.where(torch.isnan(want[1]), want[1], ref[1]))
    assert_same(got, want, ref)
    # Forces on padding atoms: 0 (their NaN coordinates never reach a pair).
    if args[1].isnan().any():
        assert bool((got[1][args[0] < 0] == 0).all())


def test_compiled_raises_eager_errors_without_recompiling(single, compiled):
    model, _ = single
    species, coords = batch()
    compiled(species, coords)  # compiled for these shapes, dtypes and requires_grad
    torch._dynamo.utils.counters.clear()
    bad = coords.clone()
    bad[1, 4, 2] = float("inf")
    with pytest.raises(ValueError, match=r"coords must be finite, got \[.*inf\] at molecule 1, atom 4"):
        compiled(species, bad)
    lithium = species.clone()
    lithium[0, 2] = 3
    with pytest.raises(ValueError, match="unsupported element Li .* at molecule 0, atom 2"):
        compiled(lithium, coords)
    for value in (-2, 300):
        wrong = species.clone()
        wrong[1, 5] = value
        with pytest.raises(ValueError, match=f"got {value} at molecule 1, atom 5"):
            compiled(wrong, coords)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # no recompile
    z, x, cell, pbc = periodic()
    energies_forces(compiled, z, x, cell, pbc)
    singular = cell.clone()
    singular[2] = singular[0]
    with pytest.raises(ValueError, match="cell is singular"):
        compiled(z, x, singular, pbc)
    with pytest.raises(ValueError, match="cell must be finite"):
        compiled(z, x, cell * float("nan"), pbc)
    tiny = cell / 10  # nm taken for Å
    with pytest.raises(ValueError, match="Is the cell .* in nm or bohr"):
        compiled(z, x, tiny, pbc)


def test_compiled_energies_forces_with_the_gradient_in_the_graph(single):
    model, reference = single
    species, coords = batch()
    want = model.energies_forces(species, coords)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        got = torch.compile(model.energies_forces, fullgraph=True)(species, coords)
    assert_same(got, want, energies_forces(Energies(reference), species, coords))


@pytest.mark.parametrize("members", [False, True], ids=["one network", "8 members"])
@pytest.mark.parametrize("system", [batch, periodic])
def test_exported_equals_eager_and_torchani(members, system):
    model, reference = models(members)
    args = system()
    exported = torch.export.export(Energies(model), args).module()
    want = energies_forces(Energies(model), *args)
    got = energies_forces(exported, *args)
    ref = energies_forces(Energies(reference), *args)
    ref = (ref[0], torch.where(torch.isnan(want[1]), want[1], ref[1]))
    assert_same(got, want, ref)
    bad = args[1].clone()
    bad[0, 1, 0] = float("nan")
    with pytest.raises(ValueError, match="coords must be finite"):
        exported(args[0], bad, *args[2:])
