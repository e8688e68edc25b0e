"""torchani_fast.testing.random_model: TorchANI's factories with seeded random weights."""
import pytest
import torch

from torchani_fast.testing import random_model


@pytest.mark.parametrize("name", ["ANI2x", "ANI2xr", "ANImbis"])
def test_random_model_is_seeded_and_leaves_the_global_rng_alone(name):
    state = torch.random.get_rng_state()
    a, b, c = random_model(name, seed=3), random_model(name, seed=3), random_model(name, seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert a.state_dict().keys() == c.state_dict().keys()
    weights = [k for k in a.state_dict() if k.endswith("weight")]
    assert weights
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in weights)
    assert not all(torch.equal(a.state_dict()[k], c.state_dict()[k]) for k in weights)


def test_random_model_passes_factory_arguments():
    model = random_model("ANI2xr", model_index=1, dtype=torch.float64)
    assert next(model.parameters()).dtype == torch.float64
    assert not any(p.requires_grad for p in model.parameters())
    species = torch.tensor([[6, 1, 1, 1, 1]])
    coords = torch.tensor([[[0.0, 0.0, 0.0], [0.63, 0.63, 0.63], [-0.63, -0.63, 0.63],
                            [-0.63, 0.63, -0.63], [0.63, -0.63, -0.63]]], dtype=torch.float64)
    assert torch.isfinite(model((species, coords)).energies).all()
