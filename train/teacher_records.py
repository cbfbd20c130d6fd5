"""The records file train/teacher_data.py writes (OUT, jsonl: one record per prompt, in prompt order) and the files
beside it: OUT.settings (the settings that decide the records, JSON, written with the first records), OUT.complete
(the record count of a run that wrote every record it was asked for) and OUT.lock (train/lock.py).

A re-run of the same command resumes OUT: `done_records` counts the whole records it holds (cutting off a partial
last line) and refuses a file written with other settings, or not by train/teacher_data.py; `write_records` appends
whole records and undoes a failed write. Readers of teacher files (train/drafter.py) take the suffixes from here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SETTINGS_SUFFIX = ".settings"  # not a data file extension: a folder given as data.train skips it
LOCK_SUFFIX = ".lock"  # nor is this
COMPLETE_SUFFIX = ".complete"  # nor this: the record count of a run that wrote every record it was asked for
# the arguments that decide the records: a resumed run must keep them (--max-prompts may grow or shrink)
SETTINGS = ("teacher", "prompts", "prompt_field", "text_unit", "prompt_tokens", "max_new_tokens", "batch_size",
            "pool_batches", "temperature", "top_k", "top_p", "seed", "block_size", "threshold", "dtype", "chat",
            "id_field")
# settings added since files were first written, with the value a file that does not record them was written with
IMPLIED = {"pool_batches": 1}


@dataclass
class Prompt:
    ids: list[int]  # teacher token ids
    text: str  # what the record's text starts with
    source_id: str | None = None  # the prompt record's --id-field (e.g. a ShareGPT conversation id)


def record(index: int, prompt: Prompt, new_ids: list[int], finished: bool, tokenizer, teacher: str | None = None) -> dict:
    """`text`: the prompt and the continuation, EOS dropped (for the training pipeline, which packs documents with
    EOS); `ids`: the tokens exactly as read and generated, EOS included (a drafter learns the teacher's own tokens,
    which a round trip through text need not give back)."""
    continuation = tokenizer.decode(new_ids[:-1] if finished else new_ids, skip_special_tokens=True)
    out = {"index": index, "text": prompt.text + continuation, "prompt_tokens": len(prompt.ids),
           "new_tokens": len(new_ids) - finished, "finished": finished, "ids": prompt.ids + new_ids}
    if prompt.source_id is not None:
        out["id"] = prompt.source_id
    if teacher is not None:
        out["teacher"] = teacher
    return out


def settings_of(args, dtype: str) -> dict:
    values = {name: getattr(args, name) for name in SETTINGS}
    values["teacher"], values["prompts"] = str(Path(args.teacher).resolve()), str(Path(args.prompts).resolve())
    values["dtype"] = dtype
    return values


def settings_path(out: Path) -> Path:
    return out.with_name(out.name + SETTINGS_SUFFIX)


def complete_path(out: Path) -> Path:
    return out.with_name(out.name + COMPLETE_SUFFIX)


def mark_complete(out: Path, count: int) -> None:
    """Record that `out` holds every record its run was asked for (a reader refuses a file a run is still writing,
    or one a killed run left short)."""
    tmp = out.with_name(f".{out.name}{COMPLETE_SUFFIX}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"records": count}) + "\n")
    os.replace(tmp, complete_path(out))


def read_settings(path: Path) -> dict:
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read the settings file {path}: {err}; it is damaged: give another --out") from None
    if not isinstance(saved, dict):
        raise ValueError(f"the settings file {path} holds no settings (a JSON {type(saved).__name__}, not an object); "
                         "it is damaged: give another --out")
    return saved


def done_records(out: Path, settings: dict, prompts: list[Prompt]) -> int:
    """How many records `out` already holds for these settings (0: a new file). A partial last line (a killed run)
    is cut off. Raises ValueError for a file this script did not write, or wrote with other settings."""
    saved_path = settings_path(out)
    if not out.exists():  # a settings file without its OUT (deleted) is stale: write_records replaces it
        return 0
    if not saved_path.is_file():
        raise ValueError(f"--out {out} exists but was not written by train/teacher_data.py (no {saved_path.name} "
                         "beside it): give another --out")
    saved = {**IMPLIED, **read_settings(saved_path)}
    changed = [f"{name}: {saved[name]!r} in the file, {value!r} now" if name in saved else
               f"{name}: not recorded in the file (an older version wrote it), {value!r} now"
               for name, value in settings.items() if saved.get(name) != value or name not in saved]
    if changed:
        raise ValueError(f"--out {out} was generated with other settings ({'; '.join(changed)}): rerun with its "
                         "settings to extend it, or give another --out")
    data = out.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    try:
        lines = complete.decode("utf-8").splitlines()
    except UnicodeDecodeError as err:
        line = complete[: err.start].count(b"\n") + 1
        raise ValueError(f"--out {out}: line {line} is not UTF-8 text; the file is damaged") from None
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"--out {out}: line {i + 1} is not a JSON record (an object with a text); the file is "
                             "damaged")
        if record.get("index") != i or (i < len(prompts) and not record["text"].startswith(prompts[i].text)):
            raise ValueError(f"--out {out}: record {i + 1} does not continue prompt {i} of --prompts; the file or the "
                             "prompts file changed since it was written: give another --out")
    if len(complete) < len(data):
        logger.warning("%s ends with a partial record (a killed run?): cut off, it is generated again", out)
        os.truncate(out, len(complete))
    return len(lines)


def write_records(out: Path, settings: dict, records: list[dict]) -> None:
    """Append whole records (one write, flushed to disk); for a new `out` the settings file comes first, written
    atomically (replacing one left by an earlier `out` that was deleted). Raises OSError with `out` as it was."""
    if not out.exists():
        saved_path = settings_path(out)
        tmp = saved_path.with_name(f".{saved_path.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps(settings, indent=1) + "\n")
            os.replace(tmp, saved_path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
    size = out.stat().st_size if out.exists() else 0
    try:
        with out.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        with contextlib.suppress(OSError):  # cutting a file back needs no space: it ends with a whole record again
            os.truncate(out, size)
        raise
