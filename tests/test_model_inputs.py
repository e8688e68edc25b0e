"""Inputs the patched model's entry points must refuse by name, or take whatever
their memory layout.

Before issue 60: a NumPy array into the patched model said "got dtype #int64"
(species) or "'numpy.ndarray' object has no attribute 'dim'" (coords);
coordinates expanded along the molecule axis (stride 0) failed inside a
``view`` in aev.py; ``compute_from_neighbors`` with NaN pair vectors or
distances returned a finite energy, and with a negative atom index (read as an
unused slot of a padded list) returned a number.
"""
import numpy as np
import pytest
import torch
import torchani
from hypothesis import given, settings
from hypothesis import strategies as st
from torchani.neighbors import Neighbors

from torchani_fast.models import ANI2x

pytestmark = pytest.mark.usefixtures("weights")

SPECIES = torch.tensor([[6, 1, 1, 1, 1, 8, 1]])
COORDS = torch.tensor([[[0.0, 0.0, 0.0], [0.63, 0.63, 0.63], [-0.63, -0.63, 0.63], [-0.63, 0.63, -0.63],
                        [0.63, -0.63, -0.63], [2.5, 0.1, 0.0], [3.3, 0.4, 0.3]]], dtype=torch.float64)


@pytest.fixture(scope="module")
def model():
    return ANI2x(dtype=torch.float64)


@pytest.fixture(scope="module")
def scripted(model):
    return torch.jit.script(model)


@pytest.mark.parametrize("which", ["species", "coords", "both"])
def test_numpy_arrays_are_refused_naming_the_argument(model, which):
    species = SPECIES.numpy() if which in ("species", "both") else SPECIES
    coords = COORDS.numpy() if which in ("coords", "both") else COORDS
    name = "species" if which != "coords" else "coords"
    with pytest.raises(TypeError, match=rf"{name} must be a torch.Tensor, got numpy.ndarray; "
                                        rf"convert it with torch.as_tensor\({name}\)"):
        model((species, coords))


def _layout(x: torch.Tensor, kind: str, copies: int) -> torch.Tensor:
    """``x`` (1, A, 3) as a (copies, A, 3) tensor of another memory layout, same values."""
    if kind == "expanded":  # stride 0 along the molecule axis
        return x.expand(copies, -1, -1)
    if kind == "transposed":  # (A, 3) stored column-major
        return x.transpose(1, 2).contiguous().transpose(1, 2).expand(copies, -1, -1)
    if kind == "strided":  # every other element of a larger buffer
        big = torch.zeros(copies, x.shape[1], 6, dtype=x.dtype)
        big[:, :, ::2] = x
        return big[:, :, ::2]
    return x.repeat(copies, 1, 1)


@settings(max_examples=12, deadline=None)
@given(kind=st.sampled_from(["expanded", "transposed", "strided", "contiguous"]),
       copies=st.integers(1, 3), expand_species=st.booleans())
def test_any_memory_layout_gives_the_contiguous_inputs_results(model, kind, copies, expand_species):
    coords = _layout(COORDS, kind, copies).detach().requires_grad_(True)
    species = SPECIES.expand(copies, -1) if expand_species else SPECIES.repeat(copies, 1)
    energies = model((species, coords)).energies
    (grad,) = torch.autograd.grad(energies.sum(), coords)
    plain = COORDS.repeat(copies, 1, 1).requires_grad_(True)
    expected = model((SPECIES.repeat(copies, 1), plain)).energies
    (expected_grad,) = torch.autograd.grad(expected.sum(), plain)
    torch.testing.assert_close(energies, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)


def test_expanded_coords_match_torchani(model):
    ref = torchani.models.ANI2x().double()
    coords = COORDS[0].expand(3, -1, -1)
    torch.testing.assert_close(model((SPECIES.expand(3, -1), coords)).energies,
                               ref((SPECIES.expand(3, -1), coords.contiguous())).energies,
                               rtol=1e-10, atol=0)


def _neighbors(model):
    elem = model.species_converter(SPECIES)
    nb = model.neighborlist(model.cutoff, elem, COORDS)
    return elem, Neighbors(nb.indices.clone(), nb.distances.clone(), nb.diff_vectors.clone())


def _spoil(nb: Neighbors, how: str) -> Neighbors:
    if how == "nan diff":
        nb.diff_vectors[1, 2] = float("nan")
    elif how == "inf distance":
        nb.distances[0] = float("inf")
    elif how == "nan distance":
        nb.distances[2] = float("nan")
    elif how == "negative index":
        nb.indices[1, 0] = -1
    elif how == "index past the atoms":
        nb.indices[0, 3] = SPECIES.numel()
    elif how == "wrong shape":
        return Neighbors(nb.indices, nb.distances[:-1], nb.diff_vectors)
    return nb


SPOILED = {"nan diff": r"neighbors must be finite, got distance .* and diff_vector \[.*nan\] at pair 1",
           "inf distance": r"neighbors must be finite, got distance inf .* at pair 0",
           "nan distance": r"neighbors must be finite, got distance nan .* at pair 2",
           "negative index": r"neighbors.indices must index the 7 flattened atoms \(0 to 6\), got pair 0 = \[\d+, -1\]",
           "index past the atoms": r"neighbors.indices must index the 7 flattened atoms \(0 to 6\), got pair 3 = \[7, \d+\]",
           "wrong shape": r"neighbors.distances and diff_vectors must have shapes"}


@pytest.mark.parametrize("how", SPOILED)
def test_compute_from_neighbors_refuses_a_bad_list(model, scripted, how):
    elem, nb = _neighbors(model)
    bad = _spoil(nb, how)
    with pytest.raises(ValueError, match=SPOILED[how]):
        model.compute_from_neighbors(elem, COORDS, bad)
    with pytest.raises(torch.jit.Error, match=SPOILED[how].split(",")[0].split(r" \(")[0]):
        scripted.compute_from_neighbors(elem, COORDS, bad)


def test_compute_from_neighbors_good_and_empty_lists(model):
    elem, nb = _neighbors(model)
    torch.testing.assert_close(model.compute_from_neighbors(elem, COORDS, nb).energies,
                               model((SPECIES, COORDS)).energies, rtol=1e-12, atol=0)
    far = COORDS * 100.0  # no pair within the cutoff
    empty = model.neighborlist(model.cutoff, elem, far)
    assert empty.indices.shape[1] == 0
    torch.testing.assert_close(model.compute_from_neighbors(elem, far, empty).energies,
                               model((SPECIES, far)).energies, rtol=1e-12, atol=0)


def test_numpy_species_into_the_step_and_energies_forces_name_the_argument(model):
    with pytest.raises(TypeError, match="species must be a torch.Tensor, got numpy.ndarray"):
        model.energies_forces(np.asarray(SPECIES), COORDS)
