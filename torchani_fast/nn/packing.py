"""Packed copies of the networks' weights, and how a fused module sees that they changed.

TorchANI's member modules stay the only source of truth; the fused module
derives packed copies from them and caches them (docs/design.md, "Caches").
"""
import typing as tp
import weakref

import torch
from torch import Tensor

from .layout import _bitmask, aev_columns, linears as _linears
from .training import first_layer_pack, hidden_packs

# The networks op's weight arguments: (columns, first, packs, panels, layers).
OpArgs = tp.Tuple[tp.List[Tensor], tp.List[Tensor], tp.List[Tensor], tp.List[Tensor], tp.List[int]]


def _panel_pair(w: Tensor, narrow: bool) -> tp.List[Tensor]:
    """W (k, d_in, d_out) as 16-column panels: [(k, d_out/16, d_in, 16), W^T's (k, d_in/16, d_out, 16)];
    in float32 if ``narrow`` and W qualifies (``_narrowed``)."""
    k, d_in, d_out = w.shape[0], w.shape[1], w.shape[2]
    with torch.no_grad():
        fwd = w.reshape(k, d_in, d_out // 16, 16).permute(0, 2, 1, 3).contiguous()
        bwd = w.reshape(k, d_in // 16, 16, d_out).permute(0, 1, 3, 2).contiguous()
    return _narrowed([fwd, bwd]) if narrow else [fwd, bwd]


def _narrowed(panels: tp.List[Tensor]) -> tp.List[Tensor]:
    """float64 panels (one layer's W and W^T) as float32 if every value is a float32
    value (as ANI's published weights, stored in float32, are in a float64 model):
    the op widens them in cache, exactly, so the same bits from half the bytes
    (csrc/ensemble/gemm_f64.h). Else, and for any other dtype, unchanged."""
    if panels[0].dtype != torch.float64:
        return panels
    narrow = [p.to(torch.float32) for p in panels]
    if not torch.equal(narrow[0].to(torch.float64), panels[0]):  # (NaN too: never equal)
        return panels
    return narrow


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


class _WeightPacks:
    """The packed weights of a fused networks module (``nn.fused._FusedBase``,
    which mixes this in and declares the attributes used here) and the C++
    op's weight arguments made of them. One ``PackCache``
    (csrc/ensemble/pack_cache.h) per module holds the packs and checks the
    parameters they come from: the eager module's ``_packs``, and each scripted
    copy's own ``_script_packs``; the same methods fill both. The eager CPU path
    also keeps the op's arguments per composition (``_native_plans``), valid
    while the cache's epoch stays the one they were built at.
    """

    @torch.jit.unused
    def _native_plan(self, act: tp.List[int], group_elem: tp.List[int],
                     group_mask: tp.List[int]) -> tp.Optional[OpArgs]:
        """``_native_args`` of an eager module, kept per (members, groups): a call
        with a composition seen before costs one dict lookup and the weights
        check. A plan is valid while the packs' epoch is the one it was built at
        (no pack dropped since: see ``PackCache``)."""
        epoch = self._weights_epoch()
        if epoch < 0:
            return None  # nothing built or cached: the weights may change in place
        key = (_bitmask(act), tuple(group_elem), tuple(group_mask))
        plan = self._native_plans.get(key) if epoch == self._plans_epoch else None
        if plan is not None and not self._stale(plan.op_args[1][0]):
            return plan.op_args
        with torch.inference_mode(False):  # panels usable by later calls with forces
            op_args = self._op_args(act, group_elem, group_mask, self._cached_hidden(act), True)
        epoch = self._packs.epoch()  # (building may have dropped an older layer-1 pack)
        if epoch != self._plans_epoch:  # every plan built before is stale
            self._native_plans = {}
            self._plans_epoch = epoch
        elif len(self._native_plans) >= self.max_first_layer_packs:
            self._native_plans.pop(next(iter(self._native_plans)))  # the oldest
        self._native_plans[key] = _NativePlan(op_args, epoch)
        return op_args

    def _op_args(self, act: tp.List[int], group_elem: tp.List[int], group_mask: tp.List[int],
                 hidden: tp.List[Tensor], with_panels: bool) -> OpArgs:
        """(columns, first, packs, panels, layers) of these groups, as ``ensemble_mlp``
        takes them. Panels only when asked for, float32 or float64 and every width
        a multiple of 16; else an empty list."""
        columns: tp.List[Tensor] = []
        first: tp.List[Tensor] = []
        packs: tp.List[Tensor] = []
        panels: tp.List[Tensor] = []
        layers: tp.List[int] = []
        dtype = self._probe.dtype
        use_panels = with_panels and (dtype == torch.float32 or dtype == torch.float64)
        for g in range(len(group_elem)):
            e = group_elem[g]
            cached = self._cached_first(act, e, group_mask[g])
            o = self.offsets[e]
            hidden_e = hidden[o:o + 2 * self.num_layers[e] - 1]
            columns.append(cached[0])
            first.append(cached[1])
            packs.extend(hidden_e)
            layers.append(self.num_layers[e])
            if use_panels:
                group_panels = self._panels(act, e, group_mask[g], cached, hidden_e)
                if group_panels is None:
                    use_panels = False
                else:
                    panels.extend(group_panels)
        if not use_panels:
            panels = []
        return (columns, first, packs, panels, layers)

    def _panels(self, act: tp.List[int], elem: int, mask: int, first: tp.List[Tensor],
                hidden_e: tp.List[Tensor]) -> tp.Optional[tp.List[Tensor]]:
        """Panel copies of one group's hidden-layer weights for ensemble_mlp, cached.

        Per hidden layer, W as (k, d_out/16, d_in, 16) and W^T as (k, d_in/16,
        d_out, 16): 16-column panels, each contiguous (csrc/ensemble/gemm.h).
        Layer 1's are kept in its cache entry (``first``), the later layers'
        under a key of their own. None if a width is not a multiple of 16.
        """
        k = len(act)
        w1 = first[1]
        if w1.shape[0] % 16 != 0 or (w1.shape[1] // k) % 16 != 0:
            return None
        for l in range(1, len(hidden_e) - 2, 2):  # W_2 .. W_{L-1}: (k, d_in, d_out)
            if hidden_e[l].shape[2] % 16 != 0:
                return None
        cache = self._cache()
        if len(first) == 2:  # layer 1's panels join its entry
            first.extend(_panel_pair(w1.view(w1.shape[0], k, -1).transpose(0, 1), self.narrow_panels))
            cache.put(self._first_key(act, elem, mask), first, self.max_first_layer_packs)
        key = -(1 << 40) * (elem + 1) - _bitmask(act)
        later = cache.get(key)
        if later is None:
            built: tp.List[Tensor] = []
            for l in range(1, len(hidden_e) - 2, 2):
                built.extend(_panel_pair(hidden_e[l], self.narrow_panels))
            cache.put(key, built, self.max_first_layer_packs)
            later = built
        return first[2:4] + later

    def _cached_hidden(self, act: tp.List[int]) -> tp.List[Tensor]:
        """Packs of layers 2..L (and layer 1's biases) of these members, cached."""
        cache = self._cache()
        key = -1 - _bitmask(act)
        hidden = cache.get(key)
        if hidden is None or self._stale(hidden[0]):
            cache.clear()
            hidden = self._build(act, -1, 0)
            cache.put(key, hidden, self.max_first_layer_packs)
        return hidden

    def _cached_first(self, act: tp.List[int], elem: int, mask: int) -> tp.List[Tensor]:
        """[AEV columns, layer-1 weights (K, k*d1)] of ``elem`` reading the columns of ``mask``."""
        cache = self._cache()
        key = self._first_key(act, elem, mask)
        first = cache.get(key)
        if first is None or self._stale(first[1]):
            # At most max_first_layer_packs layer-1 packs (keys >= 0; put drops
            # the oldest); the other entries (hidden layers, panels) are bounded
            # by the elements.
            first = self._build(act, elem, mask)
            cache.put(key, first, self.max_first_layer_packs)
        return first

    def _first_key(self, act: tp.List[int], elem: int, mask: int) -> int:
        """Nonnegative keys, distinct for each (members, element, element set)."""
        return ((_bitmask(act) * self.num_species + elem) << self.num_species) | mask

    def _stale(self, packed: Tensor) -> bool:
        """Packed in another dtype/device than the parameters have now, or unusable for autograd."""
        if packed.dtype != self._probe.dtype or packed.device != self._probe.device:
            return True
        # A scripted module first called under inference_mode cached inference
        # tensors, which autograd cannot save; rebuild them once grad is on.
        return packed.is_inference() and torch.is_grad_enabled()

    def _build(self, act: tp.List[int], elem: int, mask: int) -> tp.List[Tensor]:
        """Hidden packs (``elem`` = -1) or one layer-1 pack, from the live parameters."""
        if torch.jit.is_scripting():
            # no_grad keeps the packing out of the JIT's differentiable subgraphs.
            with torch.no_grad():
                ws = self._member_weights()
                if elem < 0:
                    packs = self._pack_hidden(ws, act)
                else:
                    packs = self._pack_first(ws, act, elem, mask)
            return packs
        return self._eager_build(act, elem, mask)

    @torch.jit.unused
    def _eager_build(self, act: tp.List[int], elem: int, mask: int) -> tp.List[Tensor]:
        # Normal tensors even if this call runs under inference_mode, so that a
        # later call with forces can save them for backward.
        with torch.inference_mode(False), torch.no_grad():
            ws = self._member_weights()
            if elem < 0:
                return self._pack_hidden(ws, act)
            return self._pack_first(ws, act, elem, mask)

    def _pack_hidden(self, ws: tp.List[tp.List[tp.List[Tensor]]], act: tp.List[int]) -> tp.List[Tensor]:
        """Per element: bias of layer 1 (k*d1,), then W_l (k, d_in, d_out) and b_l (k, 1, d_out)
        (zeros for a layer without bias: adding them changes no bit); training.py's
        packs, made contiguous for the C++ op."""
        packs = hidden_packs(ws, act, self.num_species, self.num_layers, self.layer_biases,
                             self.output_row)
        return [t.contiguous() for t in packs]

    def _pack_first(
        self, ws: tp.List[tp.List[tp.List[Tensor]]], act: tp.List[int], elem: int, mask: int
    ) -> tp.List[Tensor]:
        """[AEV columns of the elements in ``mask``, ``elem``'s layer-1 weights (K, k*d1)]."""
        cols = self._column_index(mask, ws[act[0]][elem][0].device)
        return [cols, first_layer_pack(ws, act, elem, cols, cols.shape[0] == self.in_dim).contiguous()]

    def _column_index(self, mask: int, device: torch.device) -> Tensor:
        """AEV columns that can be nonzero when only the elements in ``mask`` occur."""
        if self.radial_sublen == 0:
            return torch.arange(self.in_dim, dtype=torch.long, device=device)
        present = [(mask >> s) & 1 == 1 for s in range(self.num_species)]
        cols = aev_columns(present, self.radial_sublen, self.angular_sublen, self.triu)
        return torch.tensor(cols, dtype=torch.long, device=device)

    def _cache(self) -> torch.classes.torchani_fast.PackCache:
        """This module's ``PackCache``: the eager module's, or a scripted copy's own."""
        if torch.jit.is_scripting():
            return self._script_packs
        return self._eager_packs()

    @torch.jit.unused
    def _eager_packs(self) -> torch.classes.torchani_fast.PackCache:
        if self._params_replaced:  # a Linear got a new Parameter object: re-read them all
            self._eager_clear()
        return self._packs

    def _weights_epoch(self) -> int:
        """-1 while a parameter requires grad (training: nothing may be cached).
        Otherwise the packs' epoch, after dropping them if a parameter changed
        since the last check: modified in place (``load_state_dict``, ``copy_``,
        an optimizer step; their version counters), or given new storage
        (``p.data = t``). One C++ pass over the parameters held by the cache
        (ANI-2x: 448 tensors)."""
        cache = self._cache()
        epoch = cache.check()
        if epoch == -2:  # a new cache (a scripted copy, a loaded module): watch the parameters
            cache.watch(self._flat_params)
            epoch = cache.check()
        return epoch

    @torch.jit.unused
    def packed_weights(self) -> tp.List[Tensor]:
        """The weight packs this eager module holds now: a caller that replays
        kernels reading them (EnergyForcesStep's CUDA graph) keeps this list, so
        that the memory stays theirs even if the module drops its cache."""
        return self._packs.tensors()

    @torch.jit.unused
    def _eager_clear(self) -> None:
        self._native_plans = {}
        self._refresh_params()  # (and the packs dropped)

    @torch.jit.unused
    def _refresh_params(self) -> None:
        # (Eager only; also picks up parameters replaced by assignment.)
        linears = [lin for atomics in self._member_atomics() for a in atomics for lin in _linears(a)]
        # (A layer without bias: its weight stands in the bias's slot, see layer_biases.)
        self._flat_params = [p for lin in linears
                             for p in (lin.weight, lin.weight if lin.bias is None else lin.bias)]
        self._packs.watch(self._flat_params)  # drops the packs
        for lin in linears:
            _watch_linear(lin, self)
        self._params_replaced = False

    def _member_weights(self) -> tp.List[tp.List[tp.List[Tensor]]]:
        """[member][element] -> [W1, b1, W2, b2, ...] (the live parameters)."""
        out: tp.List[tp.List[tp.List[Tensor]]] = []
        for j in range(self.total_members_num):
            base = j * self.params_per_member
            per_member: tp.List[tp.List[Tensor]] = []
            for e in range(self.num_species):
                start = base + self.param_offsets[e]
                per_member.append(self._flat_params[start:start + 2 * self.num_layers[e]])
            out.append(per_member)
        return out
