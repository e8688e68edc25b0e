"""Drop-in compatibility with TorchANI: its exception classes and its dtype promotion.

Every reference is TorchANI itself, in this process, on seeded random weights
of ANI-2x's architecture (torchani_fast.testing.random_ani2x): no files needed.
"""
import copy
import re

import pytest
import torch
import torchani

import torchani_fast
from torchani_fast.testing import random_ani2x, random_molecule
from torchani_fast.validation import DTYPE_RULE, InputError


@pytest.fixture(scope="module")
def pair64():
    ref = random_ani2x(seed=3).double()
    return ref, torchani_fast.patch(copy.deepcopy(ref))


def _bad_inputs():
    z, x = random_molecule(12, seed=1)
    return {
        "species rank": ((z[0], x), {}),
        "coords shape": ((z, x[0]), {}),
        "coords atoms": ((z, x[:, :5]), {}),
        "charge": ((z, x), {"charge": 1}),
    }


@pytest.mark.parametrize("case", sorted(_bad_inputs()))
def test_errors_torchani_asserts_stay_assertion_errors(pair64, case):
    # TorchANI answers these with AssertionError; code written against it
    # (its own tests included) must keep catching them on a patched model.
    ref, fast = pair64
    args, kwargs = _bad_inputs()[case]
    with pytest.raises(AssertionError):
        ref(args, **kwargs)
    with pytest.raises(AssertionError) as info:
        fast(args, **kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, InputError)
    assert str(info.value)  # a message naming the argument, unlike TorchANI's bare assert


def test_errors_torchani_never_asserts_stay_plain_value_errors(pair64):
    _, fast = pair64
    z, x = random_molecule(12, seed=1)
    bad = x.clone()
    bad[0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match="finite") as info:
        fast((z, bad))
    assert not isinstance(info.value, AssertionError)


def test_float32_coords_into_float64_model_promoted_like_torchani(pair64):
    ref, fast = pair64
    z, x = random_molecule(30, seed=2)
    results = []
    for model in (ref, fast):
        c = x.float().requires_grad_(True)
        e = model((z, c)).energies
        (g,) = torch.autograd.grad(e.sum(), c)
        results.append((e, g))
    (e_ref, g_ref), (e, g) = results
    assert e_ref.dtype == e.dtype == torch.float64
    assert g_ref.dtype == g.dtype == torch.float32
    # TorchANI forms its distances in float32 and the patched model its pair
    # vectors: the same float32 geometry up to its rounding.
    torch.testing.assert_close(e, e_ref, rtol=1e-9, atol=0)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    # And it is really a float64 evaluation: far closer to the float64 call on
    # the same (float32-representable) coordinates than a float32 model gets.
    e64 = fast((z, x.float().double())).energies
    assert (e - e64).abs().item() < 1e-6 * e64.abs().item() * 1e-3


def test_float64_coords_into_float32_model_refused():
    ref = random_ani2x(seed=3)
    fast = torchani_fast.patch(copy.deepcopy(ref))
    z, x = random_molecule(12, seed=1)
    with pytest.raises(RuntimeError):
        ref((z, x))  # TorchANI: an opaque matrix-product dtype error
    with pytest.raises(ValueError, match="coords are torch.float64 but the model is torch.float32"):
        fast((z, x))


def test_float32_coords_with_float64_cell_refused_like_torchani(pair64):
    from torchani_fast.testing import water_box

    ref, fast = pair64
    z, x, cell, pbc = water_box(12)
    with pytest.raises(RuntimeError):
        ref((z, x.float()), cell=cell, pbc=pbc)
    with pytest.raises(ValueError, match="cell is torch.float64 but coords are torch.float32"):
        fast((z, x.float()), cell=cell, pbc=pbc)
    e_ref = ref((z, x.float()), cell=cell.float(), pbc=pbc).energies
    e = fast((z, x.float()), cell=cell.float(), pbc=pbc).energies
    assert e.dtype == e_ref.dtype == torch.float64
    torch.testing.assert_close(e, e_ref, rtol=1e-9, atol=0)


def test_dtype_rule_documented_once():
    assert "float32 coords into a float64 model are promoted" in DTYPE_RULE
    assert torchani.__version__  # the TorchANI this ran against, for the log


def test_aev_computer_shape_errors_stay_assertion_errors(pair64):
    # TorchANI's own test_energies.py calls model.aev_computer directly with a bad shape.
    ref, fast = pair64
    species, coords = torch.tensor([[0, 1, 2, 3]]), torch.zeros((1, 3, 3), dtype=torch.float64)
    for model in (ref, fast):
        with pytest.raises(AssertionError):
            model.aev_computer(species, coords)
    with pytest.raises(ValueError, match="coords must have shape"):
        fast.aev_computer(species, coords)


@pytest.mark.parametrize("version", ["2.6.1", "2.3.0", "2.2.3", "2.2", "1.0"])
def test_torchani_older_than_2_7_is_refused_by_name(version):
    with pytest.raises(ImportError, match=rf"TorchANI 2\.7-2\.9 and the legacy 2\.2\.4, found TorchANI {re.escape(version)}"):
        torchani_fast._check_torchani_version(version)


@pytest.mark.parametrize("version", ["2.7.1", "2.8.6", "2.9.0", "2.9.0.dev3+g1234", ""])
def test_supported_torchani_versions_pass(version):
    assert torchani_fast._check_torchani_version(version) is False


def test_legacy_torchani_2_2_4_is_accepted_as_legacy():
    assert torchani_fast._check_torchani_version("2.2.4") is True
