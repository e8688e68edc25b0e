"""The files a screening run writes (:mod:`torchani_fast.screen`): ``OUTPUT.partial``,
appended as task results arrive and read back by ``resume``, and the final energy
file, written from the records in input order in the local command's layout.
"""
import functools
import json
import math
import os
import typing as tp
from pathlib import Path

from .output import open_locked, partial_path, target_path

__all__ = ["ScreenError"]


class ScreenError(Exception):
    """A screening run cannot go on (bad input, lost scheduler, foreign partial file)."""


ScreenError.__module__ = "torchani_fast.screen"  # raised and documented there


_KEEP_BYTES = 16 << 20  # records kept in memory, as JSON text (~5-10x that as objects)


class _Partial:
    """``OUTPUT.partial``: a header line, then one line per finished task: the
    JSON list of its structures' records.

    A task's line is written and flushed at once; a line cut short by an
    interruption is dropped on resume.
    """

    def __init__(self, output: Path, header: dict, resume: bool):
        self.path = partial_path(target_path(output))  # (through a link: next to its file)
        self.done: tp.Dict[int, tp.Tuple[int, int]] = {}  # structure -> (its line's offset, place)
        # The records this run wrote, also kept in memory while their lines total
        # at most _KEEP_BYTES: the final file then needs no second parse of them
        # (30-40 ms for 20 000 energies, on the critical path at the end).
        self.kept: tp.Dict[int, dict] = {}
        self.kept_bytes = 0
        if self.path.exists() and not resume:
            raise ScreenError(f"{self.path} exists (an interrupted run): pass --resume to "
                              "continue it, or delete it to start over")
        if resume and self.path.exists():
            self.file = open_locked(self.path, append=True)  # (another run on it: refused)
            self._load(header)
            self.file.seek(0, os.SEEK_END)  # (after the truncation of a cut line)
        else:
            self.file = open_locked(self.path)
            self.file.write((json.dumps({"torchani_fast_screen": header}) + "\n").encode())
            self.file.flush()

    def _load(self, header: dict) -> None:
        with open(self.path, "rb") as f:
            first = f.readline()
            try:
                old = json.loads(first)["torchani_fast_screen"]
            except (ValueError, KeyError, TypeError):
                raise ScreenError(f"{self.path}: not a torchani-fast partial file") from None
            if isinstance(old, dict) and "version" in old and old["version"] != header.get("version"):
                raise ScreenError(f"{self.path} was written by another torchani_fast (partial "
                                  f"file format {old.get('version')!r}, this one writes "
                                  f"{header.get('version')!r}); delete it and rerun without --resume")
            if isinstance(old, dict):
                _check_inputs(self.path, old.get("inputs"), header.get("inputs"))
                if "inputs" in header:
                    old = dict(old, inputs=header["inputs"])  # (compared above, mtimes aside)
            if old != header:
                diff = sorted(k for k in set(old) | set(header) if old.get(k) != header.get(k))
                raise ScreenError(f"{self.path} was written for other inputs or options "
                                  f"({', '.join(diff)} differ); rerun with the same arguments "
                                  "or delete it")
            end = pos = len(first)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # cut short by the interruption
                try:
                    indices = [int(rec["i"]) for rec in json.loads(line)]
                except (ValueError, KeyError, TypeError):
                    break
                for k, i in enumerate(indices):
                    self.done.setdefault(i, (pos, k))
                pos += len(line)
                end = pos
        with open(self.path, "r+b") as f:
            f.truncate(end)

    def write(self, records: list) -> None:
        new = [rec for rec in records if rec["i"] not in self.done]  # a recomputed batch: dropped
        if not new:
            return
        pos = self.file.tell()
        for k, rec in enumerate(new):
            self.done[rec["i"]] = (pos, k)
        line = (json.dumps(new) + "\n").encode()
        self.file.write(line)
        self.file.flush()
        if self.kept_bytes + len(line) <= _KEEP_BYTES:
            self.kept_bytes += len(line)
            self.kept.update((rec["i"], rec) for rec in new)

    def records(self) -> tp.Callable[[int], dict]:
        """Record ``i``: kept in memory, or read back from the partial file (the
        lines of the last few tasks kept parsed: the final file asks for them in
        input order)."""
        reader = open(self.path, "rb")

        @functools.lru_cache(maxsize=256)
        def line(pos: int) -> list:
            reader.seek(pos)
            return json.loads(reader.readline())

        def get(i: int) -> dict:
            rec = self.kept.get(i)
            if rec is not None:
                return rec
            pos, k = self.done[i]
            return line(pos)[k]

        get.close = reader.close  # type: ignore[attr-defined]
        return get

    def close(self) -> None:
        self.file.close()


def _check_inputs(partial: Path, old: tp.Optional[list], new: tp.Optional[list]) -> None:
    """``ScreenError`` naming the first input whose size or contents differ from
    the fingerprint in the partial file (a newer modification time with the
    same bytes, a ``touch``, is accepted)."""
    if old is None or new is None or len(old) != len(new):
        return  # other files: the header comparison names them
    for was, now in zip(old, new):
        if not isinstance(was, dict) or was.get("file") != now.get("file"):
            return
        if (was.get("size"), was.get("sha256")) != (now.get("size"), now.get("sha256")):
            raise ScreenError(
                f"{now['file']} changed since {partial} was written (size {was.get('size')} -> "
                f"{now.get('size')}, contents differ): its results cannot be resumed; delete "
                f"{partial} and rerun without --resume")


class _Memory:
    """Records kept in memory (output to stdout: nothing to resume)."""

    def __init__(self):
        self.done: tp.Dict[int, dict] = {}

    def write(self, records: list) -> None:
        for rec in records:
            self.done.setdefault(rec["i"], rec)

    def records(self):
        get = self.done.__getitem__
        return _Getter(get, lambda: None)

    def close(self) -> None:
        pass


class _Getter:
    def __init__(self, get, close):
        self.get, self.close = get, close

    def __call__(self, i: int) -> dict:
        return self.get(i)


# ---------------------------------------------------------------- the final file
_ENCODE_STR = json.encoder.encode_basestring_ascii


def _dumps(value, indent: int, level: int = 0) -> str:
    """``json.dumps(value, indent=indent)`` with every line after the first
    indented by ``level`` more steps: the same text, without json's pure-Python
    indenting encoder for the numbers, lists and small dicts of an energy file
    (other values go to ``json.dumps``)."""
    kind = type(value)
    if kind is float:
        return float.__repr__(value) if math.isfinite(value) else json.dumps(value)
    if value is None or kind is bool:
        return "null" if value is None else ("true" if value else "false")
    if kind is int:
        return int.__repr__(value)
    if kind is str:
        return _ENCODE_STR(value)
    if kind is list:
        if not value:
            return "[]"
        inner = "\n" + " " * (indent * (level + 1))
        return ("[" + inner + ("," + inner).join([_dumps(v, indent, level + 1) for v in value])
                + "\n" + " " * (indent * level) + "]")
    if kind is dict and all(type(k) is str for k in value):
        if not value:
            return "{}"
        inner = "\n" + " " * (indent * (level + 1))
        return ("{" + inner + ("," + inner).join([_ENCODE_STR(k) + ": " + _dumps(v, indent, level + 1)
                                                  for k, v in value.items()])
                + "\n" + " " * (indent * level) + "}")
    return json.dumps(value, indent=indent).replace("\n", "\n" + " " * (indent * level))


def _dump_columns(out, columns: list, indent: tp.Optional[int]) -> None:
    """Write ``{key: [values...], ...}`` as ``json.dumps(..., indent=indent)`` would,
    one value at a time (the values come from generators, never all in memory).
    ``columns``: ``(key, texts)`` pairs, ``texts`` the values encoded by
    :func:`_encoder` (or as it would)."""
    if indent is None:
        out.write("{")
        for c, (key, texts) in enumerate(columns):
            out.write((", " if c else "") + json.dumps(key) + ": [" + ", ".join(texts) + "]")
        out.write("}\n")
        return
    pad, pad2 = " " * indent, " " * (2 * indent)
    out.write("{\n")
    for c, (key, texts) in enumerate(columns):
        out.write((",\n" if c else "") + pad + json.dumps(key) + ": [")
        empty = True
        for k, text in enumerate(texts):
            out.write(("," if k else "") + "\n" + pad2 + text)
            empty = False
        out.write("]" if empty else "\n" + pad + "]")
    out.write("\n}\n")


def _encoder(indent: tp.Optional[int]) -> tp.Callable[[tp.Any], str]:
    """The JSON text of a column's value in :func:`_dump_columns`' layout."""
    if indent is None:
        return json.dumps
    return lambda value: _dumps(value, indent, 2)


def _entry(item: dict, rec: dict) -> dict:
    entry = {"file": item["file"], "frame": item["frame"], "natoms": item["natoms"]}
    if "error" in rec:
        entry["error"] = rec["error"]
    return entry


def _entry_texts(items: list, get, indent: tp.Optional[int]) -> tp.Iterator[str]:
    """The encoded ``structures`` column: one template per file for the entries
    without an error (a third of the final file's writing time, for 20 000 CH4,
    went to encoding these small dicts one by one)."""
    encode = _encoder(indent)
    templates: tp.Dict[str, str] = {}
    for i, item in enumerate(items):
        rec = get(i)
        if "error" in rec:
            yield encode(_entry(item, rec))
            continue
        template = templates.get(item["file"])
        if template is None:
            name = _ENCODE_STR(item["file"]).replace("%", "%%")
            if indent is None:
                template = '{"file": ' + name + ', "frame": %d, "natoms": %d}'
            else:
                inner = "\n" + " " * (3 * indent)
                template = ("{" + inner + '"file": ' + name + "," + inner + '"frame": %d,' + inner
                            + '"natoms": %d' + "\n" + " " * (2 * indent) + "}")
            templates[item["file"]] = template
        yield template % (item["frame"], item["natoms"])


def _write_energy(out, items: list, get, spec: dict, indent) -> None:
    n = len(items)
    encode = _encoder(indent)
    columns = [("energies", (encode(get(i).get("energy")) for i in range(n)))]
    if spec["hessians"]:
        columns.append(("hessians", (encode(get(i).get("hessians")) for i in range(n))))
    if spec["forces"] or spec["hessians"]:
        columns.append(("forces", (encode(get(i).get("forces")) for i in range(n))))
    columns.append(("structures", _entry_texts(items, get, indent)))
    _dump_columns(out, columns, indent)
