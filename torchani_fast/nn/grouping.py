"""How the fused networks group a call's atoms for layer 1.

A group is the atoms of one element that read the same AEV columns: one group
per element present, or, in large inputs, two per element where a present
element is seen by at most a quarter of its atoms (the "rare-element split",
docs/design.md). ``groups`` returns the atoms of all groups, group after group,
and per group its element, the bitmask of elements whose columns it reads, and
its size. One implementation for every device: the C++ pass
``torchani_fast::group_atoms``. Tensors on another device send it the species
and, per atom, which elements it sees (an (atoms, elements) reduction made on
that device), and get the atoms back (``host_groups``); ``tests/nn/test_fused_networks.py``
checks both against the rule written in ATen ops.
"""
import typing as tp

import torch
from torch import Tensor
from .. import ops

from .._device_paths import host_path

__all__ = ["groups", "composition_groups", "native_groups", "host_groups"]

def composition_groups(flat: Tensor, num_species: int, radial_sublen: int, split_min: int) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
    """``groups`` without splits: one group per element present, all reading every present block."""
    if host_path(flat):
        return native_groups(flat, None, num_species, radial_sublen, split_min)
    return host_groups(flat, None, num_species, radial_sublen, split_min)

def native_groups(flat: Tensor, aev: tp.Optional[Tensor], num_species: int, radial_sublen: int,
                  split_min: int) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
    """``groups`` (with ``aev``) or ``composition_groups`` (without) in one C++
    pass over the atoms (``group_atoms``), for CPU tensors (an ATen version took
    ~15 small ops, 1.4-1.7 ms per call for 1 000-3 000 atoms)."""
    atoms, info = ops.group_atoms(
        flat, num_species, aev, radial_sublen, split_min)
    rows: tp.List[tp.List[int]] = info.tolist()
    elems: tp.List[int] = []
    masks: tp.List[int] = []
    sizes: tp.List[int] = []
    for row in rows:
        elems.append(row[0])
        masks.append(row[1])
        sizes.append(row[2])
    return atoms, elems, masks, sizes

def groups(flat: Tensor, aev: Tensor, num_species: int, radial_sublen: int, split_min: int) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
    """How atoms are grouped for layer 1.

    Returns the atoms of all groups, group after group (no padding), and per
    group its element, the bitmask of elements whose AEV columns it uses,
    and its size. One host sync (cheap on CPU), two when a split is considered.
    """
    if host_path(flat):
        return native_groups(flat, aev, num_species, radial_sublen, split_min)
    return host_groups(flat, aev, num_species, radial_sublen, split_min)


def host_groups(flat: Tensor, aev: tp.Optional[Tensor], num_species: int, radial_sublen: int,
                split_min: int) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
    """``native_groups`` for tensors on another device (one host synchronisation).

    What the split reads of the AEV, which elements each atom sees within the
    radial cutoff (its nonzero radial blocks), is reduced on the device to
    (atoms, elements) and sent to the host with the species, as an "AEV" of
    one-column blocks; the atoms of the groups go back. (Without the full AEV
    the C++ pass keeps each group's atoms in index order.)
    """
    seen: tp.Optional[Tensor] = None
    sublen = radial_sublen
    if aev is not None and radial_sublen > 0:
        blocks = aev.narrow(1, 0, num_species * radial_sublen).reshape(-1, num_species, radial_sublen)
        # The species and what each atom sees, in one copy to the host.
        both = torch.cat([flat.unsqueeze(1).long(), blocks.ne(0).any(2).long()], 1).cpu()
        host = both[:, 0].to(flat.dtype).contiguous()
        seen = both[:, 1:].to(aev.dtype)
        sublen = 1
    else:
        host = flat.cpu()
    atoms, elems, masks, sizes = native_groups(host, seen, num_species, sublen, split_min)
    return atoms.to(flat.device), elems, masks, sizes
