"""The versions torchani_fast supports: its own, TorchANI's, and which API is loaded."""
import re

import torchani

__version__ = "0.1.0"

SUPPORTED_TORCHANI = "2.7-2.9"
LEGACY_TORCHANI = "2.2.4"


def check_torchani_version(version: str) -> bool:
    """Refuse a TorchANI older than 2.7 by name, except the legacy 2.2.4 (whose
    models have another patch surface, torchani_fast.legacy), rather than fail
    later on a missing module. Returns whether ``version`` is the legacy one."""
    parts = [int(p) for p in re.findall(r"\d+", version)[:3]]
    if len(parts) >= 2 and tuple(parts[:2]) < (2, 7):
        if parts == [2, 2, 4]:
            return True
        raise ImportError(
            f"torchani_fast supports TorchANI {SUPPORTED_TORCHANI} and the legacy "
            f"{LEGACY_TORCHANI}, found TorchANI {version}: install `torchani>=2.7,<2.10` "
            f"(or `torchani=={LEGACY_TORCHANI}` for the legacy API)"
        )
    return False



#: Whether the loaded TorchANI is the legacy 2.2.4 (the patch surface of torchani_fast.legacy).
LEGACY = check_torchani_version(getattr(torchani, "__version__", ""))
