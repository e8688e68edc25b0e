"""A step belongs to the model as it was built: after ``model.double()`` or
``model.to(...)`` it refuses to run (naming both dtypes and devices) instead of
mixing its float32 AEV with float64 networks. Before issue 60 it returned a
float64 energy computed from a float32 AEV.
"""
import pytest
import torch

from torchani_fast.models import ANI2x
from torchani_fast.step import EnergyForcesStep, GrowingStep

pytestmark = pytest.mark.usefixtures("weights")

SPECIES = torch.tensor([[6, 1, 1, 1, 1]])
COORDS = torch.tensor([[[0.0, 0.0, 0.0], [0.63, 0.63, 0.63], [-0.63, -0.63, 0.63],
                        [-0.63, 0.63, -0.63], [0.63, -0.63, -0.63]]])


@pytest.mark.parametrize("kind", [EnergyForcesStep, GrowingStep])
def test_step_refuses_to_run_after_its_model_changed_dtype(kind):
    model = ANI2x()
    step = kind(model, SPECIES, COORDS.clone())
    step(COORDS.clone())
    model.double()
    with pytest.raises(ValueError, match="the model moved to torch.float64 on cpu since this step was "
                                         "built for torch.float32 on cpu: build a new step"):
        step(COORDS.clone())


def test_step_of_a_float64_model_with_float32_coords_keeps_running():
    # (the promotion a model does is not a change of the model)
    model = ANI2x(dtype=torch.float64)
    step = EnergyForcesStep(model, SPECIES, COORDS.clone())
    energies, _ = step(COORDS.clone())
    assert energies.dtype == torch.float64


def test_weights_loaded_in_place_are_not_a_change(tmp_path):
    model = ANI2x(dtype=torch.float64)
    step = EnergyForcesStep(model, SPECIES, COORDS.double())
    state = {k: v * 1.001 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    energies, _ = step(COORDS.double())
    torch.testing.assert_close(energies, model((SPECIES, COORDS.double())).energies, rtol=1e-12, atol=0)
