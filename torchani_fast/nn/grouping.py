"""How the fused networks group a call's atoms for layer 1.

A group is the atoms of one element that read the same AEV columns: one group
per element present, or, in large inputs, two per element where a present
element is seen by at most a quarter of its atoms (the "rare-element split",
docs/design.md). ``groups`` returns the atoms of all groups, group after group,
and per group its element, the bitmask of elements whose columns it reads, and
its size. CPU tensors take one C++ pass (``torchani_fast::group_atoms``), other
devices the same rule in ATen ops; ``tests/test_nn.py`` checks that they agree.
"""
import typing as tp

import torch
from torch import Tensor

__all__ = ["groups", "composition_groups", "aten_groups", "aten_composition_groups",
           "groups_from_counts", "native_groups"]

def composition_groups(flat: Tensor, num_species: int, radial_sublen: int, split_min: int) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
    """``groups`` without splits: one group per element present, all reading every present block."""
    if flat.device.type == "cpu":
        return native_groups(flat, None, num_species, radial_sublen, split_min)
    return aten_composition_groups(flat, num_species)

def aten_composition_groups(flat: Tensor, num_species: int) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
    counts: tp.List[int] = torch.bincount(flat + 1, minlength=num_species + 1).tolist()
    return groups_from_counts(flat, counts, num_species)

def groups_from_counts(flat: Tensor, counts: tp.List[int], num_species: int) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
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
    elems: tp.List[int] = []
    masks: tp.List[int] = []
    sizes: tp.List[int] = []
    for e in range(num_species):
        if counts[e + 1] > 0:
            elems.append(e)
            masks.append(composition)
            sizes.append(counts[e + 1])
    return atoms, elems, masks, sizes

def native_groups(flat: Tensor, aev: tp.Optional[Tensor], num_species: int, radial_sublen: int,
                  split_min: int) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
    """``groups`` (with ``aev``) or ``composition_groups`` (without) in one C++
    pass over the atoms (``group_atoms``), for CPU tensors: the ATen version
    below took ~15 small ops, 1.4-1.7 ms per call for 1 000-3 000 atoms."""
    atoms, info = torch.ops.torchani_fast.group_atoms(
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
    if flat.device.type == "cpu":
        return native_groups(flat, aev, num_species, radial_sublen, split_min)
    return aten_groups(flat, aev, num_species, radial_sublen, split_min)

def aten_groups(flat: Tensor, aev: Tensor, num_species: int, radial_sublen: int, split_min: int) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
    """``groups`` with ATen ops (any device; the CPU takes ``group_atoms``)."""
    r = radial_sublen
    if r == 0 or split_min <= 0 or flat.shape[0] < 2 * split_min:
        return aten_composition_groups(flat, num_species)
    elems: tp.List[int] = []
    masks: tp.List[int] = []
    sizes: tp.List[int] = []
    # Which elements each atom sees within the radial cutoff: its nonzero radial blocks.
    seen = aev.narrow(1, 0, num_species * r).view(-1, num_species, r).ne(0).any(2)
    row = torch.where(flat < num_species, flat + 1, num_species + 1)  # padding 0, unknown last
    per_atom = torch.cat([torch.ones_like(seen[:, :1]), seen], 1).long()
    table: tp.List[tp.List[int]] = torch.zeros(
        (num_species + 2, num_species + 1), dtype=torch.long, device=flat.device
    ).index_add_(0, row, per_atom).tolist()  # [element + 1] -> [atoms, atoms seeing 0, 1, ...]
    composition = 0
    for e in range(num_species):
        if table[e + 1][0] > 0:
            composition |= 1 << e
    rare: tp.List[int] = []
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
        counts: tp.List[int] = []
        for e in range(num_species + 1):  # padding (row 0), then the elements
            counts.append(table[e][0])
        return groups_from_counts(flat, counts, num_species)
    rare_rows: tp.List[tp.List[bool]] = []
    for e in range(num_species):
        rare_rows.append([(rare[e] >> s) & 1 == 1 for s in range(num_species)])
    rare_table = torch.tensor(rare_rows, dtype=torch.bool, device=flat.device)
    # Padding atoms have zero AEVs, so they see nothing and keep key -2.
    hit = (seen & rare_table.index_select(0, flat.clamp(0, num_species - 1))).any(1)
    key = flat * 2 + hit.long()
    key_counts: tp.List[int] = torch.bincount(key + 2, minlength=2 * num_species + 2).tolist()
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
