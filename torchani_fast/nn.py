"""Fused ensemble networks: every member of an ANI ensemble evaluated at once.

TorchANI's ``Ensemble`` runs 8 members x 7 element networks one after another,
each a chain of small matrix products. :class:`FusedEnsemble` evaluates, for each
element present in the input, all active members together, CELU(alpha=0.1)
after every layer but the last:

- **CPU** (eager and TorchScript): one C++ op for all groups and members, ``ensemble_mlp``
  (``kernels/ensemble_cpu.cpp``). Per block of up to 96 atoms and member it runs the
  forward pass and, when forces are wanted, the input gradient of the members'
  sum, J = d(sum_k out_k)/dx, right after it, with the member's weights still in
  cache; nothing is kept for backward but the AEV and J (about 10% of the
  activations' size). float32 on AVX2 CPUs multiplies with its own kernels on
  16-column panel copies of the weights (W and W^T; with AVX-512 every block,
  and with AVX2 blocks of 1-2 atoms, take their backward from W, which the
  forward has just read), made once and cached;
  other CPUs and float64 call BLAS. ``native_cpu = False`` turns it off.
  Eager and scripted models call it through ``ensemble_atomic`` (values) or
  ``ensemble_energies`` (their reduction to energies), the same
  kernels with their autograd in C++ (``kernels/autograd.cpp``), so a model
  saved with ``torch.jit.save`` and loaded without Python (OpenMM-Torch) gets
  them too.
- **Elsewhere** (CUDA, training): layer 1 as one wide GEMM
  ``(atoms, K) @ (K, members * width)`` (a batched GEMM over the members for
  groups of up to ``small_group_atoms``), later layers as one batched GEMM
  (``baddbmm``) over the members, through autograd.

**Zero blocks.** An AEV column belongs to one neighbour element (radial block
``s*R .. s*R+R-1``) or to one pair of neighbour elements (angular block
``S*R + p*W ..``, ``p = triu_index[s1, s2]``). Columns of elements absent from the
input are exact zeros, so layer 1 only multiplies the columns of the elements
present: about 40% of them for a CHNO molecule, 13% for water. (So an AEV not
computed for these species, with nonzero values in such columns, would be read
as if they were zero, and the gradient with respect to them is 0; forces are
unaffected, as those columns do not depend on the coordinates.) In large inputs
(``SPLIT_MIN_ATOMS``) an element's atoms are further split in two groups when a
present element is seen (within the radial cutoff) by at most a quarter of them,
like the one S atom of a protein: the atoms that see none of these "rare"
elements skip their columns too (the columns are exact zeros for those atoms,
and so is their derivative, so forces stay exact). A zero radial block must
then mean "no neighbour of that element", which holds for torchani_fast's AEV
computer only: TorchANI's float32 cosine cutoff, 0.5 cos(pi r / Rc) + 0.5,
rounds to exactly 0 within ~4e-4 A of Rc, where its slope does not vanish, and
a split on such AEVs dropped force terms of up to 6e-6 Ha/A (a hydrogen there
from the one S of 1hz5). Ours computes that stretch accurately (a nonzero
value); ``zero_blocks_exact`` records that the AEVs come from it, and is False
(no split) for networks fused with another AEV computer or none.

**Zero chunks (CPU, float32).** Beyond the input's composition, most atoms lack
neighbour pairs of some kinds (an H of a protein with no N-N pair within 3.5 A),
so their AEV has more zero blocks. The C++ op multiplies layer 1 tile by tile
(6 atoms) and skips the 16-column chunks that are 0 in all of a tile's atoms;
``group_atoms`` orders each group's atoms by their zero chunks so that tiles
share them (on 1hz5 21% fewer layer-1 products than the groups alone). The
forward is exact (the skipped products are exact zeros); the input gradient J
skips them only with ``zero_blocks_exact`` (their derivative is then 0 too),
so the gradient of the networks with respect to such an AEV entry reads 0.

**Packing.** TorchANI's member modules stay registered under their usual names
(so ``state_dict`` keys, strict loading and ``model[i]`` are unchanged) and are
the only source of truth. Packed copies are derived from them and cached: the
later layers once, layer 1 once per (element, set of elements whose columns are
used); at most ``max_first_layer_packs`` of the latter are kept, oldest dropped
first. The CPU op's float32 panel copies (W and W^T of each hidden layer) are
kept with the packs they come from, so the cache holds about three copies of
the weights it uses (ANI-2x on a CHNOS protein: 103 MB, the model's own
parameters being 55 MB). The cache is dropped by ``.to()``/``.double()``,
``load_state_dict``, ``set_active_members`` and :meth:`FusedEnsemble.clear_cache`,
and rebuilt when the parameters' dtype or device no longer match it. Every call
also checks the parameters (``weights_state``, one C++ pass: their version
counters and storages), so a parameter modified in place (``copy_`` or ``mul_``
under ``no_grad``, ``load_state_dict`` on a scripted module, an optimizer step)
or given new storage (``p.data = t``) is seen by the next call without
``clear_cache()``; so is, in an eager module, a new Parameter assigned to one of
the Linear layers (a parameter-registration hook flags the modules that read
it). Only writes through ``.data`` (``p.data.add_(x)``) escape this, as
``.data`` has a version counter of its own: call ``clear_cache()`` after them.
A Parameter assigned to a scripted module's Linear is not seen at all (the
scripted module keeps its own list of the parameters): script after editing.

**Training.** While any parameter requires grad the weights are packed on every
call with differentiable ops and nothing is cached (what was cached before is
dropped), so weight gradients are exact and an optimizer step is seen by the
next call, also once the parameters are frozen again.

**Per-call cost (eager CPU).** The op's arguments for a set of members and
groups are kept in a small dict next to the cache, so a call with a
composition seen before does no packing or list building in Python; the op
writes each atom's values in its own column (no scatter afterwards). Atoms are
grouped by one C++ pass (``group_atoms``), and energies (not atomic, not per
member) come reduced from the op itself (``ensemble_energies``): one op and one
autograd node where the reduction took four of each, which after the op has
streamed the weights through the caches cost 50-100 us per call.

**Backward passes.** The usual backward (energies, atomic energies or forces of
an ensemble mean: the same incoming gradient for every member) is ``grad * J``.
Any other (per-member values, QBCs, ``create_graph=True``) recomputes the
activations a chunk of atoms at a time with differentiable ATen ops, so it
can be differentiated again (Hessians). On other devices autograd keeps every
layer's pre-activation: about 19 kB per atom for ANI-2x (8 members); when that
exceeds ``recompute_min_bytes_gpu`` the same chunked recomputation is used
instead (``recompute_min_bytes``, 64 MiB, applies to a CPU module with
``native_cpu = False``). ``recompute_min_bytes_gpu`` defaults to -1: an eighth
of the GPU's memory (17 GiB on an H200: 100 000 waters keep their 1.9 GB, where
a fixed 1 GiB sent them through the chunks, 1024 atoms each, thousands of
kernel launches per call). A scripted module on another device keeps the
activations.
"""
import struct
import typing as tp
import weakref

import torch
from torch import Tensor
from torch.jit import Final
from torchani.nn import ANINetworks, AtomicContainer, Ensemble, TightCELU

__all__ = ["FusedEnsemble", "FusedNetworks", "fuse_networks", "unsupported_reason"]

MAX_FIRST_LAYER_PACKS = 32
SPLIT_MIN_ATOMS = 64  # smallest group of atoms worth a second layer-1 GEMM
RECOMPUTE_MIN_BYTES = 64 * 1024 * 1024  # CPU: activations above this are not kept for backward
RECOMPUTE_MIN_BYTES_GPU = -1  # the same on other devices; -1: an eighth of the device's memory
RECOMPUTE_FALLBACK_BYTES = 1024 * 1024 * 1024  # for -1 where the memory size is not known
RECOMPUTE_CHUNK_ATOMS = 1024  # atoms per chunk: temporaries of a few MB, which glibc reuses without growing the heap
# Up to this many atoms of one element, layer 1 runs as a batched GEMM over the
# members (x broadcast, the packed weights viewed per member) rather than one wide
# GEMM: 1.4-2x faster there on the CPU (MKL splits the batch across threads).
SMALL_GROUP_ATOMS = 256
CELU_ALPHA = 0.1
# The networks op's weight arguments: (columns, first, packs, panels, layers).
OpArgs = tp.Tuple[tp.List[Tensor], tp.List[Tensor], tp.List[Tensor], tp.List[Tensor], tp.List[int]]


class _FusedBase(AtomicContainer):
    """Shared evaluation; the subclasses only differ in how members are registered.

    Not built directly: use :func:`fuse_networks` or ``FusedEnsemble.from_torchani``.
    """

    __jit_ignored_attributes__ = ["_eager_cache", "_native_plans", "_params_watch", "_params_replaced"]

    is_ensemble: Final[bool]
    max_first_layer_packs: int
    split_min_atoms: int
    zero_blocks_exact: bool
    recompute_min_bytes: int
    recompute_min_bytes_gpu: int
    small_group_atoms: int
    native_cpu: bool  # CPU calls use the C++ ops ensemble_atomic / ensemble_energies (module doc)
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
    _weights_fingerprint: int  # weights_state of _flat_params when the cache was last checked

    def _init_layout(self, aev_computer: tp.Optional[torch.nn.Module]) -> None:
        atomics = self._member_atomics()[0]
        self.num_species = len(atomics)
        self.num_layers = [len(a.layers) + 1 for a in atomics]
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
        self.hidden_widths = [sum(int(lin.out_features) for lin in _linears(a)[:-1]) for a in atomics]
        w = _linears(atomics[0])[0].weight
        # Follows the parameters through .to()/.double(): the cache is checked against it.
        self.register_buffer("_probe", torch.zeros(0, dtype=w.dtype, device=w.device), persistent=False)
        self._jit_cache = torch.classes.torchani_fast.PackCache()  # the cache of a scripted module
        self._weights_fingerprint = -1
        self._eager_cache = {}  # the cache of the eager module (invisible to TorchScript)
        self._native_plans = {}  # eager CPU: the op's arguments per (members, groups), see _native_plan

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
        values = self._member_atomic(elem_idxs.flatten(), aevs.flatten(0, 1),
                                     elem_idxs.shape[0] if reduce else 0)
        return self._reduce(values, elem_idxs.shape[0], elem_idxs.shape[1], atomic, ensemble_values)

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
        ``torch.jit.save`` and copies never carry the cache (a scripted module
        keeps it in a ``torch.classes.torchani_fast.PackCache``, which pickles as
        empty): a saved ANI-2x is the size of TorchANI's file (55 MB) after any call.
        """
        if torch.jit.is_scripting():
            self._jit_cache.dict().clear()
        else:
            self._eager_clear()

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
        atoms, group_elem, group_mask, group_size = self._groups(flat, aev)
        if len(group_size) == 0:
            return aev.new_zeros((k, flat.shape[0]))
        return self._grouped_atomic(flat.shape[0], aev, atoms, group_elem, group_mask, group_size,
                                    molecules)

    def _grouped_atomic(
        self, num_atoms: int, aev: Tensor, atoms: Tensor, group_elem: tp.List[int],
        group_mask: tp.List[int], group_size: tp.List[int], molecules: int = 0,
    ) -> Tensor:
        """``_member_atomic`` once the groups are known: no host synchronisation."""
        act = self._evaluated_members()
        k = len(act)
        if aev.device.type == "cpu" and self.native_cpu:
            args = self._native_args(act, group_elem, group_mask)
            if args is not None:
                # The C++ kernels through ensemble_atomic / ensemble_energies,
                # whose autograd is in C++ (a scripted model loaded without
                # Python differentiates too).
                columns, first, packs, panels, layers = args
                if molecules > 0:
                    divisor = len(self.active_members_idxs) if self.is_ensemble else 1
                    return torch.ops.torchani_fast.ensemble_energies(
                        aev.contiguous(), atoms, group_size, columns, first, packs, panels, layers, k,
                        molecules, divisor, self.zero_blocks_exact)
                return torch.ops.torchani_fast.ensemble_atomic(
                    aev.contiguous(), atoms, group_size, columns, first, packs, panels, layers, k,
                    self.zero_blocks_exact)
        ws: tp.List[tp.List[tp.List[Tensor]]] = []
        training = self._check_weights()
        if training:
            # Differentiable packing on every call, nothing cached: exact weight
            # gradients, and an optimizer step is seen by the next call. Packs
            # cached before training began would be stale once it ends: dropped.
            self._cache().clear()
            if not torch.jit.is_scripting():
                self._eager_plans_clear()
            ws = self._member_weights()
            hidden = self._pack_hidden(ws, act)
        else:
            hidden = self._cached_hidden(act)
        if not training and self._recompute(aev, group_elem, group_size, k):
            return self._eager_recompute(aev, atoms, hidden, act, group_elem, group_mask, group_size)
        out = aev.new_zeros((k, num_atoms))
        xs = aev.index_select(0, atoms).split(group_size)
        outs: tp.List[Tensor] = []
        for g in range(len(group_size)):
            e = group_elem[g]
            if training:
                first = self._pack_first(ws, act, e, group_mask[g])
            else:
                first = self._cached_first(act, e, group_mask[g])
            cols = first[0]
            x = xs[g] if cols.shape[0] == aev.shape[1] else xs[g].index_select(1, cols)
            o = self.offsets[e]
            packs = hidden[o:o + 2 * self.num_layers[e] - 1]
            outs.append(_mlp_values(x, first[1], packs, k, self.small_group_atoms)[0])
        return out.index_copy(1, atoms, torch.cat(outs, 1))

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
        return _Recompute.apply(aev, atoms, group_size, args, len(act), self.small_group_atoms)

    def _native_args(self, act: tp.List[int], group_elem: tp.List[int],
                     group_mask: tp.List[int]) -> tp.Optional[OpArgs]:
        """The op's weight arguments for these groups, or None while a parameter
        they come from requires grad: training takes the PyTorch path, which
        packs on every call (an optimizer step changes the weights in place,
        unseen by the cache), with or without grad mode."""
        if torch.jit.is_scripting():
            if self._check_weights():
                return None
            return self._op_args(act, group_elem, group_mask, self._cached_hidden(act), True)
        return self._native_plan(act, group_elem, group_mask)

    @torch.jit.unused
    def _native_plan(self, act: tp.List[int], group_elem: tp.List[int],
                     group_mask: tp.List[int]) -> tp.Optional[OpArgs]:
        """``_native_args`` of an eager module: cached per (members, groups) (a
        call with a composition seen before costs one dict lookup here), with
        the weights check (``weights_state``) on the parameters they come from only."""
        key = (_bitmask(act), tuple(group_elem), tuple(group_mask))
        plan = self._native_plans.get(key)
        if plan is not None and not self._params_replaced and not self._stale(plan.op_args[1][0]):
            requires_grad, fingerprint = plan.watch.state()
            if not requires_grad and fingerprint == plan.fingerprint:
                return plan.op_args
        # A new plan, or one whose parameters changed or require grad: check all
        # of them, which drops every pack and plan if any changed since.
        if self._check_weights():
            return None  # nothing built or cached: the weights may change in place
        per_member = self._member_weights()
        watch = torch.classes.torchani_fast.WeightsWatch(
            [p for j in act for e in set(group_elem) for p in per_member[j][e]])
        with torch.inference_mode(False):  # panels usable by later calls with forces
            plan = _NativePlan(self._op_args(act, group_elem, group_mask, self._cached_hidden(act), True),
                               watch, watch.state()[1])
        if len(self._native_plans) >= self.max_first_layer_packs:
            self._native_plans.pop(next(iter(self._native_plans)))  # the oldest
        self._native_plans[key] = plan
        return plan.op_args

    def _op_args(self, act: tp.List[int], group_elem: tp.List[int], group_mask: tp.List[int],
                 hidden: tp.List[Tensor], with_panels: bool) -> OpArgs:
        """(columns, first, packs, panels, layers) of these groups, as ``ensemble_mlp``
        takes them. Panels only when asked for, float32 and every width a multiple
        of 16; else an empty list."""
        columns: tp.List[Tensor] = []
        first: tp.List[Tensor] = []
        packs: tp.List[Tensor] = []
        panels: tp.List[Tensor] = []
        layers: tp.List[int] = []
        use_panels = with_panels and self._probe.dtype == torch.float32
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
                group_panels = self._panels(act, e, cached, hidden_e)
                if group_panels is None:
                    use_panels = False
                else:
                    panels.extend(group_panels)
        if not use_panels:
            panels = []
        return (columns, first, packs, panels, layers)

    def _panels(self, act: tp.List[int], elem: int, first: tp.List[Tensor],
                hidden_e: tp.List[Tensor]) -> tp.Optional[tp.List[Tensor]]:
        """float32 panel copies of one group's hidden-layer weights for ensemble_mlp, cached.

        Per hidden layer, W as (k, d_out/16, d_in, 16) and W^T as (k, d_in/16,
        d_out, 16): 16-column panels, each contiguous (kernels/small_gemm.h).
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
        if len(first) == 2:
            first.extend(_panel_pair(w1.view(w1.shape[0], k, -1).transpose(0, 1)))
        cache = self._cache()
        key = -(1 << 40) * (elem + 1) - _bitmask(act)
        later = cache.get(key)
        if later is None:
            built: tp.List[Tensor] = []
            for l in range(1, len(hidden_e) - 2, 2):
                built.extend(_panel_pair(hidden_e[l]))
            cache[key] = built
            later = built
        return first[2:4] + later

    @torch.jit.unused
    def fixed_groups(self, elem_idxs: Tensor) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
        """The grouping of these atoms by element, for :meth:`energies_fixed` (one host sync).

        For loops over geometries of one system (MD, optimisation), where the
        elements never change: with the groups computed once, an evaluation has
        no host synchronisation and can be captured in a CUDA graph.
        """
        return self._composition_groups(elem_idxs.flatten())

    @torch.jit.unused
    def energies_fixed(
        self, elem_idxs: Tensor, aevs: Tensor,
        groups: tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]],
    ) -> Tensor:
        """Energies (M,) like ``forward(elem_idxs, aevs)``, with groups from :meth:`fixed_groups`."""
        atoms, elems, masks, sizes = groups
        num_atoms = elem_idxs.numel()
        k = len(self._evaluated_members())
        if k == 0 or not sizes:
            values = aevs.new_zeros((k, num_atoms))
        else:
            values = self._grouped_atomic(num_atoms, aevs.flatten(0, 1), atoms, elems, masks, sizes,
                                          elem_idxs.shape[0])
        return self._reduce(values, elem_idxs.shape[0], elem_idxs.shape[1], False, False)

    def _composition_groups(self, flat: Tensor) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
        """``_groups`` without splits: one group per element present, all reading every present block."""
        if flat.device.type == "cpu":
            return self._native_groups(flat, None)
        return self._aten_composition_groups(flat)

    def _aten_composition_groups(self, flat: Tensor) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
        counts: tp.List[int] = torch.bincount(flat + 1, minlength=self.num_species + 1).tolist()
        return self._groups_from_counts(flat, counts)

    def _groups_from_counts(self, flat: Tensor, counts: tp.List[int]) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
        """``_composition_groups`` from the atom counts [padding, element 0, element 1, ...]."""
        n_atoms = 0
        for e in range(self.num_species):
            n_atoms += counts[e + 1]
        # Atoms ordered by element with one stable sort, padding first.
        atoms = torch.argsort(flat, stable=True).narrow(0, counts[0], n_atoms)
        composition = 0
        for e in range(self.num_species):
            if counts[e + 1] > 0:
                composition |= 1 << e
        elems: tp.List[int] = []
        masks: tp.List[int] = []
        sizes: tp.List[int] = []
        for e in range(self.num_species):
            if counts[e + 1] > 0:
                elems.append(e)
                masks.append(composition)
                sizes.append(counts[e + 1])
        return atoms, elems, masks, sizes

    def _native_groups(self, flat: Tensor, aev: tp.Optional[Tensor]) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
        """``_groups`` (with ``aev``) or ``_composition_groups`` (without) in one C++
        pass over the atoms (``group_atoms``), for CPU tensors: the ATen version
        below took ~15 small ops, 1.4-1.7 ms per call for 1 000-3 000 atoms."""
        atoms, info = torch.ops.torchani_fast.group_atoms(
            flat, self.num_species, aev, self.radial_sublen, self._split_min_atoms())
        rows: tp.List[tp.List[int]] = info.tolist()
        elems: tp.List[int] = []
        masks: tp.List[int] = []
        sizes: tp.List[int] = []
        for row in rows:
            elems.append(row[0])
            masks.append(row[1])
            sizes.append(row[2])
        return atoms, elems, masks, sizes

    def _groups(self, flat: Tensor, aev: Tensor) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
        """How atoms are grouped for layer 1.

        Returns the atoms of all groups, group after group (no padding), and per
        group its element, the bitmask of elements whose AEV columns it uses,
        and its size. One host sync (cheap on CPU), two when a split is considered.
        """
        if flat.device.type == "cpu":
            return self._native_groups(flat, aev)
        return self._aten_groups(flat, aev)

    def _split_min_atoms(self) -> int:
        """``split_min_atoms`` where the rare-element split is allowed (AEVs whose
        zero blocks mean "no such neighbour"), else 0: no split."""
        return self.split_min_atoms if self.zero_blocks_exact else 0

    def _aten_groups(self, flat: Tensor, aev: Tensor) -> tp.Tuple[Tensor, tp.List[int], tp.List[int], tp.List[int]]:
        """``_groups`` with ATen ops (any device; the CPU takes ``group_atoms``)."""
        num_species = self.num_species
        r = self.radial_sublen
        split_min = self._split_min_atoms()
        if r == 0 or split_min <= 0 or flat.shape[0] < 2 * split_min:
            return self._aten_composition_groups(flat)
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
            return self._groups_from_counts(flat, counts)
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

    def _evaluated_members(self) -> tp.List[int]:
        if not self.is_ensemble:
            return [0]
        act: tp.List[int] = []
        for j in range(self.total_members_num):
            if j in self.active_members_idxs:
                act.append(j)
        return act

    # -- packing and the cache ------------------------------------------------------------

    def _cached_hidden(self, act: tp.List[int]) -> tp.List[Tensor]:
        """Packs of layers 2..L (and layer 1's biases) of these members, cached."""
        cache = self._cache()
        key = -1 - _bitmask(act)
        hidden = cache.get(key)
        if hidden is None or self._stale(hidden[0]):
            cache.clear()
            hidden = self._build(act, -1, 0)
            cache[key] = hidden
        return hidden

    def _cached_first(self, act: tp.List[int], elem: int, mask: int) -> tp.List[Tensor]:
        """[AEV columns, layer-1 weights (K, k*d1)] of ``elem`` reading the columns of ``mask``."""
        cache = self._cache()
        # Nonnegative keys, distinct for each (members, element, element set).
        key = ((_bitmask(act) * self.num_species + elem) << self.num_species) | mask
        first = cache.get(key)
        if first is None or self._stale(first[1]):
            if len(cache) > self.max_first_layer_packs:
                oldest = -1
                for k in cache.keys():  # insertion order: drop the oldest layer-1 pack
                    if k >= 0:
                        oldest = k
                        break
                cache.pop(oldest)
                if not torch.jit.is_scripting():
                    self._eager_plans_clear()  # they may hold the dropped pack
            first = self._build(act, elem, mask)
            cache[key] = first
        return first

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
        self._refresh_params()
        with torch.inference_mode(False), torch.no_grad():
            ws = self._member_weights()
            if elem < 0:
                return self._pack_hidden(ws, act)
            return self._pack_first(ws, act, elem, mask)

    def _pack_hidden(self, ws: tp.List[tp.List[tp.List[Tensor]]], act: tp.List[int]) -> tp.List[Tensor]:
        """Per element: bias of layer 1 (k*d1,), then W_l (k, d_in, d_out) and b_l (k, 1, d_out)."""
        out: tp.List[Tensor] = []
        k = len(act)
        for e in range(self.num_species):
            b1 = ws[act[0]][e][1]
            width = b1.shape[0]
            packed = b1.new_empty([k * width])
            for i, j in enumerate(act):
                packed.narrow(0, i * width, width).copy_(ws[j][e][1])
            out.append(packed)
            for l in range(1, self.num_layers[e]):
                w = ws[act[0]][e][2 * l]
                weights = w.new_empty([k, w.shape[1], w.shape[0]])
                biases = w.new_empty([k, 1, w.shape[0]])
                for i, j in enumerate(act):
                    weights[i].copy_(ws[j][e][2 * l].t())
                    biases[i, 0].copy_(ws[j][e][2 * l + 1])
                out.append(weights)
                out.append(biases)
        return out

    def _pack_first(
        self, ws: tp.List[tp.List[tp.List[Tensor]]], act: tp.List[int], elem: int, mask: int
    ) -> tp.List[Tensor]:
        """[AEV columns of the elements in ``mask``, ``elem``'s layer-1 weights (K, k*d1)]."""
        present = [(mask >> s) & 1 == 1 for s in range(self.num_species)]
        w0 = ws[act[0]][elem][0]
        cols = torch.tensor(self._columns(present), dtype=torch.long, device=w0.device)
        full = cols.shape[0] == self.in_dim
        width = w0.shape[0]
        packed = w0.new_empty([cols.shape[0], len(act) * width])
        for i, j in enumerate(act):
            w = ws[j][elem][0] if full else ws[j][elem][0].index_select(1, cols)
            packed.narrow(1, i * width, width).copy_(w.t())
        return [cols, packed]

    def _columns(self, present: tp.List[bool]) -> tp.List[int]:
        """AEV columns that can be nonzero when only the ``present`` elements occur."""
        if self.radial_sublen == 0:
            return [c for c in range(self.in_dim)]
        return aev_columns(present, self.radial_sublen, self.angular_sublen, self.triu)

    def _cache(self) -> tp.Dict[int, tp.List[Tensor]]:
        if torch.jit.is_scripting():
            return self._jit_cache.dict()
        return self._eager_cache_dict()

    @torch.jit.unused
    def _eager_cache_dict(self) -> tp.Dict[int, tp.List[Tensor]]:
        return self._eager_cache

    @torch.jit.unused
    def _eager_clear(self) -> None:
        self._eager_cache = {}
        self._eager_plans_clear()
        self._refresh_params()

    @torch.jit.unused
    def _eager_plans_clear(self) -> None:
        self._native_plans = {}

    @torch.jit.unused
    def _refresh_params(self) -> None:
        # (Eager only; also picks up parameters replaced by assignment.)
        linears = [lin for atomics in self._member_atomics() for a in atomics for lin in _linears(a)]
        self._flat_params = [p for lin in linears for p in (lin.weight, lin.bias)]
        self._params_watch = torch.classes.torchani_fast.WeightsWatch(self._flat_params)
        for lin in linears:
            _watch_linear(lin, self)
        self._params_replaced = False

    def _check_weights(self) -> bool:
        """Whether a parameter requires grad (training: nothing may be cached).
        Otherwise the cache is dropped if a parameter changed since the last
        check: modified in place (``load_state_dict``, ``copy_``, an optimizer
        step; their version counters), or given new storage (``p.data = t``)."""
        if torch.jit.is_scripting():
            requires_grad, fingerprint = torch.ops.torchani_fast.weights_state(self._flat_params)
        else:
            requires_grad, fingerprint = self._eager_weights_state()
        if requires_grad:
            return True
        if fingerprint != self._weights_fingerprint:
            self.clear_cache()
            self._weights_fingerprint = fingerprint
        return False

    @torch.jit.unused
    def _eager_weights_state(self) -> tp.Tuple[bool, int]:
        if self._params_replaced:  # a Linear got a new Parameter object: re-read them all
            self._eager_clear()
        # (The list held in C++: 17 us a call for 256 tensors, as the old
        # any(requires_grad) scan; converting a Python list for the op: 43 us.)
        return self._params_watch.state()

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
        state["_eager_cache"] = {}
        state["_native_plans"] = {}
        state["_jit_cache"] = None  # a C++ object, remade by __setstate__
        state["_params_watch"] = None  # a C++ object, remade by __setstate__
        return state

    def __setstate__(self, state):
        # Modules pickled by an older torchani_fast get the attributes added since.
        state.setdefault("native_cpu", True)
        state.setdefault("zero_blocks_exact", False)  # (no split, J computed everywhere: exact)
        state.setdefault("_native_plans", {})
        state.setdefault("_weights_fingerprint", -1)
        super().__setstate__(state)
        self._refresh_params()  # and the C++ watch over them
        self._jit_cache = torch.classes.torchani_fast.PackCache()

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every submodule: each scripted copy
        # gets a cache of its own instead of sharing this module's.
        self._jit_cache = torch.classes.torchani_fast.PackCache()
        return self

    def extra_repr(self) -> str:
        skip = "by element" if self.radial_sublen else "off"
        return (
            f"members={self.total_members_num}, active={self.active_members_idxs}, "
            f"zero-block skipping {skip}"
        )


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


# -- the recomputing path ----------------------------------------------------------------


def _first_layer(x: Tensor, w1: Tensor, b1: Tensor, k: int, small: int) -> Tensor:
    """Layer 1 of all ``k`` members, (k, n, d1), from x (n, K), w1 (K, k*d1), b1 (k*d1,)."""
    n = x.shape[0]
    in_dim = x.shape[1]
    if n <= small:
        return torch.baddbmm(b1.view(k, 1, -1), x.unsqueeze(0).expand(k, n, in_dim),
                             w1.view(in_dim, k, -1).transpose(0, 1))
    return torch.addmm(b1, x, w1).view(n, k, -1).transpose(0, 1)  # a view


def _panel_pair(w: Tensor) -> tp.List[Tensor]:
    """W (k, d_in, d_out) as 16-column panels: [(k, d_out/16, d_in, 16), W^T's (k, d_in/16, d_out, 16)]."""
    k, d_in, d_out = w.shape[0], w.shape[1], w.shape[2]
    with torch.no_grad():
        fwd = w.reshape(k, d_in, d_out // 16, 16).permute(0, 2, 1, 3).contiguous()
        bwd = w.reshape(k, d_in // 16, 16, d_out).permute(0, 1, 3, 2).contiguous()
    return [fwd, bwd]


def _gather(aev: Tensor, atoms: Tensor, cols: tp.Optional[Tensor]) -> Tensor:
    x = aev.index_select(0, atoms)
    return x if cols is None else x.index_select(1, cols)


def _mlp_values(
    x: Tensor, w1: Tensor, packs: tp.List[Tensor], k: int, small: int
) -> tp.Tuple[Tensor, tp.List[Tensor]]:
    """Outputs (k, n) of one group's networks and the pre-activations (k, n, d) of the hidden layers.

    ``packs`` = [b1 (k*d1,), W2 (k, d1, d2), b2 (k, 1, d2), ...] as in ``_pack_hidden``.
    CELU is not applied in place: the in-place backward recovers exp(x/alpha) from
    the output, which does not reproduce TorchANI's float64 forces to 1e-9.
    """
    n = x.shape[0]
    h = _first_layer(x, w1, packs[0], k, small)
    pre: tp.List[Tensor] = []
    for l in range(1, (len(packs) + 1) // 2):
        pre.append(h)
        h = torch.baddbmm(packs[2 * l], torch.nn.functional.celu(h, 0.1), packs[2 * l - 1])
    return h.reshape(k, n), pre


# PyTorch's CELU backward (derivatives.yaml: elu_backward(..., 1.0 / alpha.toFloat(), ...))
# scales by 1 / float32(alpha) even in float64: alpha c exp(c h) with c = 9.99999985
# instead of exp(10 h). TorchANI's float64 forces carry that 1.5e-8 relative error;
# calling the same kernel gives TorchANI's forces bit for bit (and it is differentiable).
_CELU_INPUT_SCALE = 1.0 / struct.unpack("f", struct.pack("f", CELU_ALPHA))[0]


def _celu_backward(grad: Tensor, pre: Tensor) -> Tensor:
    return torch.ops.aten.elu_backward(grad, CELU_ALPHA, 1.0, _CELU_INPUT_SCALE, False, pre)


def _mlp_input_grad(
    grad: Tensor, w1: Tensor, packs: tp.List[Tensor], pre: tp.List[Tensor], k: int, small: int
) -> Tensor:
    """d(sum grad * outputs) / dx for the outputs of ``_mlp_values``: (n, K)."""
    n = grad.shape[1]
    in_dim = w1.shape[0]
    g = grad.unsqueeze(2)  # (k, n, 1)
    for l in range(len(pre), 0, -1):
        g = _celu_backward(torch.bmm(g, packs[2 * l - 1].transpose(1, 2)), pre[l - 1])  # (k, n, d_l)
    if n <= small:
        return torch.bmm(g, w1.view(in_dim, k, -1).permute(1, 2, 0)).sum(0)
    return g.transpose(0, 1).reshape(n, -1).mm(w1.t())


class _NativePlan(tp.NamedTuple):
    """What ``ensemble_mlp`` needs besides the AEV and atoms, for one set of
    members and groups (``_FusedBase._native_plan``)."""

    op_args: OpArgs  # (columns, first, packs, panels, layers), as in the op's schema
    watch: tp.Any  # WeightsWatch of the parameters these packs come from
    fingerprint: int  # its state when the packs were made


# Each Linear whose parameters a fused module reads -> those modules. A
# Parameter assigned to such a Linear (``lin.weight = Parameter(w)``) is a new
# tensor the modules' parameter list does not hold: the hook below flags them,
# and their next call re-reads the parameters and drops the cache. (Scripted
# modules are not covered: assignment to them bypasses nn.Module.)
# Keyed by id(): the hook sees every module built in the process, and hashing
# one could fail (a subclass defining __eq__ only is unhashable).
_PACKED_BY: tp.Dict[int, tp.Tuple["weakref.ref", "weakref.WeakSet"]] = {}


def _watch_linear(lin: torch.nn.Module, fused: torch.nn.Module) -> None:
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


torch.nn.modules.module.register_module_parameter_registration_hook(_on_parameter_registered)


def _per_group(args: tp.Tuple, features: int) -> tp.List:
    """Per group (AEV columns or None for all, layer-1 weights, later packs), from
    the op's arguments (columns, first, packs, panels, layers)."""
    columns, first, packs, _, layers = args
    out = []
    p = 0
    for cols, w1, nl in zip(columns, first, layers):
        out.append((None if cols.shape[0] == features else cols, w1, packs[p:p + 2 * nl - 1]))
        p += 2 * nl - 1
    return out


class _Recompute(torch.autograd.Function):
    """Atomic energies (k, atoms) of all groups without keeping the activations for backward.

    For inputs whose activations would exceed the memory budget where the C++
    op does not run (other devices, ``native_cpu = False``). ``atoms`` (grouped,
    runs of ``sizes``) are the evaluated rows of ``aev``; ``args`` are the
    groups' weights as ``ensemble_mlp`` takes them (columns, layer-1 weights
    (K, k*d1), the other packs, panels, layers), constants here (the path is
    only taken when they need no grad). The backward recomputes the activations
    a chunk of atoms at a time, differentiably under ``create_graph=True``.
    """

    @staticmethod
    def forward(ctx, aev: Tensor, atoms: Tensor, sizes: tp.List[int], args: tp.Tuple, k: int,
                small: int) -> Tensor:
        ctx.atoms = atoms
        ctx.sizes = sizes
        ctx.args = args
        ctx.k = k
        ctx.small = small
        ctx.save_for_backward(aev)
        outs = []
        for atoms_g, (cols, w1, packs) in zip(atoms.split(sizes), _per_group(args, aev.shape[1])):
            for chunk in atoms_g.split(RECOMPUTE_CHUNK_ATOMS):
                outs.append(_mlp_values(_gather(aev, chunk, cols), w1, packs, k, small)[0])
        return aev.new_zeros((k, aev.shape[0])).index_copy_(1, atoms, torch.cat(outs, 1))

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (aev,) = ctx.saved_tensors
        # Grad mode is on here only under create_graph=True: then the backward is
        # recorded (out-of-place writes) and can be differentiated again.
        differentiable = torch.is_grad_enabled()
        grad = aev.new_zeros(aev.shape)
        for atoms_g, (cols, w1, packs) in zip(ctx.atoms.split(ctx.sizes), _per_group(ctx.args, aev.shape[1])):
            for chunk in atoms_g.split(RECOMPUTE_CHUNK_ATOMS):
                pre = _mlp_values(_gather(aev, chunk, cols), w1, packs, ctx.k, ctx.small)[1]
                gx = _mlp_input_grad(grad_out.index_select(1, chunk), w1, packs, pre, ctx.k, ctx.small)
                index = (chunk,) if cols is None else (chunk.unsqueeze(1), cols.unsqueeze(0))
                grad = grad.index_put(index, gx) if differentiable else grad.index_put_(index, gx)
        return grad, None, None, None, None, None


_DEVICE_BUDGETS: tp.Dict[str, int] = {}


def _device_budget(device: torch.device) -> int:
    """An eighth of a CUDA device's memory, asked once per device; 1 GiB elsewhere."""
    if device.type != "cuda":
        return RECOMPUTE_FALLBACK_BYTES
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = "cuda:" + str(index)
    if key not in _DEVICE_BUDGETS:
        _DEVICE_BUDGETS[key] = int(torch.cuda.get_device_properties(index).total_memory) // 8
    return _DEVICE_BUDGETS[key]


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


def _linears(atomic: torch.nn.Module) -> tp.List[torch.nn.Linear]:
    return list(atomic.layers) + [atomic.final_layer]


def _zero_blocks_mean_no_neighbors(aev_computer) -> bool:
    """Whether the AEVs come from torchani_fast's computer, whose cosine cutoff is
    never exactly 0 inside the cutoff (``aev_math::cutoff_tail`` in the kernels)."""
    from .aev import AEVComputer

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
            lins = _linears(atomic)
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
