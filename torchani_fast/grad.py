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

from . import core, ops
from .aev import AEVComputer
from .core import require_tensors
from .nn import aev_columns, linears as _linears

__all__ = ["energies_forces_and_hessians", "energies_forces_hessians", "hessians_supported"]

_CHUNK_ELEMENTS = 1 << 24  # bound on the network tangents held at once (per layer)


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
    require_tensors(species=species, coordinates=coordinates, cell=cell, pbc=pbc)
    if species.numel() > 0 and not bool((species >= 0).any()):
        return _all_padding(model, species, coordinates, cell, pbc)
    reason = hessians_supported(model)
    if reason is not None:
        return _autograd_loop(model, species, coordinates, cell, pbc)
    x = coordinates.detach().requires_grad_(True)
    with torch.enable_grad():  # also under an outer torch.no_grad()
        energies = model((species, x), cell=cell, pbc=pbc).energies
        (grad,) = torch.autograd.grad(energies.sum(), x)
    with torch.no_grad():
        h = _hessians(model, species, coordinates.detach(), cell, pbc)
    return EnergiesForcesHessians(energies.detach(), -grad, h)


def energies_forces_hessians(model: torch.nn.Module, species: Tensor, coords: Tensor,
                             cell: tp.Optional[Tensor] = None,
                             pbc: tp.Optional[Tensor] = None) -> core.EnergiesForcesHessians:
    """Energies, forces and Hessians (second derivatives) of a batch.

    Arguments are those of :func:`torchani_fast.core.energies_forces`.

    Returns
    -------
    EnergiesForcesHessians
        ``energies`` (M,) in Ha, ``forces`` (M, A, 3) in Ha/Å and ``hessians``
        (M, 3A, 3A) = d²E/dx² in Ha/Å², with rows and columns ordered
        atom-major (x0, y0, z0, x1, ...), all detached.

    Computed by :func:`torchani_fast.grad.energies_forces_and_hessians`:
    patched eager models (CPU or CUDA) get the Hessian in one pass; others
    (scripted, unpatched) one autograd pass per Cartesian component.

    Raises
    ------
    TypeError
        If an input is not a tensor (numpy arrays and lists are not converted).
    NotImplementedError
        If the model's featurizer has no second derivatives (the message of the
        underlying error is kept).
    """
    x, cell, pbc = core.prepare(model, species, coords, cell, pbc)
    try:
        return energies_forces_and_hessians(model, species.to(x.device), x.detach(), cell, pbc)
    except RuntimeError as exc:
        if "second derivative" in str(exc) or "double backward" in str(exc):
            raise NotImplementedError(f"Hessians are not supported yet: {exc}") from exc
        raise


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
    linears = _linears(net)
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
    neighbors, _ = core.neighbors(model, elem, coords, cell, pbc)  # (the model's cutoff is its AEV's)
    pairs, diff = neighbors.indices, neighbors.diff_vectors
    consts = (
        aevc.radial.eta, aevc.radial.shifts, aevc.angular.eta, aevc.angular.zeta,
        aevc.angular.shifts, aevc.angular.sections, float(aevc.radial.cutoff),
        float(aevc.angular.cutoff), aevc.num_species, aevc.cutoff_kind, aevc.cutoff_order,
        aevc.cutoff_eps,
    )
    aev = ops.aev(elem, pairs, diff, *consts).flatten(0, 1)  # (N, F)
    flat = elem.flatten()
    n_total, feats = aev.shape
    cols = _present_columns(aevc, flat)

    # Pass 1: forward and backward of every network (the members of one element
    # stacked), for dE/daev, which the AEV curvature needs, and the per-layer
    # quantities that pass 2 reuses.
    grad_aev = aev.new_zeros(n_total, cols.numel())
    species_work = []
    for s in range(aevc.num_species):
        idx = (flat == s).nonzero().view(-1)
        if idx.numel() == 0:
            continue
        a_s = aev.index_select(0, idx).index_select(1, cols)
        stacks = []
        for st in _stacked_members([mlps[s] for mlps in members], cols):
            grad_s, d1s, curv_w = _network_pass(st, a_s)
            grad_aev.index_add_(0, idx, grad_s)
            stacks.append((st, d1s, curv_w))
        species_work.append((idx, stacks))
    grad_aev /= divisor
    # dE/daev on the present columns is all the AEV curvature reads: the other
    # columns belong to elements absent from every atom's environment.
    grad_full = aev.new_zeros(n_total, feats)
    grad_full.index_copy_(1, cols, grad_aev)

    local_atoms, jac, curv = ops.aev_local_derivatives(
        grad_full.view(mols, atoms, feats), cols, elem, pairs, diff, *consts)
    kmax = local_atoms.shape[1]
    hess = coords.new_zeros(mols * (3 * atoms) ** 2)
    all_atoms = torch.arange(n_total, device=coords.device)
    _scatter(hess, curv.view(n_total, 3 * kmax, 3 * kmax), all_atoms, local_atoms, atoms)

    # Pass 2: the network term, sum_l T_l^T diag(delta_l act''(z_l)) T_l per atom,
    # T_l = dz_l/dx over the atom's slots. Atoms are bucketed by their number of
    # slots so that little of the (3K)^2 work is padding.
    n_slots = (local_atoms >= 0).sum(1)
    scale = 1.0 / divisor
    for idx, stacks in species_work:
        # Tangents of all members of one layer, (atoms, 3K, M * width), bounded
        # to about _CHUNK_ELEMENTS per chunk of atoms.
        widest = max(st.w0.shape[1] for st, _, _ in stacks)
        for bucket, k in _buckets(n_slots.index_select(0, idx)):
            per_atom = 3 * k * max(widest, 3 * k)
            for rows in bucket.split(max(1, _CHUNK_ELEMENTS // per_atom)):
                sel = idx.index_select(0, rows)
                j = jac[:, :k].index_select(0, sel)  # (n, k, 3, C)
                h = coords.new_zeros(sel.numel(), 3 * k, 3 * k)
                for st, d1s, curv_w in stacks:
                    _network_curvature(h, st, j, rows, d1s, curv_w)
                _scatter(hess, h.mul_(scale), sel, local_atoms, atoms)
    return hess.view(mols, 3 * atoms, 3 * atoms)


class _Stack(tp.NamedTuple):
    """Members with the same architecture for one element, stacked."""

    w0: Tensor  # (C, M * w1): the first layer on the present AEV columns, transposed
    weights: tp.List[Tensor]  # layers 2..L, (M, out, in)
    biases: tp.List[tp.Optional[Tensor]]  # layers 1..L, (M, out)
    activation: torch.nn.Module


def _stacked_members(mlps: tp.List[_Mlp], cols: Tensor) -> tp.List[_Stack]:
    groups: tp.Dict[tp.Any, tp.List[_Mlp]] = {}
    for mlp in mlps:
        key = (tuple(tuple(w.shape) for w in mlp.weights),
               tuple(b is None for b in mlp.biases), type(mlp.activation),
               repr(mlp.activation))
        groups.setdefault(key, []).append(mlp)
    out = []
    for group in groups.values():
        w0 = torch.cat([m.weights[0].t().index_select(0, cols) for m in group], dim=1)
        weights = [torch.stack([m.weights[i] for m in group])
                   for i in range(1, len(group[0].weights))]
        biases = [None if group[0].biases[i] is None else torch.stack([m.biases[i] for m in group])
                  for i in range(len(group[0].biases))]
        out.append(_Stack(w0, weights, biases, group[0].activation))
    return out


def _network_pass(st: _Stack, a: Tensor):
    """Forward and backward of the stacked members; ``a`` (n, C) are the present
    AEV columns.

    Returns the gradient w.r.t. those columns summed over the members (n, C),
    and act'(z_l), delta_l act''(z_l) of every hidden layer (M, n, w_l)."""
    members = st.weights[0].shape[0]
    n = a.shape[0]
    z = (a @ st.w0).view(n, members, -1).transpose(0, 1)  # (M, n, w1)
    if st.biases[0] is not None:
        z = z + st.biases[0].unsqueeze(1)
    d1s, d2s = [], []
    for w, b in zip(st.weights, st.biases[1:]):
        act, d1, d2 = _activation_derivs(st.activation, z)
        d1s.append(d1)
        d2s.append(d2)
        z = torch.bmm(act, w.transpose(1, 2))
        if b is not None:
            z = z + b.unsqueeze(1)
    # Backward: delta_l = dE/d(activation l); curvature weights delta_l * act''.
    delta = st.weights[-1].expand(-1, n, -1)  # (M, n, w_last)
    curv_w = [delta] * len(d1s)
    for layer in range(len(d1s) - 1, -1, -1):
        curv_w[layer] = delta * d2s[layer]
        dz = delta * d1s[layer]
        if layer > 0:
            delta = torch.bmm(dz, st.weights[layer - 1])
    grad = dz.transpose(0, 1).reshape(n, -1) @ st.w0.t()  # sum over members of dz_1 W_1
    return grad, d1s, curv_w


def _network_curvature(h: Tensor, st: _Stack, j: Tensor, rows: Tensor, d1s, curv_w) -> None:
    """h (n, 3K, 3K) += sum over members and hidden layers of T^T diag(curv_w) T.

    ``j`` (n, K, 3, C) is d aev / dx over the slots and the present AEV columns;
    ``rows`` picks the atoms' entries in d1s/curv_w."""
    n, k3 = j.shape[0], 3 * j.shape[1]
    members = st.weights[0].shape[0]
    t = (j.reshape(n * k3, -1) @ st.w0).view(n, k3, members, -1)  # T_1
    for layer in range(len(curv_w)):
        cw = curv_w[layer].index_select(1, rows).transpose(0, 1).unsqueeze(1)  # (n, 1, M, w)
        flat_t = t.reshape(n, k3, -1)
        h.baddbmm_((t * cw).reshape(n, k3, -1), flat_t.transpose(1, 2))
        if layer + 1 < len(curv_w):
            d1 = d1s[layer].index_select(1, rows).transpose(0, 1).unsqueeze(1)
            t = torch.einsum("nkmw,mvw->nkmv", t * d1, st.weights[layer])


def _buckets(n_slots: Tensor, waste: float = 0.8) -> tp.List[tp.Tuple[Tensor, int]]:
    """Groups of rows (indices into n_slots) with similar slot counts, and each
    group's largest count."""
    counts, order = torch.sort(n_slots, descending=True)
    counts = counts.tolist()
    out, begin = [], 0
    for i in range(1, len(counts) + 1):
        if i == len(counts) or counts[i] < waste * counts[begin]:
            out.append((order[begin:i], int(counts[begin])))
            begin = i
    return out


def _scatter(hess: Tensor, blocks: Tensor, centers: Tensor, local_atoms: Tensor,
             atoms: int) -> None:
    """hess (M * 3A * 3A) += blocks (n, 3K, 3K) of the atoms ``centers`` over
    their first K slots; unused slots are masked out."""
    k = blocks.shape[1] // 3
    local = local_atoms.index_select(0, centers)[:, :k]
    comp = torch.arange(3, device=hess.device)
    row = ((3 * (local % atoms)).unsqueeze(-1) + comp).reshape(centers.numel(), 3 * k)
    ok = (local >= 0).repeat_interleave(3, dim=1)
    n3 = 3 * atoms
    mol = centers.div(atoms, rounding_mode="floor")
    flat_idx = mol.view(-1, 1, 1) * n3 * n3 + row.unsqueeze(2) * n3 + row.unsqueeze(1)
    mask = ok.unsqueeze(2) & ok.unsqueeze(1)
    hess.index_add_(0, flat_idx[mask], blocks[mask])


def _present_columns(aevc: AEVComputer, flat: Tensor) -> Tensor:
    """AEV columns that can be nonzero: radial blocks of the elements present and
    angular blocks of the pairs of elements present (one host sync)."""
    num_species = aevc.num_species
    present = torch.bincount(flat + 1, minlength=num_species + 1)[1:].gt(0).tolist()
    cols = aev_columns(present, int(aevc.radial.num_feats), int(aevc.angular.num_feats),
                       aevc.triu_index.tolist())
    return torch.tensor(cols, dtype=torch.long, device=flat.device)


def _all_padding(model, species, coordinates, cell, pbc) -> EnergiesForcesHessians:
    """A batch of padding only: energies (0, from the model, which also checks
    the inputs), forces and Hessians 0; autograd has nothing to differentiate."""
    with torch.no_grad():
        energies = model((species, coordinates.detach()), cell=cell, pbc=pbc).energies
    mols, atoms = species.shape
    h = coordinates.new_zeros(mols, 3 * atoms, 3 * atoms)
    return EnergiesForcesHessians(energies, torch.zeros_like(coordinates), h)


def _autograd_loop(model, species, coordinates, cell, pbc) -> EnergiesForcesHessians:
    """torchani.grad's 3N double-backward passes, with cell and pbc."""
    from torchani.grad import energies_and_forces, hessians

    x = coordinates.detach().requires_grad_(True)
    with torch.enable_grad():
        e, f = energies_and_forces(model, species, x, cell, pbc, retain_graph=True, create_graph=True)
        h = hessians(f, x)
    return EnergiesForcesHessians(e.detach(), f.detach(), h)
