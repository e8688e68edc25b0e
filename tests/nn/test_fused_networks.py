"""Fused ensemble networks (torchani_fast.nn) against TorchANI in the same process.

Every expected value comes from TorchANI's own Ensemble/ANINetworks, evaluated
on the same inputs; nothing is hard-coded.
"""
import copy

import pytest
import torch
import torchani

import torchani_fast
from torchani_fast.nn import FusedEnsemble, FusedNetworks, fuse_networks, grouping, unsupported_reason
from support import (BATCHES, assert_energies, assert_forces, energy_forces, model_pair, molecule_lists,
                      padded_batch, reference_model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", ["ANI2x", "ANI1x"])
def test_matches_torchani(name, dtype):
    ref, fast = model_pair(name, dtype)
    nn = fast.potentials["nnp"].neural_networks
    assert isinstance(nn, FusedEnsemble) and nn.radial_sublen > 0  # zero blocks are skipped
    species, coords = padded_batch(BATCHES[name], dtype)

    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert_energies(e, e_ref, dtype)
    assert_forces(f, f_ref, dtype)

    for atomic in (False, True):
        v_ref = ref((species, coords), atomic=atomic, ensemble_values=True).energies
        v = fast((species, coords), atomic=atomic, ensemble_values=True).energies
        assert v.shape == v_ref.shape == ((8, len(species)) + ((species.shape[1],) if atomic else ()))
        assert_energies(v, v_ref, dtype)
    a_ref = ref.atomic_energies((species, coords)).energies
    a = fast.atomic_energies((species, coords)).energies
    assert a.shape == a_ref.shape == species.shape
    assert_energies(a, a_ref, dtype)
    q_ref, q = ref.energies_qbcs((species, coords)), fast.energies_qbcs((species, coords))
    assert_energies(q.energies, q_ref.energies, dtype)
    # (the all-padding row has qbc 0/0 = nan in TorchANI too)
    torch.testing.assert_close(q.qbcs, q_ref.qbcs, rtol=1e-4 if dtype == torch.float32 else 1e-9, atol=1e-7,
                               equal_nan=True)


def test_active_member_subsets():
    ref, fast = model_pair("ANI2x", torch.float64)
    species, coords = padded_batch(BATCHES["small"], torch.float64)
    fast((species, coords))  # fill the cache for all members first
    for subset in ([3], [6, 1], [7, 0, 4], list(range(8))):
        ref.set_active_members(subset)
        fast.set_active_members(subset)
        assert len(fast) == len(ref) == len(subset)
        e_ref, f_ref = energy_forces(ref, species, coords)
        e, f = energy_forces(fast, species, coords)
        assert_energies(e, e_ref, torch.float64)
        assert_forces(f, f_ref, torch.float64)
        for atomic in (False, True):
            v_ref = ref((species, coords), atomic=atomic, ensemble_values=True).energies
            v = fast((species, coords), atomic=atomic, ensemble_values=True).energies
            assert v.shape == v_ref.shape
            assert_energies(v, v_ref, torch.float64)
    with pytest.raises(IndexError):
        fast.set_active_members([8])


def test_single_networks_model_getitem_and_model_index():
    ref, fast = model_pair("ANI2x", torch.float64)
    species, coords = padded_batch(BATCHES["small"], torch.float64)
    single_ref, single_fast = ref[5], fast[5]
    assert isinstance(single_fast.potentials["nnp"].neural_networks, FusedNetworks)
    # Patching a model that already holds a single ANINetworks fuses it too.
    repatched = torchani_fast.patch(copy.deepcopy(ref[5]))
    assert isinstance(repatched.potentials["nnp"].neural_networks, FusedNetworks)
    e_ref, f_ref = energy_forces(single_ref, species, coords)
    for model in (single_fast, repatched):
        e, f = energy_forces(model, species, coords)
        assert_energies(e, e_ref, torch.float64)
        assert_forces(f, f_ref, torch.float64)
        v_ref = single_ref((species, coords), ensemble_values=True).energies
        v = model((species, coords), ensemble_values=True).energies
        assert v.shape == v_ref.shape
        assert_energies(v, v_ref, torch.float64)
        qbcs = model.energies_qbcs((species, coords)).qbcs
        assert torch.equal(qbcs.nan_to_num(), single_ref.energies_qbcs((species, coords)).qbcs.nan_to_num())
    with pytest.raises(ValueError, match="ensemble"):
        single_fast[0]  # like TorchANI: a single network has no members

    ref0 = reference_model("ANI2x", torch.float64)[0]
    fast0 = torchani_fast.patch(copy.deepcopy(ref0))
    assert isinstance(fast0.potentials["nnp"].neural_networks, FusedNetworks)
    assert fast0.state_dict().keys() == ref0.state_dict().keys()
    e_ref, f_ref = energy_forces(ref0, species, coords)
    e, f = energy_forces(fast0, species, coords)
    assert_energies(e, e_ref, torch.float64)
    assert_forces(f, f_ref, torch.float64)


def test_state_dict_dtype_and_cache_refresh():
    ref, fast = model_pair("ANI2x", torch.float32)
    species, coords = padded_batch(BATCHES["small"], torch.float64)
    sd = ref.state_dict()
    assert fast.state_dict().keys() == sd.keys() and len(sd) == 458
    fast((species, coords.float()))  # packs are cached in float32

    # .double() after patching: the float32 packs must not be used.
    fast.double()
    ref64 = copy.deepcopy(ref).double()
    assert_energies(energy_forces(fast, species, coords)[0],
                    energy_forces(ref64, species, coords)[0], torch.float64)

    # load_state_dict after patching (strict, stock keys): new weights are used.
    perturbed = {k: (v * 1.01 if "neural_networks" in k and v.is_floating_point() else v)
                 for k, v in ref64.state_dict().items()}
    fast.load_state_dict(perturbed)
    ref64.load_state_dict(perturbed)
    e_ref, f_ref = energy_forces(ref64, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert_energies(e, e_ref, torch.float64)
    assert_forces(f, f_ref, torch.float64)

    # In-place edits of frozen weights are seen after clear_cache().
    nn = fast.potentials["nnp"].neural_networks
    with torch.no_grad():
        nn.members[2].atomics["H"].layers[0].bias.add_(0.01)
        ref64.potentials["nnp"].neural_networks.members[2].atomics["H"].layers[0].bias.add_(0.01)
    nn.clear_cache()
    assert_energies(fast((species, coords)).energies, ref64((species, coords)).energies, torch.float64)

    # .to() before patching; patching twice keeps the same fused module.
    ref2 = copy.deepcopy(ref).to(torch.float64)
    fast2 = torchani_fast.patch(copy.deepcopy(ref2))
    fused = fast2.potentials["nnp"].neural_networks
    assert torchani_fast.patch(fast2).potentials["nnp"].neural_networks is fused
    assert_energies(fast2((species, coords)).energies, ref2((species, coords)).energies, torch.float64)
    assert fast2.to_infer_model().potentials["nnp"].neural_networks is fused


def _network_grads(model):
    return {n: p.grad for n, p in model.named_parameters() if "neural_networks" in n}


def test_weight_gradients_and_training_step():
    ref, fast = model_pair("ANI1x", torch.float64)
    species, coords = padded_batch(BATCHES["ANI1x"], torch.float64)
    fast((species, coords))  # a cached (frozen) evaluation first
    for model in (ref, fast):
        model.requires_grad_(True)
        model.set_active_members([1, 4, 6])

    def energy_loss(model):
        model.zero_grad()
        loss = (model((species, coords)).energies ** 2).sum()
        loss.backward()
        return loss.detach(), _network_grads(model)

    def force_loss(model):
        # Energy + force loss: double backward through the networks and the AEV op.
        model.zero_grad()
        x = coords.clone().requires_grad_(True)
        e = model((species, x)).energies
        (g,) = torch.autograd.grad(e.sum(), x, create_graph=True)
        loss = (e ** 2).sum() + (g ** 2).sum()
        loss.backward()
        return loss.detach(), _network_grads(model)

    for loss_fn in (energy_loss, force_loss):
        l_ref, g_ref = loss_fn(ref)
        l, g = loss_fn(fast)
        torch.testing.assert_close(l, l_ref, rtol=1e-10, atol=0)
        assert g.keys() == g_ref.keys()
        inactive = 0
        for name, grad_ref in g_ref.items():
            if grad_ref is None:  # members not active get no gradient
                assert g[name] is None, name
                inactive += 1
                continue
            torch.testing.assert_close(g[name], grad_ref, rtol=1e-8, atol=1e-12)
        assert 0 < inactive < len(g_ref)

    # An optimizer step is seen by the next call, with or without grad mode.
    for model in (ref, fast):
        torch.optim.SGD([p for p in model.parameters() if p.grad is not None], lr=1e-3).step()
    with torch.no_grad():
        assert_energies(fast((species, coords)).energies, ref((species, coords)).energies, torch.float64)
    # Frozen again: the cached path is rebuilt from the stepped weights.
    for model in (ref, fast):
        model.requires_grad_(False)
    assert_energies(fast((species, coords)).energies, ref((species, coords)).energies, torch.float64)


def test_frozen_call_after_training_sees_the_new_weights():
    # Cached packs from before training must not survive an optimizer step.
    ref, fast = model_pair("ANI1x", torch.float64)
    species, coords = padded_batch(BATCHES["ANI1x"], torch.float64)
    for model in (ref, fast):
        model((species, coords))  # fills the cache of the frozen model
        model.requires_grad_(True)
        model((species, coords)).energies.sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 1e-3 * p.grad
        model.requires_grad_(False)
    assert_energies(fast((species, coords)).energies, ref((species, coords)).energies, torch.float64)


@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "scripted"])
def test_weights_changed_in_place_are_seen_without_clear_cache(scripted):
    # Packs cached by earlier calls must follow every change of the parameters
    # that does not go through .data: load_state_dict (which a scripted module
    # cannot intercept), an in-place edit under no_grad, new storage. Two
    # compositions: a change to S's weights must reach the S-containing
    # molecule even after a CHNO call has run on its own cached plan.
    ref, fast = model_pair("ANI2x", torch.float64)
    if scripted:
        fast = torch.jit.script(fast)
    mols = {}
    for name in ("2iuz_ligand.xyz", "3o99_ligand.xyz"):
        z, xyz = molecule_lists(name)
        mols[name] = (torch.tensor([z]), torch.tensor([xyz], dtype=torch.float64))

    def check():
        for species, coords in mols.values():
            e_ref, f_ref = energy_forces(ref, species, coords)
            e, f = energy_forces(fast, species, coords)
            assert_energies(e, e_ref, torch.float64)
            assert_forces(f, f_ref, torch.float64)
            assert_energies(fast((species, coords)).energies, ref((species, coords)).energies,
                            torch.float64)  # energies only: the op's own reduction

    def params(model):
        return dict(model.named_parameters())

    check()  # fills the caches
    net = "potentials.nnp.neural_networks.members."
    perturbed = {k: (v * 1.01 if k.startswith(net) else v) for k, v in ref.state_dict().items()}
    ref.load_state_dict(perturbed)
    fast.load_state_dict(perturbed, strict=not scripted)  # a scripted state_dict also lists non-persistent buffers
    check()
    for name, edit in (("3.atomics.H.layers.1.weight", lambda p: p.mul_(0.97)),
                       ("5.atomics.S.layers.0.bias", lambda p: p.add_(0.05)),
                       ("0.atomics.C.final_layer.bias", lambda p: p.sub_(0.01))):
        with torch.no_grad():
            for model in (ref, fast):
                edit(params(model)[net + name])
        check()
    # New storage for a parameter (what torch.nn.utils.vector_to_parameters does).
    for model in (ref, fast):
        p = params(model)[net + "6.atomics.N.layers.0.weight"]
        p.data = p.data * 1.02
    check()
    if not scripted:
        # A new Parameter object assigned to a Linear (an eager module's own
        # list of parameters still holds the old one), seen by the ensemble and
        # by a model[i] view that shares the Linear.
        species, coords = mols["2iuz_ligand.xyz"]
        elem = fast.species_converter(species)
        aev = fast.potentials["nnp"].aev_computer(elem, coords)
        single = fast.potentials["nnp"].neural_networks[4]
        single_ref = ref.potentials["nnp"].neural_networks[4]
        assert_energies(single(elem, aev), single_ref(elem, aev), torch.float64)  # fills its cache
        for model in (ref, fast):
            lin = model.potentials["nnp"].neural_networks.members[4].atomics["H"].layers[0]
            lin.weight = torch.nn.Parameter(lin.weight.detach() * 1.03, requires_grad=False)
        check()
        assert_energies(single(elem, aev), single_ref(elem, aev), torch.float64)


def test_parameter_hook_ignores_other_modules():
    # torchani_fast watches parameter registrations process-wide (for the
    # Linears it packs); any other module, even an unhashable one, is built as usual.
    class Unhashable(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(2))

        def __eq__(self, other):
            return self is other

    assert Unhashable.__hash__ is None
    m = Unhashable()
    m.w = torch.nn.Parameter(torch.ones(2))
    assert float(m.w.sum()) == 2.0


def test_hessian_matches_torchani():
    # Second derivatives through the fused networks (double backward of addmm,
    # baddbmm, CELU and the gathers).
    ref, fast = model_pair("ANI2x", torch.float64)
    assert_hessians_match(ref, fast)


def assert_hessians_match(ref, fast):
    """Autograd Hessians (a backward per coordinate) of CH3Cl, fast against ref."""
    species, coords = padded_batch(["CH3Cl"], torch.float64, empty_row=False)
    hessians = []
    for model in (ref, fast):
        x = coords.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(model((species, x)).energies.sum(), x, create_graph=True)
        rows = [torch.autograd.grad(gi, x, retain_graph=True)[0].flatten() for gi in g.flatten()]
        hessians.append(torch.stack(rows))
    torch.testing.assert_close(hessians[1], hessians[0], rtol=0, atol=1e-9)


@pytest.fixture
def recompute_calls(monkeypatch):
    """Counts the evaluations that took the recomputing (low-memory) path."""
    calls = []
    forward = torchani_fast.nn._Recompute.forward

    def counted(ctx, *args):
        calls.append(1)
        return forward(ctx, *args)

    monkeypatch.setattr(torchani_fast.nn._Recompute, "forward", staticmethod(counted))
    return calls


@pytest.fixture
def native_calls(monkeypatch):
    """Counts the evaluations by the C++ op (ensemble_atomic)."""
    calls = []
    native_plan = torchani_fast.nn._FusedBase._native_plan

    def counted(self, *args):
        out = native_plan(self, *args)
        if out is not None:
            calls.append(1)
        return out

    monkeypatch.setattr(torchani_fast.nn._FusedBase, "_native_plan", counted)
    return calls


def _no_activation_budget(model):
    nets = model.potentials["nnp"].neural_networks
    nets.recompute_min_bytes = 0
    nets.recompute_min_bytes_gpu = 0


@pytest.mark.parametrize("native", [True, False], ids=["cxx", "python"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_recomputing_path_matches_torchani(dtype, device, recompute_calls, native_calls, native):
    # On the CPU the C++ op (ensemble_atomic) evaluates every eager call and keeps
    # no activations (its C++ backward recomputes them when it must); otherwise
    # large inputs take _Recompute, forced here with a zero budget.
    if native and device != "cpu":
        pytest.skip("the C++ networks op is CPU-only")
    ref, fast = model_pair("ANI2x", dtype)
    ref, fast = ref.to(device), fast.to(device)
    fast.potentials["nnp"].neural_networks.native_cpu = native
    species, coords = (t.to(device) for t in padded_batch(BATCHES["ANI2x"], dtype))
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert bool(native_calls) == native
    assert not recompute_calls  # a small input keeps the activations
    assert_energies(e, e_ref, dtype)
    assert_forces(f, f_ref, dtype)
    _no_activation_budget(fast)
    e, f = energy_forces(fast, species, coords)
    assert bool(recompute_calls) == (not native)  # the op needs no budget
    assert_energies(e, e_ref, dtype)
    assert_forces(f, f_ref, dtype)
    # Backward passes whose incoming gradient differs between members (per-member
    # values) or is per atom (atomic energies) take the other branches.
    weights = torch.rand(8, 1, 1, dtype=dtype, device=device)
    per_atom = torch.rand(species.shape, dtype=dtype, device=device)
    for kwargs, reduce in (
        (dict(ensemble_values=True, atomic=True), lambda v: (v * weights).sum()),
        (dict(atomic=True), lambda v: (v * per_atom).sum()),
    ):
        grads = []
        for model in (ref, fast):
            x = coords.clone().requires_grad_(True)
            grads.append(torch.autograd.grad(reduce(model((species, x), **kwargs).energies), x)[0])
        assert_forces(grads[1], grads[0], dtype)
    # Rare-element split (1hz5: 973 atoms, one S) and chunks of atoms.
    torchani_fast.nn.recompute.RECOMPUTE_CHUNK_ATOMS, chunk = 100, torchani_fast.nn.recompute.RECOMPUTE_CHUNK_ATOMS
    try:
        species, coords = (t.to(device) for t in padded_batch(["1hz5.xyz"], dtype, empty_row=False))
        e_ref, f_ref = energy_forces(ref, species, coords)
        e, f = energy_forces(fast, species, coords)
    finally:
        torchani_fast.nn.recompute.RECOMPUTE_CHUNK_ATOMS = chunk
    assert_energies(e, e_ref, dtype)
    assert_forces(f, f_ref, dtype)
    # Without forces (no grad) nothing needs keeping: the usual path.
    calls = len(recompute_calls)
    with torch.no_grad():
        assert_energies(fast((species, coords)).energies, e_ref, dtype)
    assert len(recompute_calls) == calls


@pytest.mark.parametrize("native", [True, False], ids=["cxx", "python"])
def test_recomputing_path_second_derivatives(recompute_calls, native_calls, native):
    # The recomputing backward (C++ in ensemble_atomic, or _Recompute's) is
    # differentiable: Hessians equal TorchANI's, and gradgradcheck on the
    # networks alone (w.r.t. AEVs and the incoming gradient).
    calls = native_calls if native else recompute_calls
    ref, fast = model_pair("ANI2x", torch.float64)
    fast.potentials["nnp"].neural_networks.native_cpu = native
    _no_activation_budget(fast)
    assert_hessians_match(ref, fast)
    assert calls

    ref1, fast1 = model_pair("ANI1x", torch.float64)
    nets = fast1.potentials["nnp"].neural_networks
    nets.native_cpu = native
    _no_activation_budget(fast1)
    nets.set_active_members([1, 6])
    elem = torch.tensor([[1, 0, -1, 3]])  # C H pad O
    torch.manual_seed(0)
    aev = fast1.potentials["nnp"].aev_computer(elem, torch.randn(1, 4, 3, dtype=torch.float64) * 1.5)
    aev = (aev + 0.01 * torch.rand_like(aev)).requires_grad_(True)
    before = len(calls)
    torch.autograd.gradgradcheck(lambda a: nets(elem, a, atomic=True), (aev,))
    assert len(calls) > before


def test_torchscript_save_load(tmp_path):
    ref, fast = model_pair("ANI2x", torch.float32)
    species, coords = padded_batch(BATCHES["small"], torch.float32)
    scripted = torch.jit.script(fast)
    path = tmp_path / "fast.pt"
    torch.jit.save(scripted, str(path))
    loaded = torch.jit.load(str(path))
    for model in (scripted, loaded):
        e_ref, f_ref = energy_forces(ref, species, coords)
        e, f = energy_forces(model, species, coords)
        assert_energies(e, e_ref, torch.float32)
        assert_forces(f, f_ref, torch.float32)
        assert_energies(model.atomic_energies((species, coords)).energies,
                        ref.atomic_energies((species, coords)).energies, torch.float32)
        v = model((species, coords), None, None, 0, True, True).energies
        assert_energies(v, ref((species, coords), atomic=True, ensemble_values=True).energies, torch.float32)
        q, q_ref = model.energies_qbcs((species, coords)), ref.energies_qbcs((species, coords))
        assert_energies(q.energies, q_ref.energies, torch.float32)
        model.set_active_members([2, 5])
        ref.set_active_members([2, 5])
        assert_energies(model((species, coords)).energies, ref((species, coords)).energies, torch.float32)
        model.set_active_members(list(range(8)))
        ref.set_active_members(list(range(8)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_torchscript_cpu_uses_the_op_and_its_gradients_match(dtype):
    # A scripted CPU model evaluates the networks with torchani_fast::ensemble_energies
    # (energies) and ensemble_atomic (per-member values), whose autograd is C++:
    # forces (grad * J), gradients of per-member values and QBCs (recomputed)
    # and a Hessian-vector product (create_graph=True) all match TorchANI's.
    ref, fast = model_pair("ANI2x", dtype)
    scripted = torch.jit.script(fast)
    species, coords = padded_batch(BATCHES["ANI2x"], dtype)
    with torch.profiler.profile() as prof:
        e, f = energy_forces(scripted, species, coords)
        scripted((species, coords), ensemble_values=True)
    names = {evt.name for evt in prof.events()}
    for op in ("torchani_fast::ensemble_energies", "torchani_fast::ensemble_atomic"):
        assert op in names, sorted(n for n in names if "torchani_fast" in n)
    e_ref, f_ref = energy_forces(ref, species, coords)
    assert_energies(e, e_ref, dtype)
    assert_forces(f, f_ref, dtype)
    tol = dict(rtol=0, atol=1e-9) if dtype == torch.float64 else dict(rtol=0, atol=5e-5)
    weights = torch.rand(8, species.shape[0], dtype=dtype, generator=torch.Generator().manual_seed(0))
    grads = []
    for model in (scripted, ref):
        x = coords.clone().requires_grad_(True)
        members = model((species, x), None, None, 0, False, True).energies  # (members, molecules)
        qbcs = model.energies_qbcs((species, x)).qbcs
        grads.append(torch.autograd.grad((members * weights).sum() + qbcs[:-1].sum(), x)[0])
    torch.testing.assert_close(grads[0], grads[1], **tol)
    if dtype == torch.float64:
        tangent = torch.rand(coords.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
        hvps = []
        for model in (scripted, ref):
            x = coords.clone().requires_grad_(True)
            (g,) = torch.autograd.grad(model((species, x)).energies.sum(), x, create_graph=True)
            hvps.append(torch.autograd.grad((g * tangent).sum(), x)[0])
        torch.testing.assert_close(hvps[0], hvps[1], rtol=0, atol=1e-8)


def test_torchscript_weight_gradients():
    ref, fast = model_pair("ANI1x", torch.float64)
    species, coords = padded_batch(BATCHES["ANI1x"], torch.float64)
    scripted = torch.jit.script(fast)
    scripted((species, coords))  # cache filled while frozen
    grads = []
    for model in (ref, scripted):
        for p in model.parameters():  # (ScriptModules have no requires_grad_)
            p.requires_grad_(True)
        model((species, coords)).energies.sum().backward()
        grads.append([p.grad for n, p in model.named_parameters() if "neural_networks" in n])
    for g, g_ref in zip(grads[1], grads[0]):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-12)


def test_inference_mode_first_then_forces():
    ref, fast = model_pair("ANI2x", torch.float32)
    species, coords = padded_batch(BATCHES["small"], torch.float32)
    e_ref, f_ref = energy_forces(ref, species, coords)
    for model in (fast, torch.jit.script(copy.deepcopy(fast))):
        for _ in range(3):  # warm TorchScript's profiling executor with force calls
            energy_forces(model, species, coords)
        model.potentials.nnp.neural_networks.clear_cache()
        with torch.inference_mode():  # packs made here are inference tensors...
            model((species, coords))
        e, f = energy_forces(model, species, coords)  # ...and are rebuilt for autograd
        assert_forces(f, f_ref, torch.float32)


def test_first_layer_cache_is_bounded():
    ref, fast = model_pair("ANI2x", torch.float64)
    nn = fast.potentials["nnp"].neural_networks
    nn.max_first_layer_packs = 4  # (32 by default)
    species, coords = padded_batch(["3hkw_ligand.xyz"], torch.float64, empty_row=False)
    # Many element sets: the geometry of 3hkw relabelled.
    subsets = [[1], [6], [1, 6], [1, 8], [1, 6, 7], [6, 8], [1, 16], [1, 9], [1, 17],
               [6, 7, 8], [1, 6, 7, 8, 16, 9, 17], [8], [1, 6]]
    for subset in subsets:
        s = torch.tensor([subset[k % len(subset)] for k in range(species.shape[1])]).unsqueeze(0)
        assert_energies(fast((s, coords)).energies, ref((s, coords)).energies, torch.float64)
        keys = nn._packs.keys()
        # layer-1 packs (keys >= 0) bounded; hidden layers and panels: at most one per element
        # and one for the hidden layers
        assert sum(k >= 0 for k in keys) <= nn.max_first_layer_packs
        assert sum(k < 0 for k in keys) <= nn.num_species + 1
    assert sum(k >= 0 for k in keys) == nn.max_first_layer_packs  # the bound was reached


def test_rare_element_split():
    # small.xyz (H C N O) with one carbon turned into sulfur: most atoms do not see
    # the S atom, so their layer 1 skips the S columns (a second, narrower group).
    ref, fast = model_pair("ANI2x", torch.float64)
    nn = fast.potentials["nnp"].neural_networks
    nn.split_min_atoms = 32  # (64 by default, which needs larger molecules)
    species, coords = padded_batch(["small.xyz"], torch.float64)
    species[0, (species[0] == 6).nonzero()[0]] = 16
    elem = fast.species_converter(species)
    aev = fast.potentials["nnp"].aev_computer(elem, coords)
    _, group_elem, group_mask, _ = nn._groups(elem.flatten(), aev.flatten(0, 1))
    assert len(group_elem) > len(set(group_elem)) and len(set(group_mask)) > 1
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert_energies(e, e_ref, torch.float64)
    assert_forces(f, f_ref, torch.float64)
    a_ref = ref((species, coords), atomic=True, ensemble_values=True).energies
    assert_energies(fast((species, coords), atomic=True, ensemble_values=True).energies, a_ref, torch.float64)
    scripted = torch.jit.script(fast)
    assert scripted.potentials.nnp.neural_networks.split_min_atoms == 32
    e, f = energy_forces(scripted, species, coords)
    assert_energies(e, e_ref, torch.float64)
    assert_forces(f, f_ref, torch.float64)


def test_rare_element_split_at_the_cutoff_tail():
    # 1hz5 (one S) with hydrogen 15 moved to 5.1 (1 - 7e-5) A from the S, the only
    # S within the cutoff. TorchANI's float32 cutoff is exactly 0 there, its slope
    # is not: a split reading such zeros put the H with the atoms that skip the S
    # columns and dropped a 6e-6 Ha/A force term. torchani_fast's AEV is not 0
    # there, so the H reads the S columns, and the forces are as close to
    # TorchANI's float64 ones as TorchANI's float32 forces are.
    ref, fast = model_pair("ANI2x", torch.float32)
    nn = fast.potentials["nnp"].neural_networks
    species, coords = padded_batch(["1hz5.xyz"], torch.float32, empty_row=False)
    z = species[0]
    s_atom, h = int((z == 16).nonzero()[0]), 15
    assert int(z[h]) == 1
    rc = float(ref.potentials["nnp"].aev_computer.radial.cutoff)
    u = (coords[0, h] - coords[0, s_atom]).double()
    coords[0, h] = (coords[0, s_atom].double() + rc * (1 - 7e-5) * u / u.norm()).float()
    dist = torch.linalg.vector_norm(coords[0] - coords[0, h], dim=1)
    assert int(((z == 16) & (dist < rc)).sum()) == 1 and float(dist[dist > 0].min()) > 0.9
    elem = fast.species_converter(species)
    aev = fast.potentials["nnp"].aev_computer(elem, coords).flatten(0, 1)
    atoms, _, group_mask, group_size = nn._groups(elem.flatten(), aev)
    assert len(set(group_mask)) > 1  # the split happened
    group = int(torch.searchsorted(torch.tensor(group_size).cumsum(0), int((atoms == h).nonzero()), right=True))
    assert group_mask[group] >> 4 & 1  # reads the S columns
    _, f64 = energy_forces(copy.deepcopy(ref).double(), species, coords.double())
    _, f_ref = energy_forces(ref, species, coords)
    _, f = energy_forces(fast, species, coords)
    ref_error = float((f_ref.double() - f64).abs().max())
    assert float((f.double() - f64).abs().max()) <= 2 * ref_error
    # Networks fused with another AEV computer (TorchANI's) do not split; model[i]
    # does as its ensemble does.
    other = fuse_networks(copy.deepcopy(ref.potentials["nnp"].neural_networks), ref.potentials["nnp"].aev_computer)
    assert not other.zero_blocks_exact and len(set(other._groups(elem.flatten(), aev)[2])) == 1
    assert nn.zero_blocks_exact and nn[0].zero_blocks_exact and nn[0].split_min_atoms == nn.split_min_atoms


def test_forces_at_the_angular_cutoff_tail():
    # 2iuz with hydrogen 30 moved to 3.5 (1 - 6e-5) A from oxygen 0, its only O
    # within the angular cutoff: TorchANI's float32 cutoff is exactly 0 there, so
    # its (O, X) angular blocks would be 0 with a nonzero derivative, and the op's
    # backward, which skips zero chunks, would drop a 1.9e-6 Ha/A term. With
    # torchani_fast's AEV the blocks are not 0 and the forces are as close to
    # TorchANI's float64 ones as TorchANI's float32 forces are.
    ref, fast = model_pair("ANI2x", torch.float32)
    species, coords = padded_batch(["2iuz_ligand.xyz"], torch.float32, empty_row=False)
    z = species[0]
    h, o = 30, 0
    assert int(z[h]) == 1 and int(z[o]) == 8
    rc = float(ref.potentials["nnp"].aev_computer.angular.cutoff)
    u = (coords[0, h] - coords[0, o]).double()
    coords[0, h] = (coords[0, o].double() + rc * (1 - 6e-5) * u / u.norm()).float()
    dist = torch.linalg.vector_norm(coords[0] - coords[0, h], dim=1)
    assert int(((z == 8) & (dist < rc)).sum()) == 1 and float(dist[dist > 0].min()) > 0.9
    _, f64 = energy_forces(copy.deepcopy(ref).double(), species, coords.double())
    _, f_ref = energy_forces(ref, species, coords)
    _, f = energy_forces(fast, species, coords)
    assert float((f.double() - f64).abs().max()) <= 2 * float((f_ref.double() - f64).abs().max())


# -- the grouping rule, written in ATen ops: the oracle of torchani_fast::group_atoms --------
def rule_composition_groups(flat, num_species: int) -> tuple:
    counts: list = torch.bincount(flat + 1, minlength=num_species + 1).tolist()
    return rule_groups_from_counts(flat, counts, num_species)


def rule_groups_from_counts(flat, counts: list, num_species: int) -> tuple:
    """``composition_groups`` from the atom counts [padding, element 0, element 1, ...]."""
    n_atoms = 0
    for e in range(num_species):
        n_atoms += counts[e + 1]
    # Atoms ordered by element with one stable sort, padding first.
    atoms = torch.argsort(flat, stable=True).narrow(0, counts[0], n_atoms)
    composition = 0
    for e in range(num_species):
        if counts[e + 1] > 0:
            composition |= 1 << e
    elems: list = []
    masks: list = []
    sizes: list = []
    for e in range(num_species):
        if counts[e + 1] > 0:
            elems.append(e)
            masks.append(composition)
            sizes.append(counts[e + 1])
    return atoms, elems, masks, sizes


def rule_groups(flat, aev, num_species: int, radial_sublen: int, split_min: int) -> tuple:
    """The grouping rule in ATen ops (docs/design.md, the rare-element split): the
    oracle of ``group_atoms`` (it was the CUDA path's until that went through the op)."""
    r = radial_sublen
    if r == 0 or split_min <= 0 or flat.shape[0] < 2 * split_min:
        return rule_composition_groups(flat, num_species)
    elems: list = []
    masks: list = []
    sizes: list = []
    # Which elements each atom sees within the radial cutoff: its nonzero radial blocks.
    seen = aev.narrow(1, 0, num_species * r).view(-1, num_species, r).ne(0).any(2)
    row = torch.where(flat < num_species, flat + 1, num_species + 1)  # padding 0, unknown last
    per_atom = torch.cat([torch.ones_like(seen[:, :1]), seen], 1).long()
    table: list = torch.zeros(
        (num_species + 2, num_species + 1), dtype=torch.long, device=flat.device
    ).index_add_(0, row, per_atom).tolist()  # [element + 1] -> [atoms, atoms seeing 0, 1, ...]
    composition = 0
    for e in range(num_species):
        if table[e + 1][0] > 0:
            composition |= 1 << e
    rare: list = []
    split = False
    for e in range(num_species):
        n = table[e + 1][0]
        bits = 0
        hits = 0
        if n >= 2 * split_min:
            for s in range(num_species):
                c = table[e + 1][1 + s]
                if c > 0 and 4 * c <= n:
                    bits |= 1 << s
                    hits += c
            if n - hits < split_min:
                bits = 0
        split = split or bits != 0
        rare.append(bits)
    if not split:
        counts: list = []
        for e in range(num_species + 1):  # padding (row 0), then the elements
            counts.append(table[e][0])
        return rule_groups_from_counts(flat, counts, num_species)
    rare_rows: list = []
    for e in range(num_species):
        rare_rows.append([(rare[e] >> s) & 1 == 1 for s in range(num_species)])
    rare_table = torch.tensor(rare_rows, dtype=torch.bool, device=flat.device)
    # Padding atoms have zero AEVs, so they see nothing and keep key -2.
    hit = (seen & rare_table.index_select(0, flat.clamp(0, num_species - 1))).any(1)
    key = flat * 2 + hit.long()
    key_counts: list = torch.bincount(key + 2, minlength=2 * num_species + 2).tolist()
    for e in range(num_species):
        for g in range(2):
            n = key_counts[2 + 2 * e + g]
            if n > 0:
                elems.append(e)
                masks.append(composition - (composition & rare[e]) if g == 0 else composition)
                sizes.append(n)
    n_atoms = 0
    for n in sizes:
        n_atoms += n
    # Atoms ordered by (element, group) with one stable sort, padding (key -2) first.
    atoms = torch.argsort(key, stable=True).narrow(0, key_counts[0], n_atoms)
    return atoms, elems, masks, sizes


def assert_same_groups(native, aten, aev):
    """The same groups (elements, column masks, sizes, atoms); the CPU op orders a
    group's atoms by their AEV's zero 16-column chunks, then by index."""
    assert native[1:] == aten[1:]
    chunks = (aev.view(aev.shape[0], -1, 16) != 0).any(2).long()
    pattern = (chunks << torch.arange(chunks.shape[1])).sum(1)
    for a, b in zip(native[0].split(native[3]), aten[0].split(aten[3])):
        assert torch.equal(a, b[torch.argsort(pattern[b], stable=True)])


@pytest.mark.parametrize("split_min_atoms", [32, 64])
def test_grouping_op_matches_the_rule_on_every_path(split_min_atoms):
    # torchani_fast::group_atoms (CPU) groups atoms as the ATen code that other
    # devices run: the same atoms, elements, column masks and sizes (in the same
    # order without the AEV; with it, see assert_same_groups); with rare elements (splits, small.xyz with one S, then a second
    # molecule without it), padding, and without the AEV (composition only).
    _, fast = model_pair("ANI2x", torch.float32)
    nn = fast.potentials["nnp"].neural_networks
    nn.split_min_atoms = split_min_atoms
    species, coords = padded_batch(["small.xyz", "small.xyz", "CH4-5.xyz"], torch.float32)
    species[0, (species[0] == 6).nonzero()[0]] = 16
    species[1, (species[1] == 7).nonzero()[:2, 0]] = 17
    elem = fast.species_converter(species)
    aev = fast.potentials["nnp"].aev_computer(elem, coords).flatten(0, 1)
    flat, S, R, split = elem.flatten(), nn.num_species, nn.radial_sublen, nn._split_min_atoms()
    expected = rule_composition_groups(flat, S)
    for got in (nn._composition_groups(flat), grouping.host_groups(flat, None, S, R, split)):
        assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    expected = rule_groups(flat, aev, S, R, split)
    assert_same_groups(nn._groups(flat, aev), expected, aev)
    # Another device's path (run here on CPU tensors): the (atoms, elements) reduction
    # instead of the AEV, each group's atoms in index order, as the rule has them.
    host = grouping.host_groups(flat, aev, S, R, split)
    assert torch.equal(host[0], expected[0]) and host[1:] == expected[1:]
    assert len(set(nn._groups(flat, aev)[2])) > 1  # a split happened
    # Large enough to consider a split, but none is worth it (small.xyz as shipped).
    plain_species, plain_coords = padded_batch(["small.xyz"], torch.float32)
    plain_elem = fast.species_converter(plain_species)
    plain = fast.potentials["nnp"].aev_computer(plain_elem, plain_coords).flatten(0, 1)
    native = nn._groups(plain_elem.flatten(), plain)
    assert_same_groups(native, rule_groups(plain_elem.flatten(), plain, S, R, split), plain)
    assert len(set(native[2])) == 1
    atoms, info = torch.ops.torchani_fast.group_atoms(elem.flatten().int(), nn.num_species, aev, nn.radial_sublen,
                                                      split_min_atoms)
    assert torch.equal(atoms, nn._groups(elem.flatten(), aev)[0]) and info.shape[1] == 3
    torch.library.opcheck(torch.ops.torchani_fast.group_atoms.default,
                          (elem.flatten(), nn.num_species, aev, nn.radial_sublen, split_min_atoms),
                          test_utils=("test_schema", "test_faketensor"))


def test_unsupported_networks_are_reported():
    # (exact GELU is fused since issue #32: tests/nn/test_fused_networks_gelu.py; its tanh form is not)
    gelu = torchani.nn.ANINetworks.build(["H", "C"], 384, {"H": (16,), "C": (16,)},
                                         activation=torch.nn.GELU(approximate="tanh"), bias=True)
    assert "TightCELU" in unsupported_reason(gelu) and "tanh" in unsupported_reason(gelu)
    with pytest.raises(TypeError, match="cannot fuse"):
        fuse_networks(gelu)
    # The fused module is its own inference form and is not fused twice.
    _, fast = model_pair("ANI1x", torch.float32)
    nn = fast.potentials["nnp"].neural_networks
    assert fuse_networks(nn) is nn and nn.to_infer_model() is nn


def test_unpickling_a_module_from_an_older_version():
    # A FusedEnsemble pickled before `native_cpu` existed still loads and runs.
    ref, fast = model_pair("ANI2x", torch.float64)
    nets = fast.potentials["nnp"].neural_networks
    state = nets.__getstate__()
    del state["native_cpu"], state["_plans_epoch"], state["_packs"], state["_script_packs"]
    # (the caches of torchani_fast before 0.2, as they were pickled)
    state.update(_eager_cache={}, _jit_cache=None, _params_watch=None, _weights_fingerprint=-1)
    old = type(nets).__new__(type(nets))
    old.__setstate__(state)
    fast.potentials["nnp"].neural_networks = old
    species, coords = padded_batch(BATCHES["ANI2x"], torch.float64)
    assert_energies(fast((species, coords)).energies, ref((species, coords)).energies, torch.float64)
    assert old.native_cpu


def test_many_compositions_and_member_sets_with_evictions():
    # The eager CPU path caches the op's arguments per (members, groups); with a
    # small cache, 24 compositions and changing active members evict entries
    # again and again. Every call must still equal TorchANI.
    from torchani_fast.testing import random_molecule

    ref, fast = model_pair("ANI2x", torch.float64)
    nets = fast.potentials["nnp"].neural_networks
    nets.max_first_layer_packs = 3
    member_sets = [[0, 1, 2, 3, 4, 5, 6, 7], [2, 5], [7]]
    compositions = set()
    for trial in range(24):
        species, coords = random_molecule(n=5 + trial % 7, seed=trial)
        compositions.add(frozenset(species.flatten().tolist()))
        members = member_sets[trial % 3]
        if trial % 4 == 0:  # set_active_members clears the caches; otherwise they persist
            for model in (ref, fast):
                model.set_active_members(members)
        e_ref, f_ref = energy_forces(ref, species, coords)
        e, f = energy_forces(fast, species, coords)
        torch.testing.assert_close(e, e_ref, rtol=1e-10, atol=0)
        torch.testing.assert_close(f, f_ref, rtol=0, atol=1e-9)
        assert len(nets._native_plans) <= nets.max_first_layer_packs
    assert len(compositions) > 2 * nets.max_first_layer_packs  # so entries were evicted


def test_gpu_activation_budget_follows_the_device(monkeypatch):
    # Default (-1): an eighth of the device's memory, asked once per device; an
    # explicit value (0 forces the recomputation) wins; 1 GiB where torch does
    # not report the memory. Runs without a GPU (the device query is replaced).
    _, fast = model_pair("ANI2x", torch.float32)
    nets = fast.potentials["nnp"].neural_networks
    asked = []

    class Props:
        total_memory = 16 * 2**30

    def props(index):
        asked.append(index)
        return Props()

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torchani_fast.nn.recompute, "_DEVICE_BUDGETS", {})
    assert nets.recompute_min_bytes_gpu == -1
    for _ in range(2):
        assert nets._gpu_budget(torch.device("cuda", 1)) == 2 * 2**30
    assert asked == [1]
    assert nets._gpu_budget(torch.device("mps")) == 2**30
    nets.recompute_min_bytes_gpu = 0
    assert nets._gpu_budget(torch.device("cuda", 1)) == 0
    nets.recompute_min_bytes_gpu = 5
    assert nets._gpu_budget(torch.device("cuda", 1)) == 5
    # The scripted module compiles with the eager-only budget in it.
    torch.jit.script(fast)
