"""Opening a dataset in place, and reading its JSON with errors that name file and field.

A source is a folder (its matching files, recursively), one file, or a ``.tar.gz`` / ``.tgz``
/ ``.tar`` archive read with ``tarfile`` without extracting it. Files come in path order, so
the same source always gives the same sessions in the same order. A file inside an archive
is named ``ARCHIVE:MEMBER`` in errors.
"""

from __future__ import annotations

import fnmatch
import json
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from agentserving.replay.trace import TraceFormatError

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")


class JsonSource:
    """The JSON files of one source whose names match ``pattern`` (e.g. ``*.traj.json``)."""

    def __init__(self, src: str | Path, pattern: str) -> None:
        self.src = Path(src)
        self.pattern = pattern
        if not self.src.exists():
            raise FileNotFoundError(f"{self.src}: no such file or folder")
        self._archive = self.src.is_file() and self.src.name.endswith(ARCHIVE_SUFFIXES)
        if self._archive:
            with tarfile.open(self.src) as tar:
                self._members = sorted(m.name for m in tar.getmembers()
                                       if m.isfile() and self._matches(m.name))
        elif self.src.is_dir():
            self._members = sorted(str(p.relative_to(self.src)) for p in self.src.rglob("*")
                                   if p.is_file() and self._matches(p.name))
        else:
            self._members = [""]  # the file itself

    def _matches(self, name: str) -> bool:
        return fnmatch.fnmatch(Path(name).name, self.pattern)

    @property
    def members(self) -> list[str]:
        """The files' paths inside the source (``""`` when the source is the file)."""
        return list(self._members)

    def path_of(self, member: str) -> str:
        """The file's path: inside the archive, or on disk."""
        if self._archive:
            return member
        return str(self.src / member) if member else str(self.src)

    def name(self, member: str) -> str:
        if self._archive:
            return f"{self.src}:{member}"
        return str(self.src / member) if member else str(self.src)

    def load(self, members: Sequence[str] | None = None) -> Iterator[tuple[str, str, Any]]:
        """(member, name for errors, parsed JSON) of ``members`` (default all), path order."""
        wanted = sorted(self._members if members is None else members)
        if self._archive:
            # one pass in the archive's own order (a gzip stream only reads forwards: member
            # by member in path order would decompress it again for every step back)
            data: dict[str, bytes] = {}
            chosen = set(wanted)
            with tarfile.open(self.src) as tar:
                for info in tar:
                    if info.name in chosen and (f := tar.extractfile(info)) is not None:
                        data[info.name] = f.read()
            for member in wanted:
                if member not in data:
                    raise TraceFormatError(f"{self.name(member)}: no such file in the archive")
                yield member, self.name(member), _parse(data.pop(member), self.name(member))
        else:
            for member in wanted:
                path = self.src / member if member else self.src
                yield member, self.name(member), _parse(path.read_bytes(), self.name(member))


def _parse(data: bytes, name: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise TraceFormatError(f"{name}: not JSON: {exc}") from exc


class Fields:
    """Typed reads from parsed JSON; a missing or mistyped field raises ``TraceFormatError``
    naming the file and the field's path (``x.traj.json: messages[5].extra.timestamp:
    missing``)."""

    def __init__(self, name: str, root: Any) -> None:
        self.name = name
        self.root = root

    def error(self, path: str, problem: str) -> TraceFormatError:
        return TraceFormatError(f"{self.name}: {path}: {problem}")

    def get(self, path: str, kind: type | tuple[type, ...], *, required: bool = True,
            default: Any = None) -> Any:
        """The value at ``path`` (``a.b[3].c``) from the root, of type ``kind``."""
        value = self.root
        for step in _steps(path):
            if isinstance(step, int):
                ok = isinstance(value, list) and -len(value) <= step < len(value)
                value = value[step] if ok else None
            else:
                ok = isinstance(value, dict) and step in value
                value = value[step] if ok else None
            if not ok or value is None:
                if required:
                    raise self.error(path, "missing")
                return default
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
            raise self.error(path, f"expected {_kind_name(kind)}, got {type(value).__name__}")
        return value

    def number(self, path: str, *, required: bool = True) -> float | None:
        value = self.get(path, (int, float), required=required)
        return None if value is None else float(value)


def _steps(path: str) -> list[str | int]:
    steps: list[str | int] = []
    for part in path.split("."):
        name, _, rest = part.partition("[")
        if name:
            steps.append(name)
        while rest:
            index, _, rest = rest.partition("]")
            steps.append(int(index))
            rest = rest.removeprefix("[")
    return steps


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", bool: "true or false"}
    kinds = _kinds(kind)
    if set(kinds) == {int, float}:
        return "a number"
    return " or ".join(names.get(k, k.__name__) for k in kinds)
