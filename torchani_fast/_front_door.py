"""The classes of patched models, and the one in-place class change (:func:`swap_class`).

``patch()`` keeps the model object and gives it a subclass of its TorchANI class
with torchani_fast's mixins in front: Python-side
conveniences (``ase()``, ``energies_forces()``) and the methods TorchScript
compiles in TorchANI's place (``_check_inputs``, ``compute_from_neighbors``).
TorchANI's own classes have theirs written out, by name, in ``patch.py``
(``PatchedANI``, ``PatchedANIq``) and ``legacy.py`` (``PatchedBuiltinModel``,
``PatchedBuiltinEnsemble``). A user's subclass of them gets one made here on
first use; this module's ``__getattr__`` finds it by name, which is how pickle
(``torch.save(model)``) looks classes up.
"""
import typing as tp

__all__ = ["front_door_class", "swap_class"]

_MADE: tp.Dict[type, type] = {}  # base -> the class made for it


def front_door_class(base: type, written: tp.Dict[type, type],
                     mixins: tp.Callable[[type], tp.Tuple[type, ...]]) -> type:
    """The patched class of ``base``: ``written[base]``, else ``mixins(base) + (base,)``
    made once."""
    cls = written.get(base) or _MADE.get(base)
    if cls is None:
        name = "Patched" + base.__name__
        cls = type(name, mixins(base) + (base,),
                   {"__module__": __name__, "__qualname__": name, "__doc__": base.__doc__})
        _MADE[base] = cls
    return cls


def swap_class(obj: object, cls: type) -> None:
    """The one in-place class change of torchani_fast (same object, buffers and state
    dict): :mod:`torchani_fast.patch` (TorchANI 2.7-2.9, its mapping ``PATCHED_CLASSES``)
    and :mod:`torchani_fast.legacy` (TorchANI 2.2.4's classes) call it."""
    if type(obj) is not cls:
        obj.__class__ = cls


def __getattr__(name: str) -> type:
    for cls in _MADE.values():
        if cls.__name__ == name:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
