"""Output files of the ``torchani-fast`` command: never a file that looks complete but is not.

Every output goes first to ``<name>.partial`` next to the final name:

- :class:`PartialFile` is a text file that is appended to as results come in
  (each optimised structure, each MD frame or log line, flushed at once), and
  renamed to ``<name>`` (``os.replace``, atomic on one file system) only when
  :meth:`PartialFile.commit` is called after the whole run succeeded;
- :func:`write_atomic` writes a whole text (the energy JSON) the same way.

If the run fails or is interrupted (Ctrl-C, SIGTERM), the ``.partial`` file
stays with everything finished so far, and a file that already had the final
name is left untouched. A ``.partial`` left by an earlier run is overwritten.
"""
import os
import signal
import typing as tp
from pathlib import Path

__all__ = ["PartialFile", "partial_path", "check_writable", "write_atomic", "terminate_as_interrupt"]


def partial_path(path: Path) -> Path:
    """``path`` with ``.partial`` appended (``md.xyz`` -> ``md.xyz.partial``)."""
    return path.with_name(path.name + ".partial")


def check_writable(path: Path, option: str) -> None:
    """Raise ``OSError`` (with a message naming ``option``) unless ``path`` can be created."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise OSError(f"{option} {path}: is a directory")
    if not parent.is_dir():
        raise OSError(f"{option} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OSError(f"{option} {path}: the directory {parent} is not writable")


class PartialFile:
    """A text file written as ``<path>.partial`` and renamed to ``path`` on :meth:`commit`.

    Parameters
    ----------
    path : Path
        The final name.

    Use as a context manager: leaving the block without :meth:`commit` (an
    exception, Ctrl-C) closes the ``.partial`` file and keeps it.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.partial = partial_path(self.path)
        self.file: tp.TextIO = open(self.partial, "w")

    def write(self, text: str) -> None:
        """Append ``text`` and flush it to the operating system at once."""
        self.file.write(text)
        self.file.flush()

    def flush(self) -> None:
        self.file.flush()

    def commit(self) -> None:
        """Close and rename ``<path>.partial`` to ``path`` (the run is complete)."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.partial, self.path)

    def close(self) -> None:
        """Close without renaming: ``<path>.partial`` stays."""
        if not self.file.closed:
            self.file.close()

    def __enter__(self) -> "PartialFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through ``<path>.partial`` and a rename."""
    out = PartialFile(path)
    try:
        out.write(text)
        out.commit()
    finally:
        out.close()


def terminate_as_interrupt() -> None:
    """Let SIGTERM unwind like Ctrl-C (``KeyboardInterrupt``), so that the
    ``.partial`` files are closed with their finished content."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (main() called from a worker thread)
        pass
