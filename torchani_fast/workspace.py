"""Memory the CPU ops reuse from one call to the next (csrc/common/workspace.h)."""
import torch

__all__ = ["Workspace", "WORKSPACE_MIN_BYTES"]

# Outputs smaller than this never come from a workspace (csrc/common/workspace.h;
# the package's __init__ loads the ops before this module).
WORKSPACE_MIN_BYTES: int = torch.classes.torchani_fast.Workspace.min_bytes()


class Workspace:
    """Memory for the CPU ops' large outputs, reused by the calls made inside ``with workspace:``.

    For a caller that evaluates one system again and again (MD, optimisation):
    :class:`~torchani_fast.EnergyForcesStep` and the ASE calculator own one.
    Inside the ``with`` block (in this thread, backward passes included) the
    AEV and the networks' AEV gradient reuse the memory of the previous call's
    once nothing references it any more; a tensor still held is never
    overwritten. Outputs above 32 MB then cost no page faults (float64,
    8 232 waters: 12% of an energy + forces call). Outside any workspace the
    ops allocate and keep nothing between calls. Blocks may nest; the memory is
    freed with the object. (csrc/common/workspace.h)

    Entering and leaving cost ~8 us: callers skip it where it would do
    nothing (:meth:`reuses`).
    """

    def __init__(self) -> None:
        self._held = torch.classes.torchani_fast.Workspace()

    @staticmethod
    def reuses(atoms: int, features: int, dtype: torch.dtype) -> bool:
        """Whether an AEV of ``atoms`` x ``features`` in ``dtype`` is large enough
        to come from a workspace (smaller outputs are always allocated)."""
        return atoms * features * (torch.finfo(dtype).bits // 8) >= WORKSPACE_MIN_BYTES

    @property
    def nbytes(self) -> int:
        """Bytes held now, for the next call to reuse."""
        return self._held.nbytes()

    def __enter__(self) -> "Workspace":
        self._held.enter()
        return self

    def __exit__(self, *exc) -> None:
        self._held.exit()

    def __reduce__(self):
        # The held memory is a cache: a copy (deepcopy, pickle) starts empty.
        return (Workspace, ())
