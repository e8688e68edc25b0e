"""TorchScript: script, save, and load in a fresh process that only imports torchani_fast."""
import copy
import os
import subprocess
import sys
import textwrap

import torch

from support import atoms_to_tensors, energy_forces, model_pair, read_molecule


def test_script_save_load_roundtrip(tmp_path):
    ref, fast = model_pair("ANI2x", torch.float32)
    scripted = torch.jit.script(fast)
    species, coords, cell, pbc = atoms_to_tensors(read_molecule("water-0.8nm.xyz"), torch.float32)
    mol, mcoords, _, _ = atoms_to_tensors(read_molecule("2iuz_ligand.xyz"), torch.float32)
    cases = {"periodic": (species, coords, cell, pbc), "molecule": (mol, mcoords, None, None)}
    expected = {}
    for key, (s, x, c, p) in cases.items():
        e_ref, f_ref = energy_forces(ref, s, x, c, p)
        e, f = energy_forces(scripted, s, x, c, p)
        torch.testing.assert_close(e, e_ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(f, f_ref, rtol=0, atol=5e-5)
        expected[key] = (e, f)
    path = tmp_path / "model.pt"
    torch.jit.save(scripted, str(path))
    torch.save({"cases": cases, "expected": expected}, str(tmp_path / "data.pt"))
    # A fresh interpreter: no conftest, no TorchANI import, only the custom ops.
    script = textwrap.dedent(f"""
        import torch, torchani_fast
        data = torch.load({str(tmp_path / "data.pt")!r})
        model = torch.jit.load({str(path)!r})
        for key, (s, x, c, p) in data["cases"].items():
            x = x.clone().requires_grad_(True)
            e = model((s, x), cell=c, pbc=p).energies
            g, = torch.autograd.grad(e.sum(), x)
            e_exp, f_exp = data["expected"][key]
            assert torch.equal(e.detach(), e_exp), (key, e, e_exp)
            torch.testing.assert_close(-g, f_exp, rtol=0, atol=1e-6)
            q = model.energies_qbcs((s, x.detach()), c, p)
        model.set_active_members([0, 2])
        print("OK")
    """)
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout


def test_saved_and_copied_scripted_models_carry_no_cache(tmp_path):
    # The packs and panels a call caches (about 1.5x the weights for a CHNOS
    # molecule) are derived data: torch.jit.save and deepcopy leave them out,
    # and a second script of the same module starts with a cache of its own.
    ref, fast = model_pair("ANI2x", torch.float32)
    scripted = torch.jit.script(fast)
    fresh = tmp_path / "fresh.pt"
    torch.jit.save(scripted, str(fresh))
    s, x, _, _ = atoms_to_tensors(read_molecule("3o99_ligand.xyz"), torch.float32)
    e_ref, f_ref = energy_forces(ref, s, x)
    energy_forces(scripted, s, x)

    def cache(model):
        return model.potentials.nnp.neural_networks._script_packs.tensors()

    assert len(cache(scripted)) > 0
    cached_bytes = sum(t.numel() * t.element_size() for t in cache(scripted))
    assert cached_bytes > 50e6
    used = tmp_path / "used.pt"
    torch.jit.save(scripted, str(used))
    assert used.stat().st_size < fresh.stat().st_size + 1e6
    other = torch.jit.script(fast)
    for model in (torch.jit.load(str(used)), copy.deepcopy(scripted), other):
        assert len(cache(model)) == 0
        e, f = energy_forces(model, s, x)
        torch.testing.assert_close(e, e_ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(f, f_ref, rtol=0, atol=5e-5)
    assert len(cache(other)) > 0 and len(cache(scripted)) > 0


def test_scripted_checked_search_runs_and_grows_its_capacity():
    """A scripted model on a GPU searches with NeighborList.checked (scripted code
    ignores the CPU switch, so it is called directly here): the exact list of the
    model's own search, searched again when it overflows, the capacity grown; a
    bad status gives no list."""
    from torchani_fast.testing import random_model, water_box
    import torchani_fast

    model = torchani_fast.patch(random_model("ANI2x", dtype=torch.float64))
    numbers, coords, cell, pbc = water_box(8)
    elem = model.species_converter(numbers)
    want = model.neighborlist(model.cutoff, elem, coords, cell, pbc)
    scripted = torch.jit.script(model)
    scripted.neighborlist.pairs_per_atom = 2
    good = torch.tensor(False)
    found, ok = scripted.neighborlist.checked(model.cutoff, elem, coords, cell, pbc, good)
    assert ok and scripted.neighborlist.pairs_per_atom > 2
    assert torch.equal(found.indices, want.indices)
    torch.testing.assert_close(found.diff_vectors, want.diff_vectors, rtol=0, atol=0)
    found, ok = scripted.neighborlist.checked(model.cutoff, elem, coords, cell, pbc, ~good)
    assert not ok and found.indices.shape == (2, 0)
