"""The AEV layout the fused networks read, and what can be fused.

``aev_columns`` lists the columns that can be nonzero for a set of elements
(the zero-block rule, docs/design.md); ``unsupported_reason`` says why a
TorchANI networks module cannot be fused; ``activation_code`` is the networks
op's ``activation`` argument for a fusable one.
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

__all__ = ["aev_columns", "linears", "unsupported_reason", "charge_unsupported_reason", "activation_code", "ACTIVATION_CELU",
           "ACTIVATION_GELU"]

# The networks op's ``activation`` argument (csrc/ensemble/gemm.h, small_gemm::Activation).
ACTIVATION_CELU = 0  # CELU(alpha=0.1): TorchANI's TightCELU (ANI-1x, ANI-2x, ANI-1ccx)
ACTIVATION_GELU = 1  # torch.nn.GELU(approximate="none"): TorchANI's "gelu" (ANI-2xr, ...)


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
    never exactly 0 inside the cutoff (``aev_math::cutoff_tail`` in the kernels),
    and which does not say otherwise (``zero_block_exact = False``: a cutoff for
    which the rule does not hold). The fused module's ``zero_blocks_exact``
    attribute, set from this, can also be turned off by hand."""
    from ..aev import AEVComputer

    return isinstance(aev_computer, AEVComputer) and bool(getattr(aev_computer, "zero_block_exact", True))


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


def _activation_of(act: tp.Optional[torch.nn.Module]) -> tp.Optional[int]:
    """The op's code for an activation module, or None if the op has no such activation."""
    if type(act) is TightCELU:
        return ACTIVATION_CELU
    if type(act) is torch.nn.GELU and act.approximate == "none":
        return ACTIVATION_GELU
    return None


def _describe(act: tp.Optional[torch.nn.Module]) -> str:
    if isinstance(act, torch.nn.GELU):
        return f"GELU(approximate={act.approximate!r})"
    return type(act).__name__


def activation_code(networks: torch.nn.Module) -> int:
    """The ``activation`` argument of the networks op for fusable ``networks``
    (``ACTIVATION_CELU`` or ``ACTIVATION_GELU``; ``unsupported_reason`` is None)."""
    nets = list(networks.members) if isinstance(networks, Ensemble) else [networks]
    code = _activation_of(getattr(next(iter(nets[0].atomics.values())), "activation", None))
    assert code is not None, "activation_code of networks that cannot be fused"
    return code


def charge_unsupported_reason(networks: torch.nn.Module) -> tp.Optional[str]:
    """Why TorchANI's charge networks (``_ANINetworksDiscardFirstScalar``, ANImbis)
    cannot be fused, or None if they can: as ``unsupported_reason``, with two
    outputs per atom (the charge is the second; the first is discarded) and at
    least one hidden layer."""
    from torchani.nn._internal import _ANINetworksDiscardFirstScalar

    if type(networks) is not _ANINetworksDiscardFirstScalar:
        return f"{type(networks).__name__} is not TorchANI's _ANINetworksDiscardFirstScalar"
    if any(len(a.layers) == 0 for a in networks.atomics.values()):
        return "charge networks without a hidden layer"
    return _reason([networks], outputs=2)


def unsupported_reason(networks: torch.nn.Module) -> tp.Optional[str]:
    """Why ``networks`` cannot be fused, or None if it can.

    Fused: an ``Ensemble`` of ``ANINetworks`` or one ``ANINetworks`` whose element
    networks are MLPs (``torch.nn.Linear`` layers, with or without biases) with one
    output, all with the same activation, CELU(alpha=0.1) (``TightCELU``) or exact
    GELU (``torch.nn.GELU()``), and the same layer sizes and biases in every member.
    """
    if isinstance(networks, Ensemble):
        if not all(type(m) is ANINetworks for m in networks.members):
            return "ensemble members are not ANINetworks"
        nets = list(networks.members)
    elif type(networks) is ANINetworks:
        nets = [networks]
    else:
        return f"{type(networks).__name__} is not an Ensemble or ANINetworks"
    return _reason(nets, outputs=1)


def _reason(nets: tp.List[torch.nn.Module], outputs: int) -> tp.Optional[str]:
    shapes = None
    codes = set()
    for net in nets:
        if len(set(id(m) for m in net.atomics.values())) != len(net.atomics):
            return "element networks are aliased"
        net_shapes = []
        for atomic in net.atomics.values():
            act = getattr(atomic, "activation", None)
            code = _activation_of(act)
            if code is None:
                return f"activation {_describe(act)} is not TightCELU or GELU(approximate='none')"
            codes.add(code)
            lins = linears(atomic)
            if any(type(lin) is not torch.nn.Linear for lin in lins):
                return "layers are not torch.nn.Linear"
            if lins[-1].out_features != outputs:
                return "networks have more than one output" if outputs == 1 else \
                    f"networks have {lins[-1].out_features} outputs, not {outputs}"
            net_shapes.append(tuple((tuple(lin.weight.shape), lin.bias is None) for lin in lins))
        if shapes is None:
            shapes = net_shapes
        elif net_shapes != shapes:
            return "members differ in layer sizes or biases"
    if len(codes) != 1:
        return "element networks use different activations"
    in_dims = {s[0][0][1] for s in shapes}
    if len(in_dims) != 1:
        return "element networks read different input sizes"
    return None
