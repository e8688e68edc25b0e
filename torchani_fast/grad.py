"""Whole Hessians of patched ANI models in one pass instead of 3N autograd passes.

``torchani.grad.energies_forces_and_hessians`` differentiates the forces once per
Cartesian component: 3N double-backward passes through the AEV and through
every network of the ensemble, which is where its time goes. On a patched
model those passes work (the AEV op has analytic second derivatives) and agree
with TorchANI; :func:`energies_forces_and_hessians` here returns the same
Hessian, to round-off, from one evaluation of

    E = sum_i E_i(aev_i)
    H = sum_i J_i^T (d2 E_i / d aev_i2) J_i  +  sum_i sum_f (dE_i / d aev_if) d2 aev_if / dx2

- ``J_i = d aev_i / dx`` and the second sum come from the ``aev_local_derivatives``
  op, restricted to the atoms within the cutoff of atom ``i`` (the only ones its
  AEV depends on);
- the network term is exact for perceptrons with an elementwise activation
  (ANI's CELU): with ``z_l`` the pre-activations, ``T_l = dz_l / dx`` pushed
  forward layer by layer and ``delta_l`` the gradient of ``E_i`` with respect to
  the l-th activation, ``d2 E_i / dx2 = sum_l T_l^T diag(delta_l * act''(z_l)) T_l``
  (the linear layers have no curvature). Only the AEV columns of the elements present are
  multiplied (the others are zero for every atom of the input).

Supported: patched TorchANI ``ANI`` models whose only potential is the neural
network one (ANI-1x, ANI-1ccx, ANI-2x, ``model_index=i``, ``model[i]``, active
member subsets) with TorchANI's ``Ensemble``/``ANINetworks`` of ``AtomicNetwork``
perceptrons (or torchani_fast's fused versions of them). Anything else is
computed with the autograd loop (same results, TorchANI's speed).
"""
import typing as tp

import torch
from torch import Tensor
from torchani.tuples import EnergiesForcesHessians

from . import ops
from .aev import AEVComputer

__all__ = ["energies_forces_and_hessians", "hessians_supported"]


def energies_forces_and_hessians(
    model: torch.nn.Module,
    species: Tensor,
    coordinates: Tensor,
    cell: tp.Optional[Tensor] = None,
    pbc: tp.Optional[Tensor] = None,
) -> EnergiesForcesHessians:
    """Energies, forces and Hessians, like ``torchani.grad.energies_forces_and_hessians``.

    Parameters
    ----------
    model : torchani.arch.ANI
        A model patched with :func:`torchani_fast.patch` (others are accepted and
        go through the autograd loop).
    species : Tensor, int64, (M, A)
        Atomic numbers (or element indices for ``periodic_table_index=False``
        models); -1 marks padding.
    coordinates : Tensor, (M, A, 3)
        Cartesian coordinates in Å, in the model's dtype. Not modified.
    cell, pbc : Tensor, optional
        Lattice vectors (3, 3) and periodicity (3,) of periodic systems; the
        Hessian is taken with respect to the coordinates at a fixed cell.

    Returns
    -------
    EnergiesForcesHessians
        energies (M,) in Ha, forces (M, A, 3) in Ha/Å, hessians (M, 3A, 3A) in
        Ha/Å², all detached. Rows and columns of padding atoms are zero.
    """
    reason = hessians_supported(model)
    if reason is not None:
        return _autograd_loop(model, species, coordinates, cell, pbc)
    x = coordinates.detach().clone().requires_grad_(True)
    energies = model((species, x), cell=cell, pbc=pbc).energies
    (grad,) = torch.autograd.grad(energies.sum(), x)
    with torch.no_grad():
        h = _hessians(model, species, coordinates.detach(), cell, pbc)
    return EnergiesForcesHessians(energies.detach(), -grad, h)


def hessians_supported(model: torch.nn.Module) -> tp.Optional[str]:
    """``None`` if :func:`energies_forces_and_hessians` takes the one-pass path,
    otherwise why the autograd loop is used instead."""
    potentials = getattr(model, "potentials", None)
    if not isinstance(potentials, torch.nn.ModuleDict) or list(potentials.keys()) != ["nnp"]:
        return "the model has potentials other than the neural network one"
    from torchani.potentials import NNPotential

    nnp = potentials["nnp"]
    if type(nnp) is not NNPotential:
        return f"the network potential is a {type(nnp).__name__}, not an NNPotential"
    if not isinstance(nnp.aev_computer, AEVComputer):
        return "the model is not patched by torchani_fast"
    members = _mlp_members(nnp.neural_networks)
    if isinstance(members, str):
        return members
    return None


# -- the networks as plain CELU perceptrons ------------------------------------------


class _Mlp(tp.NamedTuple):
    weights: tp.List[Tensor]
    biases: tp.List[tp.Optional[Tensor]]
    activation: torch.nn.Module


def _elementwise_activations() -> tp.Tuple[type, ...]:
    from torchani.nn import TightCELU

    nn = torch.nn
    return (TightCELU, nn.CELU, nn.ELU, nn.GELU, nn.SiLU, nn.Softplus, nn.Tanh, nn.Sigmoid)


def _mlp(net: torch.nn.Module) -> tp.Union[_Mlp, str]:
    from torchani.nn import AtomicNetwork

    if not isinstance(net, AtomicNetwork):
        return f"an atomic network is a {type(net).__name__}, not an AtomicNetwork"
    act = net.activation
    if not isinstance(act, _elementwise_activations()):
        return f"the activation {type(act).__name__} is not a known elementwise one"
    linears = list(net.layers) + [net.final_layer]
    if not all(type(lin) is torch.nn.Linear for lin in linears):
        return "an atomic network has layers other than torch.nn.Linear"
    if linears[-1].out_features != 1:
        return "the networks output more than one scalar per atom"
    return _Mlp([lin.weight for lin in linears], [lin.bias for lin in linears], act)


def _mlp_members(networks: torch.nn.Module) -> tp.Union[tp.Tuple[tp.List[tp.List[_Mlp]], int], str]:
    """(per evaluated member, per element: its perceptron; the divisor of the mean)."""
    if hasattr(networks, "members") and hasattr(networks, "active_members_idxs"):
        active = list(networks.active_members_idxs)
        # TorchANI evaluates each member once and divides by the number of indices.
        members = [m for j, m in enumerate(networks.members) if j in active]
        divisor = len(active)
    elif hasattr(networks, "atomics"):
        members, divisor = [networks], 1
    else:
        return f"the networks are a {type(networks).__name__}, not an Ensemble or ANINetworks"
    out = []
    for member in members:
        atomics = getattr(member, "atomics", None)
        if not isinstance(atomics, torch.nn.ModuleDict):
            return f"an ensemble member is a {type(member).__name__}, not ANINetworks"
        mlps = []
        for net in atomics.values():
            mlp = _mlp(net)
            if isinstance(mlp, str):
                return mlp
            mlps.append(mlp)
        out.append(mlps)
    if not out or divisor == 0:
        return "no active ensemble member"
    return out, divisor


def _activation_derivs(act: torch.nn.Module, z: Tensor) -> tp.Tuple[Tensor, Tensor, Tensor]:
    """act(z) and its first two derivatives, elementwise, exactly as autograd has them.

    Autograd, not closed forms: torch's CELU backward uses 1 / float32(alpha)
    (``alpha.toFloat()`` in its derivative formula), a 1e-8 relative difference
    from exp(z / alpha) that TorchANI's forces and Hessians carry."""
    with torch.enable_grad():
        x = z.detach().requires_grad_(True)
        y = act(x)
        (d1,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        (d2,) = torch.autograd.grad(d1.sum(), x, allow_unused=True)
    if d2 is None:  # piecewise linear
        d2 = torch.zeros_like(z)
    return y.detach(), d1.detach(), d2


# -- assembly ---------------------------------------------------------------------------


def _hessians(model, species, coords, cell, pbc) -> Tensor:
    nnp = model.potentials["nnp"]
    aevc: AEVComputer = nnp.aev_computer
    members, divisor = _mlp_members(nnp.neural_networks)
    elem = model.species_converter(species, nop=not model.periodic_table_index)
    mols, atoms = elem.shape
    neighbors = aevc.neighborlist(float(aevc.radial.cutoff), elem, coords, cell, pbc)
    pairs, diff = neighbors.indices, neighbors.diff_vectors
    consts = (
        aevc.radial.eta, aevc.radial.shifts, aevc.angular.eta, aevc.angular.zeta,
        aevc.angular.shifts, aevc.angular.sections, float(aevc.radial.cutoff),
        float(aevc.angular.cutoff), aevc.num_species,
    )
    aev = ops.aev(elem, pairs, diff, *consts).flatten(0, 1)  # (N, F)
    flat = elem.flatten()
    n_total, feats = aev.shape
    cols = _present_columns(aevc, flat)

    # Pass 1: forward and backward of every network, for dE/daev (the curvature
    # of the AEV needs it) and the per-layer quantities reused by pass 2.
    grad_aev = aev.new_zeros(n_total, feats)
    groups = []
    for s in range(aevc.num_species):
        idx = (flat == s).nonzero().view(-1)
        if idx.numel() == 0:
            continue
        a_s = aev.index_select(0, idx).index_select(1, cols)
        per_member = []
        g_s = aev.new_zeros(idx.numel(), feats)
        for mlps in members:
            mlp = mlps[s]
            w1 = mlp.weights[0]
            zs, d1s, d2s = [], [], []
            z = a_s @ w1.index_select(1, cols).t()
            if mlp.biases[0] is not None:
                z = z + mlp.biases[0]
            for w, b in zip(mlp.weights[1:], mlp.biases[1:]):
                act, d1, d2 = _activation_derivs(mlp.activation, z)
                zs.append(z)
                d1s.append(d1)
                d2s.append(d2)
                z = act @ w.t()
                if b is not None:
                    z = z + b
            # Backward: delta_l = dE/d(activation l); curvature weights delta_l * act''.
            delta = mlp.weights[-1].expand(idx.numel(), -1)
            curv_w = [None] * len(zs)
            for layer in range(len(zs) - 1, -1, -1):
                curv_w[layer] = delta * d2s[layer]
                dz = delta * d1s[layer]
                delta = dz @ mlp.weights[layer]
            g_s += delta  # dz_0 @ W_1: the gradient w.r.t. the whole AEV row
            per_member.append((mlp, d1s, curv_w))
        grad_aev.index_add_(0, idx, g_s)
        groups.append((idx, per_member))
    grad_aev /= divisor

    local_atoms, jac, curv = ops.aev_local_derivatives(
        grad_aev.view(mols, atoms, feats), elem, pairs, diff, *consts)
    k3 = 3 * local_atoms.shape[1]
    h_local = curv.reshape(n_total, k3, k3)

    # Pass 2: the network term, sum_l T_l^T diag(delta_l act''(z_l)) T_l per atom.
    scale = 1.0 / divisor
    for idx, per_member in groups:
        j_s = jac.index_select(0, idx).index_select(3, cols).reshape(idx.numel(), k3, -1)
        h_s = h_local.new_zeros(idx.numel(), k3, k3)
        for mlp, d1s, curv_w in per_member:
            t = j_s @ mlp.weights[0].index_select(1, cols).t()  # (n, 3K, width_1)
            for layer, w in enumerate(mlp.weights[1:]):
                h_s.baddbmm_(t * curv_w[layer].unsqueeze(1), t.transpose(1, 2))
                if layer + 1 < len(curv_w):
                    t = (t * d1s[layer].unsqueeze(1)) @ w.t()
        h_local.index_add_(0, idx, h_s, alpha=scale)

    # Scatter the per-atom blocks into (M, 3A, 3A); unused slots are masked out.
    slot_ok = local_atoms >= 0
    mol = torch.arange(n_total, device=coords.device).div(atoms, rounding_mode="floor")
    comp = torch.arange(3, device=coords.device)
    row = (3 * (local_atoms % atoms)).unsqueeze(-1) + comp  # (N, K, 3)
    row = row.reshape(n_total, k3)
    ok = slot_ok.repeat_interleave(3, dim=1)  # (N, 3K)
    n3 = 3 * atoms
    flat_idx = (mol.view(-1, 1, 1) * n3 * n3 + row.unsqueeze(2) * n3 + row.unsqueeze(1))
    mask = ok.unsqueeze(2) & ok.unsqueeze(1)
    hess = coords.new_zeros(mols * n3 * n3)
    hess.index_add_(0, flat_idx[mask], h_local[mask])
    return hess.view(mols, n3, n3)


def _present_columns(aevc: AEVComputer, flat: Tensor) -> Tensor:
    """AEV columns that can be nonzero: radial blocks of the elements present and
    angular blocks of the pairs of elements present."""
    num_species = aevc.num_species
    present = torch.zeros(num_species, dtype=torch.bool, device=flat.device)
    present[flat[flat >= 0]] = True
    r = int(aevc.radial.num_feats)
    w = int(aevc.angular.num_feats)
    radial = present.repeat_interleave(r)
    pair_ok = []
    for s1 in range(num_species):
        for s2 in range(s1, num_species):
            pair_ok.append(bool(present[s1]) and bool(present[s2]))
    # torchani's triu_index order: row-major upper triangle, as in the AEV layout.
    angular = torch.tensor(pair_ok, device=flat.device).repeat_interleave(w)
    return torch.cat([radial, angular]).nonzero().view(-1)


def _autograd_loop(model, species, coordinates, cell, pbc) -> EnergiesForcesHessians:
    """torchani.grad's 3N double-backward passes, with cell and pbc."""
    from torchani.grad import energies_and_forces, hessians

    x = coordinates.detach().clone().requires_grad_(True)
    e, f = energies_and_forces(model, species, x, cell, pbc, retain_graph=True, create_graph=True)
    x.requires_grad_(True)
    h = hessians(f, x)
    return EnergiesForcesHessians(e.detach(), f.detach(), h)
