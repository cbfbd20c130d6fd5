"""Data sources: what a `data.train` / `data.heldout` value names, and what can be known of its files before
`datasets` reads them (train/data.py loads them).

`resolve_source` turns a config value (a path, a folder, a glob, a list of them, or a hub dataset name) into files,
checked to exist, be non-empty and, for text, to start as UTF-8 text; `first_non_text` and `first_bad_record` name
the file and place where a text or json file goes wrong, which `datasets` does not. `fingerprint` and
`data_changes` are what a checkpoint records of the data files and how a resumed run finds that they changed
(train/checks.py check_resume).
"""

from __future__ import annotations

import codecs
import glob
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "name" or "namespace/name"
TEXT_CHECK_BYTES = 1 << 16  # of every local text file, read by resolve_source: a binary file shows at once


@dataclass
class Source:
    builder: str  # "text" | "json" | "parquet" | "hub"
    files: list[str] | None = None
    name: str | None = None  # hub dataset name

    def describe(self) -> str:
        if self.name:
            return f"hub dataset {self.name}"
        return self.files[0] if len(self.files) == 1 else f"{len(self.files)} {self.builder} files"


def _builder_of(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSED:
        suffixes = suffixes[:-1]
    return BUILDERS.get(suffixes[-1]) if suffixes else None


def _looks_like_path(spec: str) -> bool:
    """Whether `spec` means a local file or folder rather than a hub dataset: it starts like a path, has a data
    file's extension, cannot be a hub name (two slashes, spaces ...), or starts with a folder that exists here."""
    if spec.startswith(("/", "./", "../", "~")) or _builder_of(Path(spec)) is not None or not HUB_NAME.match(spec):
        return True
    return "/" in spec and Path(spec.split("/")[0]).is_dir()


def _no_such_file(spec: str, what: str) -> str:
    where = "" if Path(spec).expanduser().is_absolute() else f" (relative to the working directory {Path.cwd()})"
    hub = "; for a hub dataset of that name set data.format=hub" if HUB_NAME.match(spec) else ""
    return f"{what}: no such file: {spec}{where}{hub}"


def first_non_text(path, limit: int | None = None) -> str | None:
    """Where the file stops being UTF-8 text ("byte 0xff at offset 151 is not UTF-8", a NUL byte), within its
    first `limit` bytes (None: all of it); None when it is text."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20 if limit is None else min(1 << 20, limit - offset)):
            nul = chunk.find(b"\0")  # valid UTF-8, but no text file holds one (UTF-16 text holds many)
            pending = len(decoder.getstate()[0])  # bytes of a character begun in the previous chunk
            try:
                decoder.decode(chunk if nul < 0 else chunk[:nul])
            except UnicodeDecodeError as err:
                return f"byte 0x{err.object[err.start]:02x} at offset {offset - pending + err.start} is not UTF-8"
            if nul >= 0:
                return f"a NUL byte at offset {offset + nul}"
            offset += len(chunk)
    if limit is None or offset < limit:  # the whole file was read
        pending = len(decoder.getstate()[0])
        if pending:
            return f"it ends inside a UTF-8 character (offset {offset - pending})"
    return None


def _check_text(path: str, what: str, limit: int | None) -> None:
    problem = first_non_text(path, limit)
    if problem is not None:
        raise ValueError(f"{what}: {path} is not UTF-8 text: {problem} (a binary file?); text files must be UTF-8")


def resolve_source(spec, fmt: str = "auto", what: str = "data.train") -> Source:
    """Turn a config value into files (checked to exist, be non-empty and, for text, to start as UTF-8 text) or a
    hub name. Raises ValueError."""
    specs = spec if isinstance(spec, list) else [spec]
    files: list[str] = []
    hub: list[str] = []
    for s in specs:
        path = Path(s).expanduser()
        if any(ch in s for ch in "*?["):
            matches = sorted(glob.glob(str(path), recursive=True))
            if not matches:
                raise ValueError(f"{what}: the pattern {s} matches no file")
            files += matches
        elif path.is_dir():
            found = sorted(str(p) for p in path.rglob("*") if p.is_file() and _builder_of(p)
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))  # .ipynb_checkpoints/
            if not found:
                raise ValueError(f"{what}: the folder {s} holds no data file ({', '.join(sorted(BUILDERS))})")
            files += found
        elif path.is_file():
            files.append(str(path))
        elif fmt == "hub" or (fmt == "auto" and not _looks_like_path(s)):
            hub.append(s)
        else:
            raise ValueError(_no_such_file(s, what))
    if hub and (files or len(hub) > 1):
        raise ValueError(f"{what}: give one hub dataset, or local files, not a mix: {specs}")
    if hub:
        return Source("hub", name=hub[0])
    for f in files:
        if Path(f).stat().st_size == 0:
            raise ValueError(f"{what}: data file {f} is empty")
    builders = {fmt} if fmt not in ("auto", "hub") else {_builder_of(Path(f)) for f in files}
    if None in builders:
        unknown = [f for f in files if _builder_of(Path(f)) is None]
        raise ValueError(f"{what}: cannot tell the format of {unknown[0]} from its extension; set data.format")
    if len(builders) > 1:
        raise ValueError(f"{what}: files of different formats ({sorted(builders)}); use one format per source")
    builder = builders.pop()
    if builder == "text":
        for f in files:
            if not f.lower().endswith(COMPRESSED):  # datasets decompresses those; their bytes are not text
                _check_text(f, what, TEXT_CHECK_BYTES)
    return Source(builder, files=files)


JSON_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
              type(None): "null"}
JSON_SPACE = re.compile(r"[ \t\r\n]*")


def first_bad_record(files: list[str], field: str | None = None) -> tuple[str, str, str] | None:
    """(file, where, problem) of the first record of json / jsonl `files` that cannot be read ("line 7", "not JSON
    (Expecting ',' delimiter: column 12)"), or whose `field` holds no string (given a field); None when all read.
    datasets names neither the file nor the line of such a record. A file that starts with "[" is one JSON array
    (datasets reads it whole); any other holds JSON lines (datasets accepts blank lines, and several objects on one)."""
    for f in files:
        if f.lower().endswith(COMPRESSED):
            continue
        with open(f, "rb") as fh:
            start = fh.read(64).lstrip(codecs.BOM_UTF8).lstrip()
            fh.seek(0)
            if start.startswith(b"["):
                problem = _bad_array(fh.read().decode("utf-8", errors="replace").lstrip("\ufeff"), field)
                if problem is not None:
                    return (f, *problem)
                continue
            for number, raw in enumerate(fh, 1):
                problem = _bad_line(raw[3:] if number == 1 and raw.startswith(codecs.BOM_UTF8) else raw, field)
                if problem is not None:
                    return f, f"line {number}", problem
    return None


def _bad_line(raw: bytes, field: str | None) -> str | None:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1})"
    line = line.rstrip("\r\n")
    decoder = json.JSONDecoder()
    pos = JSON_SPACE.match(line).end()
    while pos < len(line):
        try:
            value, pos = decoder.raw_decode(line, pos)
        except json.JSONDecodeError as err:
            return f"not JSON ({err.msg}: column {err.colno})"
        problem = _bad_value(value, field, strings=False)
        if problem is not None:
            return problem
        pos = JSON_SPACE.match(line, pos).end()
    return None


def _bad_array(text: str, field: str | None) -> tuple[str, str] | None:
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        return f"line {err.lineno}", f"not JSON ({err.msg}: column {err.colno})"
    for i, value in enumerate(values if isinstance(values, list) else [values]):
        problem = _bad_value(value, field, strings=True)
        if problem is not None:
            return f"item {i} of its array", problem
    return None


def _bad_value(value, field: str | None, strings: bool) -> str | None:
    """Why one JSON value is not a record with a string `field` (an array may also hold plain strings)."""
    if strings and isinstance(value, str):
        return None
    if not isinstance(value, dict):
        return f"holds {JSON_KINDS.get(type(value), 'a value')}, not an object (a record)"
    if field is not None and field not in value:
        return f"has no {field!r} field"
    if field is not None and not isinstance(value[field], str):
        return f"its {field!r} is {JSON_KINDS.get(type(value[field]), 'a value')}, not a string"
    return None


def fingerprint(files: list[str], known: dict | None = None) -> dict[str, dict]:
    """{file: {"size", "mtime_ns", "sha256"}}: what a checkpoint records of its data files, so that a resumed run
    notices one that changed. A file whose size and modification time match `known` (an earlier record) keeps its
    sha256 there instead of being read again."""
    out = {}
    for f in files:
        size, mtime_ns = _stat(f)
        old = (known or {}).get(f)
        out[f] = {"size": size, "mtime_ns": mtime_ns, "sha256": old["sha256"] if old is not None and
                  (old["size"], old["mtime_ns"]) == (size, mtime_ns) else None}
    unread = [f for f, record in out.items() if record["sha256"] is None]
    if unread:
        logger.info("reading %d data file(s), %.1f MB, for their sha256 (a resumed run checks them)", len(unread),
                    sum(out[f]["size"] for f in unread) / 1e6)
    for f in unread:
        out[f]["sha256"] = _sha256(f)
    return out


def data_changes(recorded: dict[str, dict], files: list[str]) -> list[str]:
    """How `files` differ from a checkpoint's `fingerprint` of them: new, gone and changed files. Only a file whose
    size or modification time differ is read; one that was touched or copied without a change is unchanged."""
    changes = []
    for f in files:
        old = recorded.get(f)
        if old is None:
            changes.append(f"{f} is new")
            continue
        size, mtime_ns = _stat(f)
        if size != old["size"]:
            changes.append(f"{f} changed ({old['size']} bytes then, {size} now)")
        elif mtime_ns != old["mtime_ns"] and _sha256(f) != old["sha256"]:
            changes.append(f"{f} changed (the same size, other content)")
    return changes + [f"{f} is gone" for f in recorded if f not in files]


def _stat(path: str) -> tuple[int, int]:
    st = Path(path).stat()
    return st.st_size, st.st_mtime_ns


def _sha256(path: str) -> str:
    from r2lm.checkpoints.manifest import sha256_of  # each version of a file is read once per process

    return sha256_of(Path(path))
