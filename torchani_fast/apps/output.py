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

Every writer here, the command's and the screening driver's alike:

- writes through symbolic links: ``-o link`` fills the file the link points to
  (the partial file sits next to it) instead of replacing the link;
- refuses an output that is one of the run's inputs (:func:`check_not_input`);
- holds an exclusive lock (``flock``) on its ``.partial`` file from opening to
  the rename: a second run writing the same output fails at once, naming the
  file, instead of both writing into one file (:func:`open_locked`). Whole
  texts (:func:`write_atomic`) go through a temporary name of their own
  (``NAME.<random>.writing``), so concurrent runs each leave a complete file.
"""
import contextlib
import os
import secrets
import signal
import typing as tp
from pathlib import Path

__all__ = ["PartialFile", "partial_path", "check_writable", "check_not_input", "open_locked",
           "target_path", "atomic_file", "write_atomic", "terminate_as_interrupt"]


def target_path(path: Path) -> Path:
    """The file ``path`` names once symbolic links are followed (``path`` itself
    if it is no link): what an output written to ``path`` must replace."""
    path = Path(path)
    return Path(os.path.realpath(path)) if os.path.islink(path) else path


def check_not_input(path: Path, inputs: tp.Iterable[tp.Union[str, Path]], option: str = "-o") -> None:
    """Raise ``OSError`` if writing ``path`` (or its ``.partial``) would replace one
    of ``inputs`` (compared after following links)."""
    mine = {os.path.realpath(path), os.path.realpath(partial_path(target_path(path)))}
    for inp in inputs:
        if os.path.realpath(inp) in mine:
            raise OSError(f"{option} {path} would overwrite the input file {inp}; "
                          "choose another output name")


def open_locked(path: Path, append: bool = False, text: bool = False) -> tp.IO:
    """``path`` opened for writing (binary, or ``text``; emptied unless
    ``append``) under an exclusive lock that lasts until the file is closed.

    Raises ``OSError`` naming the file if another process holds the lock (a run
    writing the same output). Where ``fcntl`` is missing (Windows) no lock is taken.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover (Windows)
        fcntl = None
    while True:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else 0), 0o666)
        if fcntl is None:
            break
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise OSError(f"{path} is being written by another run (it holds the file's lock); "
                          "wait for it to finish or choose another output name") from None
        try:  # the name may have been renamed away (committed) between open and lock
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    if not append:
        os.ftruncate(fd, 0)
    return os.fdopen(fd, ("a" if append else "w") + ("" if text else "b"))


def partial_path(path: Path) -> Path:
    """``path`` with ``.partial`` appended (``md.xyz`` -> ``md.xyz.partial``)."""
    return path.with_name(path.name + ".partial")


def check_writable(path: Path, option: str, inputs: tp.Iterable[tp.Union[str, Path]] = ()) -> None:
    """Raise ``OSError`` (with a message naming ``option``) unless ``path`` can be
    created without replacing one of ``inputs``."""
    check_not_input(path, inputs, option)
    path = target_path(path)
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
        The final name (a symbolic link: the file it points to).
    inputs : sequence of paths
        The run's input files, which ``path`` must not be.

    Use as a context manager: leaving the block without :meth:`commit` (an
    exception, Ctrl-C) closes the ``.partial`` file and keeps it. The
    ``.partial`` file is locked while open (:func:`open_locked`).
    """

    def __init__(self, path: Path, inputs: tp.Iterable[tp.Union[str, Path]] = ()):
        check_not_input(path, inputs)
        self.path = target_path(path)
        self.partial = partial_path(self.path)
        self.file: tp.TextIO = open_locked(self.partial, text=True)

    def write(self, text: str) -> None:
        """Append ``text`` and flush it to the operating system at once."""
        self.file.write(text)
        self.file.flush()

    def flush(self) -> None:
        self.file.flush()

    def commit(self) -> None:
        """Rename ``<path>.partial`` to ``path`` (the run is complete), then close
        it (the lock is held until the rename is done)."""
        self.file.flush()
        os.fsync(self.file.fileno())
        os.replace(self.partial, self.path)
        self.file.close()

    def close(self) -> None:
        """Close without renaming: ``<path>.partial`` stays."""
        if not self.file.closed:
            self.file.close()

    def __enter__(self) -> "PartialFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def atomic_file(path: Path, inputs: tp.Iterable[tp.Union[str, Path]] = ()) -> tp.Iterator[tp.TextIO]:
    """A text file that becomes ``path`` when the ``with`` block ends without an
    exception: written under a temporary name of its own
    (``<path>.<random>.writing``, next to it), then renamed, so concurrent
    writers each leave a complete file (the last one's) and a failure leaves
    none. ``path`` must not be one of ``inputs``."""
    check_not_input(path, inputs)
    target = target_path(path)
    while True:  # (mkstemp would make the file 0600; this one gets the umask's mode)
        tmp = target.with_name(f"{target.name}.{secrets.token_hex(4)}.writing")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with open(fd, "w") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_atomic(path: Path, text: str, inputs: tp.Iterable[tp.Union[str, Path]] = ()) -> None:
    """Write ``text`` to ``path`` through :func:`atomic_file`."""
    with atomic_file(path, inputs) as out:
        out.write(text)


def terminate_as_interrupt() -> None:
    """Let SIGTERM unwind like Ctrl-C (``KeyboardInterrupt``), so that the
    ``.partial`` files are closed with their finished content."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (main() called from a worker thread)
        pass
