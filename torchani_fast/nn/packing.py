"""Packed copies of the networks' weights, and how a fused module sees that they changed.

TorchANI's member modules stay the only source of truth; the fused module
derives packed copies from them and caches them (docs/design.md, "Caches").
"""
import typing as tp
import weakref

import torch
from torch import Tensor

# The networks op's weight arguments: (columns, first, packs, panels, layers).
OpArgs = tp.Tuple[tp.List[Tensor], tp.List[Tensor], tp.List[Tensor], tp.List[Tensor], tp.List[int]]


def _panel_pair(w: Tensor) -> tp.List[Tensor]:
    """W (k, d_in, d_out) as 16-column panels: [(k, d_out/16, d_in, 16), W^T's (k, d_in/16, d_out, 16)]."""
    k, d_in, d_out = w.shape[0], w.shape[1], w.shape[2]
    with torch.no_grad():
        fwd = w.reshape(k, d_in, d_out // 16, 16).permute(0, 2, 1, 3).contiguous()
        bwd = w.reshape(k, d_in // 16, 16, d_out).permute(0, 1, 3, 2).contiguous()
    return [fwd, bwd]


class _NativePlan(tp.NamedTuple):
    """What ``ensemble_mlp`` needs besides the AEV and atoms, for one set of
    members and groups (``_FusedBase._native_plan``)."""

    op_args: OpArgs  # (columns, first, packs, panels, layers), as in the op's schema
    epoch: int  # the PackCache's epoch when they were built (valid while it stays)


# Each Linear whose parameters a fused module reads -> those modules. A
# Parameter assigned to such a Linear (``lin.weight = Parameter(w)``) is a new
# tensor the modules' parameter list does not hold: the hook below flags them,
# and their next call re-reads the parameters and drops the cache. (Scripted
# modules are not covered: assignment to them bypasses nn.Module.)
# Keyed by id(): the hook sees every module built in the process, and hashing
# one could fail (a subclass defining __eq__ only is unhashable).
_PACKED_BY: tp.Dict[int, tp.Tuple["weakref.ref", "weakref.WeakSet"]] = {}


def _watch_linear(lin: torch.nn.Module, fused: torch.nn.Module) -> None:
    _install_hook()
    key = id(lin)
    entry = _PACKED_BY.get(key)
    if entry is None or entry[0]() is not lin:

        def forget(ref: "weakref.ref", key: int = key) -> None:
            if _PACKED_BY.get(key, (None,))[0] is ref:
                del _PACKED_BY[key]

        entry = (weakref.ref(lin, forget), weakref.WeakSet())
        _PACKED_BY[key] = entry
    entry[1].add(fused)


def _on_parameter_registered(module: torch.nn.Module, name: str, param: tp.Optional[Tensor]) -> None:
    entry = _PACKED_BY.get(id(module))
    if entry is not None and entry[0]() is module:
        for fused in entry[1]:
            fused._params_replaced = True


_HOOK: tp.List[tp.Any] = []  # the hook's handle, once installed


def _install_hook() -> None:
    """Installed by the first fused module that watches a Linear, not at import:
    importing torchani_fast changes nothing in other modules."""
    if not _HOOK:
        _HOOK.append(torch.nn.modules.module.register_module_parameter_registration_hook(
            _on_parameter_registered))
