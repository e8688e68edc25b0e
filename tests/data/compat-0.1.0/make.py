"""How the files beside this script were made, with torchani_fast 0.1.0 (commit
1db64e7) and TorchANI 2.9.0: a small patched model (float32) pickled whole (``torch.save``)
and scripted (``torch.jit.save``), and an OpenMM force computation pickled as
OpenMM's XmlSerializer pickles it. tests/test_compat_files.py loads them with the
current package and compares with TorchANI run on the same weights.

    python tests/data/compat-0.1.0/make.py    # with torchani_fast 0.1.0 installed
"""
import pickle
import warnings
from pathlib import Path

import torch
import torchani

import torchani_fast

HERE = Path(__file__).resolve().parent


def small_model() -> torch.nn.Module:
    """A 2-member H/C/O ANI model with a small AEV and CELU networks, seeded."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torchani.arch.simple_ani(("H", "C", "O"), "wb97x-631gd", ensemble_size=2, radial_shifts=4,
                                         angular_shifts=2, sections=2, cutoff_fn="cosine", repulsion=False,
                                         activation="celu", bias=True,
                                         self_energies={"H": -0.5, "C": -37.8, "O": -75.0})
    for p in model.parameters():
        p.data.normal_(0.0, 0.2)
    return model


def main() -> None:
    model = torchani_fast.patch(small_model())
    torch.save(model, HERE / "model.pt")
    torch.jit.save(torch.jit.script(model), HERE / "scripted.pt")
    from torchani_fast.openmm.force import ANIComputation

    computation = ANIComputation.__new__(ANIComputation)  # (its state only: no weights loaded here)
    computation.__dict__.update(name="ani2x-fast", atomic_numbers=[8, 1, 1], periodic=False, model_index=None,
                                dtype=torch.float64, device=torch.device("cpu"))
    (HERE / "openmm_computation.pkl").write_bytes(pickle.dumps(computation))


if __name__ == "__main__":
    main()
