"""docs/ records files by name and version (eval.machine.name_of), never by a path of the machine that measured: no
string in a results JSON is an absolute path, and no page names a machine's home, temporary or work folder."""

import json
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
MACHINE_FOLDER = re.compile(r"(?<![\w.])/(home|root|tmp|work|Users|private|mnt|scratch)/")


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


def test_results_json_hold_no_absolute_path():
    found = [(p.name, s) for p in sorted((DOCS / "results").glob("*.json"))
             for s in strings(json.loads(p.read_text())) if s.startswith("/")]
    assert not found, found[:5]


def test_docs_name_no_folder_of_a_machine():
    found = [(p.relative_to(DOCS), m.group(0)) for p in sorted(DOCS.rglob("*.md"))
             for m in MACHINE_FOLDER.finditer(p.read_text())]
    assert not found, found[:5]
