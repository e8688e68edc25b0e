"""The AEV layout the fused networks read, and what can be fused.

``aev_columns`` lists the columns that can be nonzero for a set of elements
(the zero-block rule, docs/design.md); ``unsupported_reason`` says why a
TorchANI networks module cannot be fused.
"""
import typing as tp

import torch
try:
    from torchani.nn import ANINetworks, Ensemble, TightCELU
except ImportError:  # TorchANI 2.2.4: torchani_fast.legacy checks its networks itself
    class ANINetworks:  # noqa: D101  (stand-ins that match no module)
        pass

    class Ensemble:  # noqa: D101
        pass

    class TightCELU:  # noqa: D101
        pass

__all__ = ["aev_columns", "linears", "unsupported_reason"]


def aev_columns(present: tp.List[bool], r: int, w: int, triu: tp.List[tp.List[int]]) -> tp.List[int]:
    """AEV columns that can be nonzero when only the ``present`` elements occur:
    the radial blocks (width ``r``) of those elements and the angular blocks
    (width ``w``, index ``triu[s1][s2]``) of their pairs, in increasing order."""
    s_num = len(present)
    cols: tp.List[int] = []
    for s in range(s_num):
        if present[s]:
            for c in range(s * r, (s + 1) * r):
                cols.append(c)
    pairs: tp.List[int] = []
    for s1 in range(s_num):
        for s2 in range(s1, s_num):
            if present[s1] and present[s2]:
                pairs.append(triu[s1][s2])
    pairs.sort()
    base = s_num * r
    for p in pairs:
        for c in range(base + p * w, base + (p + 1) * w):
            cols.append(c)
    return cols


# -- construction helpers ---------------------------------------------------------------


def _bitmask(idxs: tp.List[int]) -> int:
    out = 0
    for i in idxs:
        out |= 1 << i
    return out


class _Layout(tp.NamedTuple):
    radial_sublen: int
    angular_sublen: int
    triu: tp.List[tp.List[int]]


def linears(atomic: torch.nn.Module) -> tp.List[torch.nn.Linear]:
    if isinstance(atomic, torch.nn.Sequential):  # TorchANI 2.2.4: Linear, CELU, ..., Linear
        return [m for m in atomic if isinstance(m, torch.nn.Linear)]
    return list(atomic.layers) + [atomic.final_layer]


def _zero_blocks_mean_no_neighbors(aev_computer) -> bool:
    """Whether the AEVs come from torchani_fast's computer, whose cosine cutoff is
    never exactly 0 inside the cutoff (``aev_math::cutoff_tail`` in the kernels)."""
    from ..aev import AEVComputer

    return isinstance(aev_computer, AEVComputer)


def _aev_layout(aev_computer, num_species: int, in_dim: int) -> tp.Tuple[int, int, tp.List[tp.List[int]]]:
    """(R, W, triu) of the AEV the networks read, or (0, 0, []) if it is not known."""
    if aev_computer is None:
        return 0, 0, []
    if isinstance(aev_computer, _Layout):
        return aev_computer.radial_sublen, aev_computer.angular_sublen, aev_computer.triu
    try:
        r = int(aev_computer.radial.num_feats)
        w = int(aev_computer.angular.num_feats)
        triu = aev_computer.triu_index.tolist()
    except AttributeError:
        return 0, 0, []
    pairs = num_species * (num_species + 1) // 2
    if len(triu) != num_species or num_species * r + pairs * w != in_dim:
        return 0, 0, []
    return r, w, triu


def unsupported_reason(networks: torch.nn.Module) -> tp.Optional[str]:
    """Why ``networks`` cannot be fused, or None if it can.

    Fused: an ``Ensemble`` of ``ANINetworks`` or one ``ANINetworks`` whose element
    networks are MLPs with biases, CELU(alpha=0.1) (``TightCELU``) activations, one
    output, and the same layer sizes in every member.
    """
    if isinstance(networks, Ensemble):
        if not all(type(m) is ANINetworks for m in networks.members):
            return "ensemble members are not ANINetworks"
        nets = list(networks.members)
    elif type(networks) is ANINetworks:
        nets = [networks]
    else:
        return f"{type(networks).__name__} is not an Ensemble or ANINetworks"
    shapes = None
    for net in nets:
        if len(set(id(m) for m in net.atomics.values())) != len(net.atomics):
            return "element networks are aliased"
        net_shapes = []
        for atomic in net.atomics.values():
            if not isinstance(getattr(atomic, "activation", None), TightCELU):
                return f"activation {type(getattr(atomic, 'activation', None)).__name__} is not TightCELU"
            lins = linears(atomic)
            if any(type(lin) is not torch.nn.Linear or lin.bias is None for lin in lins):
                return "layers are not Linear with bias"
            if lins[-1].out_features != 1:
                return "networks have more than one output"
            net_shapes.append(tuple(tuple(lin.weight.shape) for lin in lins))
        if shapes is None:
            shapes = net_shapes
        elif net_shapes != shapes:
            return "members differ in layer sizes"
    in_dims = {s[0][1] for s in shapes}
    if len(in_dims) != 1:
        return "element networks read different input sizes"
    return None
