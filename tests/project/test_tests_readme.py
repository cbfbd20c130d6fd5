"""tests/README.md stays true: every test it names exists, and it lists every folder of tests."""

import ast
import re

from tests.helpers import REPO

TESTS = REPO / "tests"
README = (TESTS / "README.md").read_text()


def test_every_test_named_in_the_readme_exists():
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", README)
    assert len(named) >= 9  # at least one per invariant
    missing = []
    for path, name in named:
        file = REPO / path
        defined = {node.name for node in ast.parse(file.read_text()).body
                   if isinstance(node, ast.FunctionDef)} if file.is_file() else set()
        if name not in defined:
            missing.append(f"{path}::{name}")
    assert missing == []


def test_the_readme_lists_every_folder_of_tests():
    listed = set(re.findall(r"^    (\w+)/ ", README, flags=re.M))
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert listed == folders
