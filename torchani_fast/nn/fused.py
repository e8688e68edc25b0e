"""The fused networks modules: every member of an ANI ensemble evaluated at once.

How they work (the C++ op, zero blocks and chunks, packing and its caches,
training, backward passes): docs/design.md.
"""
import os
import threading
import typing as tp

import torch
from torch import Tensor
from torch.jit import Final
try:
    from torchani.nn import ANINetworks, AtomicContainer, Ensemble
except ImportError:  # TorchANI 2.2.4: the base of torchani_fast.legacy's fused networks
    from .layout import ANINetworks, Ensemble  # stand-ins that match no module

    class AtomicContainer(torch.nn.Module):
        """The attributes of TorchANI >= 2.7's ``AtomicContainer`` that the fused modules use."""

        num_species: int
        total_members_num: int
        active_members_idxs: tp.List[int]

        def __init__(self) -> None:
            super().__init__()
            self.total_members_num = 1
            self.active_members_idxs = [0]
            self.num_species = 0

from .. import ops
from .._device_paths import host_path
from .grouping import composition_groups, groups
from .layout import (_activation_of, _aev_layout, _bitmask, _Layout, _zero_blocks_mean_no_neighbors,
                     charge_unsupported_reason, linears as _linears, unsupported_reason)
from .packing import OpArgs, _WeightPacks
from .training import element_packs, first_layer_weights, select_columns
from .recompute import (RECOMPUTE_MIN_BYTES, RECOMPUTE_MIN_BYTES_GPU, _device_budget, _mlp_values,
                        _Recompute)

__all__ = ["FusedEnsemble", "FusedNetworks", "FusedChargeNetworks", "fuse_networks",
           "fuse_charge_networks"]

MAX_FIRST_LAYER_PACKS = 32
SPLIT_MIN_ATOMS = 64  # smallest group of atoms worth a second layer-1 GEMM
# Up to this many atoms of one element, layer 1 runs as a batched GEMM over the
# members (x broadcast, the packed weights viewed per member) rather than one wide
# GEMM: 1.4-2x faster there on the CPU (MKL splits the batch across threads).
SMALL_GROUP_ATOMS = 256


def _networks_switch() -> str:
    value = os.environ.get("TORCHANI_FAST_CUDA_NETWORKS", "fused")
    if value not in ("fused", "aten"):
        raise ValueError(f"TORCHANI_FAST_CUDA_NETWORKS must be 'fused' or 'aten', got {value!r}")
    return value


# How the device path (CUDA, or CPU tensors under _device_paths.on_cpu) evaluates
# the networks: "fused", the ensemble_dense op (every element and member in one
# op, no grouping, no host synchronisation), or "aten", the groups op by op.
# Read once from TORCHANI_FAST_CUDA_NETWORKS; assign it to compare the two in one
# process. Training (weights that require grad), per-member values
# (ensemble_values=True), charge networks, scripted modules and networks of
# differing depths take the ATen path whatever it says.
CUDA_NETWORKS = _networks_switch()


class _FusedBase(_WeightPacks, AtomicContainer):
    """Shared evaluation; the subclasses only differ in how members are registered.
    The packed weights and the op's arguments made of them: ``packing._WeightPacks``.

    Not built directly: use :func:`fuse_networks` or ``FusedEnsemble.from_torchani``.
    """

    __jit_ignored_attributes__ = ["_packs", "_native_plans", "_plans_epoch", "_params_replaced"]

    is_ensemble: Final[bool]
    max_first_layer_packs: int
    split_min_atoms: int
    zero_blocks_exact: bool
    recompute_min_bytes: int
    recompute_min_bytes_gpu: int
    small_group_atoms: int
    native_cpu: bool  # CPU calls use the C++ ops ensemble_atomic / ensemble_energies (module doc)
    # float64 weights that are all float32 values get float32 panels, widened in cache
    # by the C++ op: the same bits from half the bytes (packing._narrowed)
    narrow_panels: bool
    activation: int  # between layers: 0 CELU(0.1) (TightCELU), 1 GELU (layout.ACTIVATION_*)
    # per element, per layer: whether the Linear has a bias (those without are packed
    # as zero biases; their slot in _flat_params holds the layer's weight instead)
    layer_biases: tp.List[tp.List[bool]]
    output_row: int  # -1: one output per atom; else the row of the last layer evaluated (charges)
    num_layers: tp.List[int]  # per element: number of Linear layers (hidden + final)
    hidden_widths: tp.List[int]  # per element: sum of the hidden layers' widths
    offsets: tp.List[int]  # per element: first index of its packs in the hidden entry
    in_dim: int
    radial_sublen: int  # R, or 0 when the AEV layout is unknown (no column skipping)
    angular_sublen: int  # W
    triu: tp.List[tp.List[int]]  # triu_index as nested lists
    # Every member's parameters in [member][element][W1, b1, W2, b2, ...] order. A
    # plain list of the parameter tensors themselves (so it follows requires_grad,
    # .to() and load_state_dict, also through jit.save/load): scripted code reads
    # it instead of walking 8 x 7 x 4 modules, which would unroll into ~1400 nodes.
    _flat_params: tp.List[Tensor]
    params_per_member: int
    param_offsets: tp.List[int]  # per element: index of its W1 within a member

    def _init_layout(self, aev_computer: tp.Optional[torch.nn.Module]) -> None:
        atomics = self._member_atomics()[0]
        self.num_species = len(atomics)
        self.num_layers = [len(_linears(a)) for a in atomics]
        code = _activation_of(getattr(atomics[0], "activation", None))
        self.activation = 0 if code is None else code
        self.layer_biases = [[lin.bias is not None for lin in _linears(a)] for a in atomics]
        self.output_row = -1
        self.offsets = []
        off = 0
        for n in self.num_layers:
            self.offsets.append(off)
            off += 2 * n - 1  # b1, then (W_l, b_l) for l = 2..n
        self.param_offsets = []
        off = 0
        for n in self.num_layers:
            self.param_offsets.append(off)
            off += 2 * n
        self.params_per_member = off
        # The packed weights (csrc/ensemble/pack_cache.h): the eager module's,
        # and each scripted copy's own (__prepare_scriptable__).
        self._packs = torch.classes.torchani_fast.PackCache()
        self._script_packs = torch.classes.torchani_fast.PackCache()
        self._native_plans = {}  # eager CPU: the op's arguments per (members, groups), see _native_plan
        self._plans_epoch = -1  # the packs' epoch the plans were built at
        self._refresh_params()
        self.in_dim = int(_linears(atomics[0])[0].in_features)
        self.radial_sublen, self.angular_sublen, self.triu = _aev_layout(
            aev_computer, self.num_species, self.in_dim
        )
        self.max_first_layer_packs = MAX_FIRST_LAYER_PACKS
        # A zero AEV block means "no such neighbours" (zero derivative too): true
        # of torchani_fast's AEV, not of TorchANI's (module doc). The rare-element
        # split and the CPU op's skipping in the backward rely on it.
        self.zero_blocks_exact = _zero_blocks_mean_no_neighbors(aev_computer)
        self.split_min_atoms = SPLIT_MIN_ATOMS
        self.recompute_min_bytes = RECOMPUTE_MIN_BYTES
        self.recompute_min_bytes_gpu = RECOMPUTE_MIN_BYTES_GPU
        self.small_group_atoms = SMALL_GROUP_ATOMS
        self.native_cpu = True
        self.narrow_panels = True
        self.hidden_widths = [sum(int(lin.out_features) for lin in _linears(a)[:-1]) for a in atomics]
        w = _linears(atomics[0])[0].weight
        # Follows the parameters through .to()/.double(): the cache is checked against it.
        self.register_buffer("_probe", torch.zeros(0, dtype=w.dtype, device=w.device), persistent=False)

    # -- TorchANI AtomicContainer interface -----------------------------------------

    def forward(
        self,
        elem_idxs: Tensor,
        aevs: tp.Optional[Tensor] = None,
        atomic: bool = False,
        ensemble_values: bool = False,
    ) -> Tensor:
        """Energies from AEVs, with TorchANI's ``Ensemble``/``ANINetworks`` shapes.

        Parameters
        ----------
        elem_idxs : Tensor, long, (M, A)
            Element indices (0 .. num_species-1); -1 marks padding (energy 0).
        aevs : Tensor, (M, A, in_dim)
            AEVs in the parameters' dtype.
        atomic : bool
            Return per-atom energies instead of their sum over atoms.
        ensemble_values : bool
            Keep the member axis first instead of averaging (ensembles only; a
            single network ignores it, like ``ANINetworks``).

        Returns
        -------
        Tensor, Hartree: (M,), (M, A), (members, M) or (members, M, A).
        """
        assert aevs is not None, "aevs is required"
        assert elem_idxs.shape == aevs.shape[:-1], "elem_idxs must be (M, A) and aevs (M, A, F)"
        reduce = not atomic and not (ensemble_values and self.is_ensemble)
        if not torch.jit.is_scripting():
            if not (ensemble_values and self.is_ensemble):
                # The device path's networks op (the members summed in the op).
                dense = self._dense_atomic(elem_idxs, aevs)
                if dense is not None:
                    return dense if atomic else dense.sum(1)
        if torch.compiler.is_compiling():
            values = self._traced_atomic(elem_idxs.flatten(), aevs.flatten(0, 1))
            return self._reduce(values, elem_idxs.shape[0], elem_idxs.shape[1], atomic, ensemble_values)
        values = self._member_atomic(elem_idxs.flatten(), aevs.flatten(0, 1),
                                     elem_idxs.shape[0] if reduce else 0)
        return self._reduce(values, elem_idxs.shape[0], elem_idxs.shape[1], atomic, ensemble_values)

    def local_atomic(self, elem_idxs: Tensor, aevs: Tensor, num_local: int) -> Tensor:
        """Atomic energies (M, A) like ``forward(elem_idxs, aevs, atomic=True)`` for the
        first ``num_local`` atoms of each row; the others (a domain's ghost atoms)
        are not evaluated and get 0.

        The groups, and so the AEV columns layer 1 reads, are those of all the
        atoms: a local atom may see an element that only ghost atoms have, whose
        columns the composition of the local atoms alone would skip.
        """
        if not torch.jit.is_scripting():
            index = torch.arange(elem_idxs.shape[1], device=elem_idxs.device)
            dense = self._dense_atomic(torch.where(index < num_local, elem_idxs, -1), aevs)
            if dense is not None:
                return dense
        flat = elem_idxs.flatten()
        aev = aevs.flatten(0, 1)
        k = len(self._evaluated_members())
        atoms, group_elem, group_mask, group_size = self._groups(flat, aev)
        keep = torch.remainder(atoms, elem_idxs.shape[1]) < num_local
        kept: tp.List[Tensor] = []
        elems: tp.List[int] = []
        masks: tp.List[int] = []
        sizes: tp.List[int] = []
        start = 0
        for g in range(len(group_size)):
            rows = atoms.narrow(0, start, group_size[g])
            rows = rows[keep.narrow(0, start, group_size[g])]
            start += group_size[g]
            if rows.shape[0] > 0:
                kept.append(rows)
                elems.append(group_elem[g])
                masks.append(group_mask[g])
                sizes.append(rows.shape[0])
        if k == 0 or len(sizes) == 0:
            values = aev.new_zeros((k, flat.shape[0]))
        else:
            values = self._grouped_atomic(flat.shape[0], aev, torch.cat(kept), elems, masks, sizes)
        return self._reduce(values, elem_idxs.shape[0], elem_idxs.shape[1], True, False)

    def _reduce(self, values: Tensor, molecules: int, atoms: int, atomic: bool, ensemble_values: bool) -> Tensor:
        """``forward``'s output from the members' atomic energies (k, M*A); energies
        (M,) that the CPU op already reduced (1-D) are returned as they are."""
        if values.dim() == 1:
            return values
        values = values.view(values.shape[0], molecules, atoms)
        if not self.is_ensemble:
            return values[0] if atomic else values[0].sum(1)
        n_active = len(self.active_members_idxs)
        if ensemble_values:
            if not atomic:
                values = values.sum(2)
            if values.shape[0] < n_active:
                # A repeated index in set_active_members: TorchANI evaluates each
                # member once and leaves the extra rows zero.
                shape = [n_active - values.shape[0]]
                for d in values.shape[1:]:
                    shape.append(d)
                values = torch.cat([values, values.new_zeros(shape)])
            return values
        if atomic:
            return values.sum(0) / n_active
        return values.sum(2).sum(0) / n_active

    @torch.jit.export
    def set_active_members(self, idxs: tp.List[int]) -> None:
        """Average over (or return) only these members; any subset, in any order."""
        for idx in idxs:
            if not (0 <= idx < self.total_members_num):
                raise IndexError(f"Idx {idx} should be 0 <= idx < {self.total_members_num}")
        self.active_members_idxs = idxs
        self.clear_cache()

    @torch.jit.export
    def get_active_members_num(self) -> int:
        return len(self.active_members_idxs)

    @torch.jit.export
    def clear_cache(self) -> None:
        """Drop the packed weights; they are rebuilt from the parameters on the next call.

        Needed only after writes through ``.data`` (``p.data.add_(x)``): every
        other in-place change or new storage of a parameter is detected by the
        next call; ``load_state_dict`` and ``.to()`` clear it.
        ``torch.jit.save`` and copies never carry the cache (a
        ``torch.classes.torchani_fast.PackCache``, which pickles as empty): a
        saved ANI-2x is the size of TorchANI's file (55 MB) after any call.
        """
        if torch.jit.is_scripting():
            self._script_packs.clear()
        else:
            self._eager_clear()  # (the packs, the plans, and the parameters read again)

    @torch.jit.unused
    def to_infer_model(self, use_mnp: bool = False) -> AtomicContainer:
        """Already the inference form: returns ``self``."""
        return self

    # -- evaluation -------------------------------------------------------------------

    def _member_atomic(self, flat: Tensor, aev: Tensor, molecules: int = 0) -> Tensor:
        """Atomic energies (members, M*A) of the distinct active members, in index order.

        With ``molecules`` > 0 the CPU op may instead return the energies
        (molecules,) that ``_reduce`` would make of them (then 1-D).
        """
        k = len(self._evaluated_members())
        if k == 0:
            return aev.new_zeros((0, flat.shape[0]))
        groups = None if torch.jit.is_scripting() else self._pinned_groups()
        if groups is None:
            groups = self._groups(flat, aev)
        atoms, group_elem, group_mask, group_size = groups
        if len(group_size) == 0:
            return aev.new_zeros((k, flat.shape[0]))
        return self._grouped_atomic(flat.shape[0], aev, atoms, group_elem, group_mask, group_size,
                                    molecules)

    @torch.jit.unused
    def _traced_atomic(self, flat: Tensor, aev: Tensor) -> Tensor:
        """``_member_atomic`` for torch.compile / torch.export: no grouping (which
        reads the elements present back to the host), every element's network on
        every atom, masked by element (num_species times the work: a graph of static
        shapes, TorchANI's own atomic networks, differentiable by ATen's autograd)."""
        atomics = self._member_atomics()
        rows: tp.List[Tensor] = []
        for m in self._evaluated_members():
            total = aev.new_zeros(flat.shape[0])
            for e, net in enumerate(atomics[m]):
                out = net(aev)
                out = out[:, self.output_row] if self.output_row >= 0 else out.squeeze(-1)
                total = torch.where(flat == e, out, total)
            rows.append(total)
        return torch.stack(rows)

    def _grouped_atomic(
        self, num_atoms: int, aev: Tensor, atoms: Tensor, group_elem: tp.List[int],
        group_mask: tp.List[int], group_size: tp.List[int], molecules: int = 0,
    ) -> Tensor:
        """``_member_atomic`` once the groups are known: no host synchronisation."""
        act = self._evaluated_members()
        k = len(act)
        if host_path(aev) and self.native_cpu:
            args = self._native_args(act, group_elem, group_mask)
            if args is not None:
                # The C++ kernels through ensemble_atomic / ensemble_energies,
                # whose autograd is in C++ (a scripted model loaded without
                # Python differentiates too).
                columns, first, packs, panels, layers = args
                if molecules > 0:
                    divisor = len(self.active_members_idxs) if self.is_ensemble else 1
                    return ops.ensemble_energies(
                        aev.contiguous(), atoms, group_size, columns, first, packs, panels, layers, k,
                        molecules, divisor, self.zero_blocks_exact, self.activation)
                return ops.ensemble_atomic(
                    aev.contiguous(), atoms, group_size, columns, first, packs, panels, layers, k,
                    self.zero_blocks_exact, self.activation)
        training = self._weights_epoch() < 0
        if training:
            # Differentiable packing on every call, nothing cached: exact weight
            # gradients, and an optimizer step is seen by the next call. Packs
            # cached before training began would be stale once it ends: dropped.
            self._cache().clear()
            return self._train_atomic(aev, atoms, act, group_elem, group_mask, group_size)
        hidden = self._cached_hidden(act)
        if self._recompute(aev, group_elem, group_size, k):
            return self._eager_recompute(aev, atoms, hidden, act, group_elem, group_mask, group_size)
        out = aev.new_zeros((k, num_atoms))
        xs = aev.index_select(0, atoms).split(group_size)
        outs: tp.List[Tensor] = []
        for g in range(len(group_size)):
            e = group_elem[g]
            first = self._cached_first(act, e, group_mask[g])
            cols = first[0]
            x = xs[g] if cols.shape[0] == aev.shape[1] else xs[g].index_select(1, cols)
            o = self.offsets[e]
            packs = hidden[o:o + 2 * self.num_layers[e] - 1]
            outs.append(_mlp_values(x, first[1], packs, k, self.small_group_atoms, self.activation)[0])
        return out.index_copy(1, atoms, torch.cat(outs, 1))

    def _train_atomic(
        self, aev: Tensor, atoms: Tensor, act: tp.List[int], group_elem: tp.List[int],
        group_mask: tp.List[int], group_size: tp.List[int],
    ) -> Tensor:
        """Values (k, atoms) while the parameters require grad: ``ensemble_train``
        (C++, any device) on weights packed from the live parameters
        (training.py), with the weight gradients and the force loss's second
        derivatives written out instead of recorded op by op."""
        ws = self._member_weights()
        # Packed once per element present (an element may have two groups), not
        # for the elements of the model that this call has no atoms of.
        w1s: tp.Dict[int, Tensor] = {}
        hidden: tp.Dict[int, tp.List[Tensor]] = {}
        columns: tp.List[Tensor] = []
        first: tp.List[Tensor] = []
        packs: tp.List[Tensor] = []
        layers: tp.List[int] = []
        for g in range(len(group_size)):
            e = group_elem[g]
            if e not in hidden:
                w1s[e] = first_layer_weights(ws, act, e)
                hidden[e] = element_packs(ws, act, e, self.num_layers[e], self.layer_biases[e],
                                          self.output_row)
            cols = self._column_index(group_mask[g], aev.device)
            columns.append(cols)
            first.append(select_columns(w1s[e], cols, cols.shape[0] == self.in_dim))
            packs.extend(hidden[e])
            layers.append(self.num_layers[e])
        return ops.ensemble_train(
            aev, atoms, group_size, columns, first, packs, layers, len(act), self.small_group_atoms,
            self.activation)

    def _recompute(self, aev: Tensor, group_elem: tp.List[int], group_size: tp.List[int], k: int) -> bool:
        """Whether ``_eager_recompute`` evaluates the groups: large inputs with
        gradient, whose activations would exceed the budget (see the module doc)."""
        if torch.jit.is_scripting():
            return False
        if not (aev.requires_grad and torch.is_grad_enabled()):
            return False
        saved = 0
        for g in range(len(group_size)):
            saved += group_size[g] * k * self.hidden_widths[group_elem[g]]
        limit = self.recompute_min_bytes if aev.device.type == "cpu" else self._gpu_budget(aev.device)
        return saved * aev.element_size() > limit

    @torch.jit.unused
    def _gpu_budget(self, device: torch.device) -> int:
        """``recompute_min_bytes_gpu``, or for -1 (the default) an eighth of the
        device's memory (1 GiB where torch does not report it)."""
        if self.recompute_min_bytes_gpu >= 0:
            return self.recompute_min_bytes_gpu
        return _device_budget(device)

    @torch.jit.unused
    def _eager_recompute(
        self, aev: Tensor, atoms: Tensor, hidden: tp.List[Tensor], act: tp.List[int],
        group_elem: tp.List[int], group_mask: tp.List[int], group_size: tp.List[int],
    ) -> Tensor:
        """Values (k, atoms) of the groups by ``_Recompute`` in PyTorch, keeping no activations."""
        args = self._op_args(act, group_elem, group_mask, hidden, False)
        return _Recompute.apply(aev, atoms, group_size, args, len(act), self.small_group_atoms,
                                self.activation)

    def _native_args(self, act: tp.List[int], group_elem: tp.List[int],
                     group_mask: tp.List[int]) -> tp.Optional[OpArgs]:
        """The op's weight arguments for these groups, or None while a parameter
        they come from requires grad: training takes the PyTorch path, which
        packs on every call (an optimizer step changes the weights in place,
        unseen by the cache), with or without grad mode."""
        if torch.jit.is_scripting():
            if self._weights_epoch() < 0:
                return None
            return self._op_args(act, group_elem, group_mask, self._cached_hidden(act), True)
        return self._native_plan(act, group_elem, group_mask)

    @torch.jit.unused
    def fixed_groups(self, elem_idxs: Tensor) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
        """The grouping of these atoms by element, for :meth:`energies_fixed` (one host sync).

        For loops over geometries of one system (MD, optimisation), where the
        elements never change: with the groups computed once, an evaluation has
        no host synchronisation and can be captured in a CUDA graph.
        """
        return self._composition_groups(elem_idxs.flatten())

    @torch.jit.unused
    def groups_of(self, elem_idxs: Tensor, aevs: Tensor) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
        """The grouping that ``forward(elem_idxs, aevs)`` uses, for :meth:`energies_fixed`
        (one host sync off the CPU): by element, and within an element, atoms that
        lack the same neighbour blocks side by side, so that layer 1 skips more of
        them (what :meth:`fixed_groups` cannot know before the geometry)."""
        return self._groups(elem_idxs.flatten(), aevs.flatten(0, 1))

    @torch.jit.unused
    def pinned(self, groups: tp.Optional[tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]]):
        """A context in which this thread's calls use ``groups`` (from :meth:`fixed_groups`)
        instead of finding them: no host synchronisation (``None``: find them)."""
        return _Pinned(self, groups)

    @torch.jit.unused
    def _pinned_groups(self) -> tp.Optional[tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]]:
        return getattr(_PINNED, "groups", {}).get(id(self))

    @torch.jit.unused
    def energies_fixed(
        self, elem_idxs: Tensor, aevs: Tensor,
        groups: tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]],
    ) -> Tensor:
        """Energies (M,) like ``forward(elem_idxs, aevs)``, with groups from :meth:`fixed_groups`."""
        dense = self._dense_atomic(elem_idxs, aevs)
        if dense is not None:
            return dense.sum(1)
        atoms, elems, masks, sizes = groups
        num_atoms = elem_idxs.numel()
        k = len(self._evaluated_members())
        if k == 0 or not sizes:
            values = aevs.new_zeros((k, num_atoms))
        else:
            values = self._grouped_atomic(num_atoms, aevs.flatten(0, 1), atoms, elems, masks, sizes,
                                          elem_idxs.shape[0])
        return self._reduce(values, elem_idxs.shape[0], elem_idxs.shape[1], False, False)

    # -- the device path's one op (ensemble_dense) ------------------------------------

    @torch.jit.unused
    def _dense_atomic(self, elem_idxs: Tensor, aevs: Tensor) -> tp.Optional[Tensor]:
        """Atomic values (M, A) summed over the active members and divided by their
        number (ensembles) by the ensemble_dense op, or None where that op does not
        serve this call (``CUDA_NETWORKS``; the CPU's own path; see there)."""
        if not self.dense_serves(aevs):
            return None
        weights, weights_t, biases, divisor = self.dense_weights()
        total = ops.ensemble_dense(aevs.flatten(0, 1), elem_idxs.flatten(), weights, weights_t, biases,
                                   self.activation).view(elem_idxs.shape)
        if divisor != 1:
            total = total / divisor
        return total

    @torch.jit.unused
    def dense_serves(self, aevs: Tensor) -> bool:
        """Whether the ensemble_dense op evaluates these AEVs (the device path, the
        fused networks chosen, a network layout the op takes, not training)."""
        if CUDA_NETWORKS != "fused" or host_path(aevs) or torch.compiler.is_compiling():
            return False
        if self.output_row >= 0 or len(set(self.num_layers)) != 1 or self.num_layers[0] < 2:
            return False
        if self.num_species > 32 or aevs.dtype not in (torch.float32, torch.float64):
            return False
        if aevs.dtype != self._probe.dtype or aevs.device != self._probe.device:
            return False
        # training: the weights' gradients come from the ATen path
        return self._weights_epoch() >= 0

    @torch.jit.unused
    def dense_weights(self, negate: bool = False) -> tp.Tuple[tp.List[Tensor], tp.List[Tensor], tp.List[Tensor], int]:
        """ensemble_dense's weights of the evaluated members, and the divisor left to apply.

        The networks' value is the members' sum over the number of active members
        n (ensembles). When n is a power of two, 1/n is folded into the last
        layer's weights and bias (exact: the op's outputs, its jacobian included,
        are the members' sum over n to the bit) and the divisor is 1; otherwise it
        is n. ``negate``: the last layer negated as well (the value and jacobian
        come out negated, exactly), for callers that want -dE/dAEV with no extra
        op. Cached with the other packs; the hidden layers are shared.
        """
        act = self._evaluated_members()
        n = len(self.active_members_idxs) if self.is_ensemble else 1
        folded = n & (n - 1) == 0
        packs = self._dense_packs(act, n if folded else 1, negate)
        return packs[0], packs[1], packs[2], 1 if folded else n

    @torch.jit.unused
    def _dense_packs(self, act: tp.List[int], divisor: int = 1,
                     negate: bool = False) -> tp.Tuple[tp.List[Tensor], tp.List[Tensor], tp.List[Tensor]]:
        """ensemble_dense's weights for these members, cached: per layer W (S, k, d_in,
        d_out), W^T (S, k, d_out, d_in) and b (S, k, d_out), zero-padded to the
        widest element (a zero unit stays zero through CELU and GELU); the last
        layer's divided by ``divisor`` (a power of two: exact) and, with
        ``negate``, negated (dense_weights)."""
        cache = self._cache()
        key = -(1 << 50) * (2 * divisor + int(negate)) - _bitmask(act)
        packs = cache.get(key)
        if packs is not None and not self._stale(packs[0]):
            return self._split_dense(packs)
        if divisor != 1 or negate:
            # The plain packs' hidden layers, shared; the last layer's three tensors scaled.
            scale = (-1.0 if negate else 1.0) / divisor
            plain = self._dense_packs(act)
            with torch.inference_mode(False), torch.no_grad():
                last = [t * scale for t in (plain[0][-1], plain[1][-1], plain[2][-1])]
            built = [t for l in range(len(plain[0]) - 1) for t in (plain[0][l], plain[1][l], plain[2][l])] + last
            cache.put(key, built, self.max_first_layer_packs)
            return self._split_dense(built)
        with torch.inference_mode(False), torch.no_grad():
            ws = self._member_weights()
            s_num, k, num_layers = self.num_species, len(act), self.num_layers[0]
            built: tp.List[Tensor] = []
            d_in = self.in_dim
            for l in range(num_layers):
                d_out = max(int(ws[act[0]][e][2 * l].shape[0]) for e in range(s_num))
                w = self._probe.new_zeros((s_num, k, d_in, d_out))
                b = self._probe.new_zeros((s_num, k, d_out))
                for e in range(s_num):
                    for i, m in enumerate(act):
                        weight = ws[m][e][2 * l]  # (out, in)
                        w[e, i, :weight.shape[1], :weight.shape[0]] = weight.t()
                        if self.layer_biases[e][l]:
                            b[e, i, :weight.shape[0]] = ws[m][e][2 * l + 1]
                built.extend([w, w.transpose(2, 3).contiguous(), b])
                d_in = d_out
        cache.put(key, built, self.max_first_layer_packs)
        return self._split_dense(built)

    @staticmethod
    def _split_dense(packs: tp.List[Tensor]) -> tp.Tuple[tp.List[Tensor], tp.List[Tensor], tp.List[Tensor]]:
        return packs[0::3], packs[1::3], packs[2::3]

    def _composition_groups(self, flat: Tensor) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
        """One group per element present, all reading every present block (grouping.py)."""
        return composition_groups(flat, self.num_species, self.radial_sublen, self._split_min_atoms())

    def _groups(self, flat: Tensor, aev: Tensor) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
        """How atoms are grouped for layer 1 (grouping.py: ``groups``)."""
        return groups(flat, aev, self.num_species, self.radial_sublen, self._split_min_atoms())

    def _split_min_atoms(self) -> int:
        """``split_min_atoms`` where the rare-element split is allowed (AEVs whose
        zero blocks mean "no such neighbour"), else 0: no split."""
        return self.split_min_atoms if self.zero_blocks_exact else 0

    def _evaluated_members(self) -> tp.List[int]:
        if not self.is_ensemble:
            return [0]
        act: tp.List[int] = []
        for j in range(self.total_members_num):
            if j in self.active_members_idxs:
                act.append(j)
        return act

    @torch.jit.unused
    def _member_atomics(self) -> tp.List[tp.List[torch.nn.Module]]:
        """[member] -> element networks (``AtomicNetwork``), in element order."""
        raise NotImplementedError

    # -- module plumbing --------------------------------------------------------------

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._eager_clear()
        return out

    def __getstate__(self):
        # Pickling and deepcopy carry the parameters, not the derived packs.
        state = self.__dict__.copy()
        state["_native_plans"] = {}
        state["_packs"] = None  # C++ objects, remade by __setstate__
        state["_script_packs"] = None
        return state

    def __setstate__(self, state):
        # Modules pickled by an older torchani_fast get the attributes added since.
        state.setdefault("native_cpu", True)
        state.setdefault("narrow_panels", True)
        state.setdefault("activation", 0)
        state.setdefault("output_row", -1)  # (older modules fused CELU networks with biases only)
        if "layer_biases" not in state:
            state["layer_biases"] = [[True] * n for n in state["num_layers"]]
        state.setdefault("zero_blocks_exact", False)  # (no split, J computed everywhere: exact)
        for old in ("_eager_cache", "_jit_cache", "_params_watch", "_weights_fingerprint"):
            state.pop(old, None)  # (the caches of torchani_fast before 0.2)
        state["_native_plans"] = {}
        state["_plans_epoch"] = -1
        super().__setstate__(state)
        self._packs = torch.classes.torchani_fast.PackCache()
        self._script_packs = torch.classes.torchani_fast.PackCache()
        self._refresh_params()  # and the cache's watch over them

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every submodule: each scripted copy
        # gets a cache of its own instead of sharing another copy's.
        self._script_packs = torch.classes.torchani_fast.PackCache()
        return self

    def extra_repr(self) -> str:
        skip = "by element" if self.radial_sublen else "off"
        return (
            f"members={self.total_members_num}, active={self.active_members_idxs}, "
            f"zero-block skipping {skip}"
        )


_PINNED = threading.local()  # .groups: {id(networks): groups} of this thread's pinned calls


class _Pinned:
    """:meth:`_FusedBase.pinned`'s context (nests; per thread)."""

    def __init__(self, nets: torch.nn.Module, groups) -> None:
        self._key, self._groups, self._before = id(nets), groups, None

    def __enter__(self) -> None:
        table = _PINNED.__dict__.setdefault("groups", {})
        self._before = table.get(self._key)
        if self._groups is None:
            table.pop(self._key, None)
        else:
            table[self._key] = self._groups

    def __exit__(self, *exc) -> None:
        table = _PINNED.groups
        if self._before is None:
            table.pop(self._key, None)
        else:
            table[self._key] = self._before


class FusedEnsemble(_FusedBase):
    """Drop-in for ``torchani.nn.Ensemble`` that evaluates all members at once.

    ``members`` holds TorchANI's own ``ANINetworks`` (same state-dict keys);
    ``self[i]`` is member ``i`` as a :class:`FusedNetworks`, which is what
    ``model[i]`` uses.
    """

    def __init__(self, ensemble: Ensemble, aev_computer: tp.Optional[torch.nn.Module] = None):
        super().__init__()
        self.members = ensemble.members
        self.total_members_num = len(self.members)
        self.active_members_idxs = list(ensemble.active_members_idxs)
        self.is_ensemble = True
        self.register_buffer("atomic_numbers", ensemble.atomic_numbers.clone(), persistent=False)
        self._init_layout(aev_computer)

    @classmethod
    def from_torchani(cls, networks: torch.nn.Module, aev_computer: tp.Optional[torch.nn.Module] = None):
        """Fuse an ``Ensemble`` (-> FusedEnsemble) or ``ANINetworks`` (-> FusedNetworks).

        ``aev_computer`` gives the AEV layout used to skip zero blocks; without it
        every column is multiplied. Raises ``TypeError`` if unsupported.
        """
        return fuse_networks(networks, aev_computer)

    def __len__(self) -> int:
        return self.total_members_num

    def __getitem__(self, idx: int) -> "FusedNetworks":
        layout = _Layout(self.radial_sublen, self.angular_sublen, self.triu)
        member = FusedNetworks(self.members[idx], layout)
        member.zero_blocks_exact = self.zero_blocks_exact
        member.split_min_atoms = self.split_min_atoms
        return member

    @torch.jit.unused
    def _member_atomics(self) -> tp.List[tp.List[torch.nn.Module]]:
        return [list(net.atomics.values()) for net in self.members]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._eager_clear()
        # Like torchani's Ensemble: accept keys saved without the "members." level.
        for key in [k for k in state_dict if k.startswith(prefix)]:
            if not key[len(prefix):].startswith("members."):
                state_dict[prefix + "members." + key[len(prefix):]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class FusedNetworks(_FusedBase):
    """Drop-in for a single ``torchani.nn.ANINetworks`` (``model_index=i``, ``model[i]``).

    Like ``ANINetworks`` it ignores ``ensemble_values`` and the active members.
    """

    def __init__(self, networks: ANINetworks, aev_computer: tp.Optional[torch.nn.Module] = None):
        super().__init__()
        self.atomics = networks.atomics
        self.total_members_num = 1
        self.active_members_idxs = [0]
        self.is_ensemble = False
        self.register_buffer("atomic_numbers", networks.atomic_numbers.clone(), persistent=False)
        self._init_layout(aev_computer)

    def __getitem__(self, idx: str) -> torch.nn.Module:
        return self.atomics[idx]

    @torch.jit.unused
    def _member_atomics(self) -> tp.List[tp.List[torch.nn.Module]]:
        return [list(self.atomics.values())]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._eager_clear()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class FusedChargeNetworks(FusedNetworks):
    """Drop-in for TorchANI's charge networks (``_ANINetworksDiscardFirstScalar``,
    ANImbis): atomic networks with two outputs of which the second is the
    charge. Evaluates that output only (the op's one-output networks with the
    last layer's second row). ``forward(elem_idxs, aevs, atomic=True)`` gives
    the atomic charges (M, A), ``atomic=False`` their sums, as TorchANI's.
    """

    def __init__(self, networks: torch.nn.Module, aev_computer: tp.Optional[torch.nn.Module] = None):
        super().__init__(networks, aev_computer)
        self.output_row = 1  # (nothing is packed before the first call)


def fuse_charge_networks(networks: torch.nn.Module, aev_computer: tp.Optional[torch.nn.Module] = None):
    """The fused form of TorchANI's charge networks (``SeparateChargesNNPotential.charge_networks``,
    ANImbis), sharing their parameters; already fused ones are returned as is.

    ``aev_computer`` as for :func:`fuse_networks`. Raises ``TypeError`` (saying
    why) for networks that cannot be fused; see ``layout.charge_unsupported_reason``.
    """
    if isinstance(networks, FusedChargeNetworks):
        return networks
    reason = charge_unsupported_reason(networks)
    if reason is not None:
        raise TypeError(f"torchani_fast cannot fuse these charge networks: {reason}")
    return FusedChargeNetworks(networks, aev_computer)


def fuse_networks(networks: torch.nn.Module, aev_computer: tp.Optional[torch.nn.Module] = None):
    """The fused form of TorchANI's networks (already fused ones are returned as is).

    Parameters
    ----------
    networks : torchani.nn.Ensemble or torchani.nn.ANINetworks
        Shared, not copied: the fused module evaluates these parameters.
    aev_computer : module with ``radial.num_feats``, ``angular.num_feats`` and
        ``triu_index``, optional
        The AEV layout, used to skip columns of absent elements.

    Raises
    ------
    TypeError
        If the networks are of a kind that cannot be fused (the message says why).
    """
    if isinstance(networks, _FusedBase):
        return networks
    reason = unsupported_reason(networks)
    if reason is not None:
        raise TypeError(f"torchani_fast cannot fuse these networks: {reason}")
    if isinstance(networks, Ensemble):
        return FusedEnsemble(networks, aev_computer)
    return FusedNetworks(networks, aev_computer)
