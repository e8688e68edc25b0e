"""Fused ensemble networks: every member of an ANI ensemble evaluated at once.

``fuse_charge_networks(charge_networks, aev_computer)`` does the same for
the charge networks of TorchANI's ANImbis (:class:`FusedChargeNetworks`).
``fuse_networks(networks, aev_computer)`` turns TorchANI's ``Ensemble`` (or one
``ANINetworks``) into a :class:`FusedEnsemble` (:class:`FusedNetworks`) that
keeps TorchANI's member modules (the state dict is unchanged) and evaluates
every element group and member together: on the CPU in one C++ op
(``torchani_fast::ensemble_mlp``), elsewhere as batched GEMMs. How it works
(zero blocks and chunks, packed weights and their invalidation, training,
backward passes): docs/design.md.

Modules: ``fused`` (the modules and their evaluation), ``packing`` (packed
weights and how a change of the parameters is seen), ``grouping`` (atoms by
element for layer 1), ``recompute`` (the differentiable ATen path), ``layout``
(the AEV layout and what can be fused).
"""

from .fused import (MAX_FIRST_LAYER_PACKS, SMALL_GROUP_ATOMS, SPLIT_MIN_ATOMS, FusedChargeNetworks,
                    FusedEnsemble, FusedNetworks, _FusedBase, fuse_charge_networks, fuse_networks)
from .layout import aev_columns, charge_unsupported_reason, linears, unsupported_reason
from .recompute import _Recompute

__all__ = ["FusedEnsemble", "FusedNetworks", "FusedChargeNetworks", "fuse_networks",
           "fuse_charge_networks", "unsupported_reason", "charge_unsupported_reason", "aev_columns",
           "linears"]
