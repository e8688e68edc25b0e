"""Bad input raises an error naming the argument and the value, eager and scripted,
on the CPU path and on the GPU code paths (forced on CPU tensors)."""
import contextlib

import pytest
import torch

from support import chloromethane, energy_forces, model_pair

# A scripted model re-raises as torch.jit.Error, with the original message inside.
ERRORS = (ValueError, RuntimeError, torch.jit.Error)


@pytest.fixture(scope="module")
def models():
    ref, fast = model_pair("ANI2x", torch.float32)
    return ref, fast, torch.jit.script(fast)


def water(dtype=torch.float32):
    species = torch.tensor([[8, 1, 1]])
    coords = torch.tensor([[[0.0, 0.0, 0.1173], [0.0, 0.7572, -0.4692], [0.0, -0.7572, -0.4692]]],
                          dtype=dtype)
    return species, coords


BAD_INPUTS = {
    "unsupported element": (lambda s, x: (torch.tensor([[26, 1, 1]]), x, {}),
                            r"unsupported element Fe \(atomic number 26\) at molecule 0, atom 0"),
    "not an element": (lambda s, x: (torch.tensor([[8, 1, 300]]), x, {}),
                       r"atomic numbers .* got 300 at molecule 0, atom 2"),
    "species below -1": (lambda s, x: (torch.tensor([[8, 1, -2]]), x, {}),
                         r"species must be >= -1 .* got -2 at molecule 0, atom 2"),
    "float species": (lambda s, x: (s.float(), x, {}), r"species must be an integer tensor"),
    "coords shape": (lambda s, x: (s, x[..., :2], {}), r"coords must have shape .*\[1, 3, 3\].*got \[1, 3, 2\]"),
    "coords mismatch": (lambda s, x: (s, x[:, :2], {}), r"coords must have shape .*got \[1, 2, 3\]"),
    "nan coords": (lambda s, x: (s, x.clone().index_fill_(1, torch.tensor([1]), float("nan")), {}),
                   r"coords must be finite, got \[nan, nan, nan\] at molecule 0, atom 1"),
    "inf coords": (lambda s, x: (s, x.clone().index_fill_(1, torch.tensor([2]), float("inf")), {}),
                   r"coords must be finite.*atom 2"),
    "dtype": (lambda s, x: (s, x.double(), {}), r"coords are torch.float64 but the model is torch.float32"),
    "empty": (lambda s, x: (s[:0], x[:0], {}), r"species is empty"),
    "cell shape": (lambda s, x: (s, x, dict(cell=torch.eye(2), pbc=torch.tensor([True] * 3))),
                   r"cell must have shape \(3, 3\), got \[2, 2\]"),
    "singular cell": (lambda s, x: (s, x, dict(cell=torch.tensor([[5.0, 0, 0], [10.0, 0, 0], [0, 0, 5.0]]),
                                               pbc=torch.tensor([True] * 3))), r"cell is singular"),
    "pbc without cell": (lambda s, x: (s, x, dict(pbc=torch.tensor([True] * 3))), r"pbc was given without a cell"),
    "cell without pbc": (lambda s, x: (s, x, dict(cell=torch.eye(3) * 10)), r"cell was given without pbc"),
    "pbc shape": (lambda s, x: (s, x, dict(cell=torch.eye(3) * 10, pbc=torch.tensor([True, True]))),
                  r"pbc must be a bool tensor of shape \(3,\)"),
    "cell dtype": (lambda s, x: (s, x, dict(cell=torch.eye(3, dtype=torch.float64) * 10,
                                            pbc=torch.tensor([True] * 3))), r"cell is torch.float64 but coords"),
    "nan cell": (lambda s, x: (s, x, dict(cell=torch.eye(3) * float("nan"), pbc=torch.tensor([True] * 3))),
                 r"cell must be finite"),
}


@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "scripted"])
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_named(models, case, scripted):
    _, fast, script = models
    model = script if scripted else fast
    make, pattern = BAD_INPUTS[case]
    species, coords, kw = make(*water())
    with pytest.raises(ERRORS, match=pattern):
        model((species, coords), **kw)


def test_other_entry_points_validate(models):
    _, fast, script = models
    species, coords = water()
    for m in (fast, script):
        with pytest.raises(ERRORS, match="unsupported element Fe"):
            m.atomic_energies((torch.tensor([[26, 1, 1]]), coords))
        with pytest.raises(ERRORS, match="coords must be finite"):
            m.energies_qbcs((species, coords * float("nan")))


def test_chlorine_is_supported_and_neon_is_named(models):
    _, fast, _ = models
    s, x = chloromethane(torch.float32)
    fast((s, x))
    s2 = s.clone()
    s2[0, 1] = 10
    with pytest.raises(ValueError, match=r"unsupported element Ne .*supports H, C, N, O, S, F, Cl"):
        fast((s2, x))


# Edge inputs that must work and equal TorchANI (on the device paths too).
@pytest.mark.parametrize("device_paths", [False, True], ids=["host", "device-paths"])
def test_edge_inputs_equal_torchani(device_paths):
    from torchani_fast import _device_paths

    ref, fast = model_pair("ANI2x", torch.float64)
    cases = []
    cases.append((torch.tensor([[6]]), torch.zeros(1, 1, 3, dtype=torch.float64)))  # a single atom
    s, x = water(torch.float64)
    far = x.clone()
    far[0, 2] += torch.tensor([20.0, 0, 0], dtype=torch.float64)  # beyond every cutoff
    cases.append((s, far))
    # A batch with a row that is all padding, and padding atoms placed on real atoms.
    species = torch.tensor([[8, 1, 1, -1], [-1, -1, -1, -1], [1, 8, -1, 1]])
    coords = torch.cat([torch.cat([x, x[:, :1]], 1), torch.zeros(1, 4, 3, dtype=torch.float64),
                        torch.cat([x[:, [1, 0]], x[:, :1], x[:, 2:]], 1)])
    cases.append((species, coords))
    for s, x in cases:
        e_ref, f_ref = energy_forces(ref, s, x)
        with _device_paths.on_cpu() if device_paths else contextlib.nullcontext():
            e, f = energy_forces(fast, s, x)
        torch.testing.assert_close(e, e_ref, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(f, f_ref, rtol=0, atol=1e-9)


@pytest.mark.parametrize("int_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_one_pass_checks_find_the_first_bad_atom(models, int_dtype):
    # A valid CPU call is checked by two C++ ops (validate/validate_cpu.cpp) instead of
    # the element-wise reductions; they must flag the same first atom.
    _, fast, _ = models
    conv = fast.species_converter.conv_tensor
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        species = torch.randint(-3, 20, (3, 7), generator=g)
        if trial % 2:  # mostly valid: H, C, N, O and padding
            species = torch.tensor([-1, 1, 6, 7, 8])[torch.randint(0, 5, (3, 7), generator=g)]
            species[trial % 3, trial % 7] = [-2, 10, 300, 1][trial % 4]
        coords = torch.rand(3, 7, 3, generator=g, dtype=torch.float64)
        if trial % 3 == 0:
            coords[trial % 3, (trial // 3) % 7, trial % 3] = [float("nan"), float("inf")][trial % 2]
        species = species.to(int_dtype)
        bad = (species < -1) | ((species >= 0) & ~torch.isfinite(coords).all(-1))
        expected = int(bad.flatten().nonzero()[0, 0]) if bad.any() else -1
        assert torch.ops.torchani_fast.first_invalid_atom(species, coords) == expected
        z = species.long()
        out_of_table = (z < -1) | (z >= conv.shape[0] - 1)
        elem = conv[z.clamp(-1, conv.shape[0] - 2)]
        bad = out_of_table | ((elem < 0) & (z >= 0))
        expected = int(bad.flatten().nonzero()[0, 0]) if bad.any() else -1
        converted, first_bad = torch.ops.torchani_fast.convert_species(species, conv)
        assert first_bad == expected
        if expected < 0:
            assert torch.equal(converted, elem)


@pytest.mark.parametrize("device_paths", [False, True], ids=["host", "device-paths"])
def test_padding_may_carry_nan_coordinates(device_paths):
    from torchani_fast import _device_paths

    ref, fast = model_pair("ANI2x", torch.float64)
    species, coords = water(torch.float64)
    species = torch.cat([species, torch.tensor([[-1]])], 1)
    coords = torch.cat([coords, torch.zeros(1, 1, 3, dtype=torch.float64)], 1)
    nan_padding = coords.clone()
    nan_padding[0, 3] = float("nan")
    e_ref, f_ref = energy_forces(ref, species, coords)
    with _device_paths.on_cpu() if device_paths else contextlib.nullcontext():
        e, f = energy_forces(fast, species, nan_padding)
    torch.testing.assert_close(e, e_ref, rtol=1e-10, atol=0)
    torch.testing.assert_close(f[:, :3], f_ref[:, :3], rtol=0, atol=1e-9)


def _valid_cell_reference(cell, pbc):
    # validation.check_cell_pbc's rule, with torch.linalg.det in float64.
    c = cell.double()
    if not bool(torch.isfinite(c).all()):
        return False
    if not bool(pbc.any()):
        return True
    return abs(float(torch.linalg.det(c))) > 1e-8 * float((c ** 2).sum(1).sqrt().prod())


def test_cell_check_op_agrees_with_the_python_rule():
    # The CPU fast path (torchani_fast::valid_cell, cofactor determinant in
    # float64) must accept and refuse the same cells as the worded checks.
    gen = torch.Generator().manual_seed(0)
    cells = [torch.eye(3) * 10, torch.tensor([[5.0, 0, 0], [10.0, 0, 0], [0, 0, 5.0]]),
             torch.eye(3) * float("nan"), torch.eye(3) * float("inf"), torch.zeros(3, 3)]
    for _ in range(40):
        cells.append(torch.randn(3, 3, generator=gen, dtype=torch.float64) * 8)
    for rel in (1e-5, 1e-6, 1e-10, 1e-12):  # a third row nearly in the plane of the first two
        a, b = torch.randn(2, 3, generator=gen, dtype=torch.float64) * 6
        n = torch.linalg.cross(a, b)
        cells.append(torch.stack([a, b, 0.3 * a - 0.7 * b + rel * n / n.norm() * a.norm()]))
    seen = set()
    for cell in cells:
        for dtype in (torch.float32, torch.float64):
            for bits in range(8):
                pbc = torch.tensor([bool(bits & 1), bool(bits & 2), bool(bits & 4)])
                c = cell.to(dtype)
                expected = _valid_cell_reference(c, pbc)
                assert torch.ops.torchani_fast.valid_cell(c, pbc) == expected, (c, pbc)
                seen.add(expected)
    assert seen == {True, False}


def test_near_singular_cell_is_refused(models):
    _, fast, script = models
    species, coords = water()
    cell = torch.tensor([[6.0, 0, 0], [0, 6.0, 0], [3.0, 3.0, 1e-8]])
    for m in (fast, script):
        with pytest.raises(ERRORS, match="cell is singular"):
            m((species, coords), cell=cell, pbc=torch.tensor([True] * 3))


def test_cxx_op_messages_carry_their_numbers():
    """The C++ ops format the offending values into their messages.

    A toolchain that links libstdc++ statically into the extension (the GPU
    machines' /opt/gcc) once gave "cutoff must be positive, got " with the
    number missing on the CPU, and a segfault formatting a double in the CUDA
    neighbour search: setup.py keeps that copy private (--exclude-libs).
    """
    from torchani_fast import ops

    species = torch.zeros(1, 2, dtype=torch.long)
    coords = torch.tensor([[[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]], dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"cutoff must be positive, got -1\.5$"):
        ops.neighbor_pairs(species, coords, None, None, -1.5, False)
    bad = coords.clone()
    bad[0, 1, 2] = float("nan")
    with pytest.raises(RuntimeError, match=r"coords must be finite, got \(1, 0, nan\) for atom 1 "
                                           r"of molecule 0"):
        ops.neighbor_pairs(species, bad, None, None, 5.2, False)
    cell = torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [4.0, 6.0, 0.0]], dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"cell is singular \(determinant 0\), got cell"):
        ops.neighbor_pairs(species, coords, cell, torch.ones(3, dtype=torch.bool), 5.2, False)


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_named_on_the_device_path(models, case):
    """The GPU path folds the value checks into one status, read with the pair count;
    a bad input still raises the CPU's message (the argument, the value, the atom)."""
    from torchani_fast import _device_paths

    _, fast, _ = models
    make, pattern = BAD_INPUTS[case]
    species, coords, kw = make(*water())
    with _device_paths.on_cpu(), pytest.raises(ERRORS, match=pattern):
        fast((species, coords), **kw)
    if "dtype" not in case:  # (energies_forces converts coords and cell to the model's dtype)
        with _device_paths.on_cpu(), pytest.raises(ERRORS, match=pattern):
            fast.energies_forces(species, coords, kw.get("cell"), kw.get("pbc"))


def test_other_entry_points_validate_on_the_device_path(models):
    from torchani_fast import _device_paths

    _, fast, _ = models
    species, coords = water()
    with _device_paths.on_cpu():
        with pytest.raises(ERRORS, match="unsupported element Fe"):
            fast.atomic_energies((torch.tensor([[26, 1, 1]]), coords))
        with pytest.raises(ERRORS, match="coords must be finite"):
            fast.energies_qbcs((species, coords * float("nan")))


def test_element_indices_are_checked_on_the_device_path():
    """periodic_table_index=False: element indices outside [-1, elements) are named
    on the device path too, and valid ones give the CPU path's energies."""
    from torchani_fast import _device_paths

    _, fast = model_pair("ANI2x", torch.float64)
    fast.periodic_table_index = False
    species, coords = water(torch.float64)
    elem = torch.tensor([[3, 0, 0]])
    want = fast((elem, coords)).energies
    for bad, pattern in ((torch.tensor([[3, 0, 7]]), r"element indices in \[-1, 7\).*got 7 at molecule 0, atom 2"),
                         (torch.tensor([[3, -2, 0]]), r"species must be >= -1 .*got -2 at molecule 0, atom 1")):
        with _device_paths.on_cpu(), pytest.raises(ValueError, match=pattern):
            fast((bad, coords))
    with _device_paths.on_cpu():
        got = fast((elem, coords)).energies
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_cell_status_flags_every_cell_the_worded_checks_refuse():
    """``_cell_status`` (folded into the device path's one read) is False only for cells
    that ``check_periodic_work`` passes; True for all it refuses (nm cells included)."""
    from torchani_fast.validation import _cell_status, check_periodic_work

    gen = torch.Generator().manual_seed(0)
    cells = [torch.eye(3) * 10, torch.eye(3) * 1.0, torch.eye(3) * 0.3, torch.diag(torch.tensor([10.0, 10.0, 0.0])),
             torch.tensor([[5.0, 0, 0], [10.0, 0, 0], [0, 0, 5.0]]), torch.eye(3) * float("nan"),
             torch.eye(3) * float("inf"), torch.zeros(3, 3)]
    for _ in range(30):
        cells.append(torch.randn(3, 3, generator=gen, dtype=torch.float64) * 8)
    # Too many images, few neighbours (one atom): only the image count refuses it.
    cells.append(torch.diag(torch.tensor([0.05, 0.05, 1000.0])))
    seen = set()
    for cell, atoms in [(c, 40) for c in cells] + [(cells[-1], 1)]:
        species = torch.ones(1, atoms, dtype=torch.long)
        coords = torch.rand(1, atoms, 3, generator=gen, dtype=torch.float64) * 10
        for bits in range(8):
            pbc = torch.tensor([bool(bits & 1), bool(bits & 2), bool(bits & 4)])
            c = cell.double()
            try:
                check_periodic_work(species, coords, c, pbc, 5.2)
                refused = False
            except ValueError:
                refused = True
            status = int(_cell_status(species, c, pbc, 5.2, 1e5, 3000.0))
            if refused:
                assert status != 0, (c, pbc)
            seen.add((refused, status != 0))
    assert (True, True) in seen and (False, False) in seen
