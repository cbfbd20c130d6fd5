"""The design is in the repository (issue 39): every citation of docs/design.md names a section it has, every
research note cited is in docs/notes/, and nothing cites a document a clone does not hold. The verify loop knows
its drafters by their interface only."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = [p for folder in ("r2lm", "train", "eval", "scripts", "tests", "convert") for p in (REPO / folder).rglob("*")
           if p.suffix in (".py", ".sh", ".md", ".yaml") and "__pycache__" not in p.parts] + [REPO / "README.md"]


def sections() -> set[str]:
    heads = re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", (REPO / "docs" / "design.md").read_text(), re.M)
    return set(heads)


def test_every_design_citation_names_a_section_it_has():
    have = sections()
    assert {"1", "1.1", "1.2", "2", "2.1", "3", "4", "5", "6", "7", "8", "9"} <= have
    cited = []
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"docs/design\.md,? (?:sections? |invariant )?(\d+(?:\.\d+)?)(?:-(\d+))?", text):
            number = match.group(1)
            if number.startswith("8.") and "invariant" not in match.group(0):  # "8.2": invariant 2 of section 8
                number = "8"
            cited.append((path.relative_to(REPO).as_posix(), number))
            if "invariant" in match.group(0):
                continue
            assert number in have, f"{path.relative_to(REPO)} cites docs/design.md {match.group(1)}, which it has not"
    assert len(cited) > 20  # the docstrings do cite it


def test_nothing_cites_documents_outside_the_repository():
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"(?<![\w/])DESI" + r"GN(?:\.md)?\b", text), f"{path.relative_to(REPO)} cites a design outside docs/"
        for note in re.findall(r"(?<![\w/])(?:docs/)?notes/(\w+)\.md", text):
            assert (REPO / "docs" / "notes" / f"{note}.md").is_file(), f"{path.relative_to(REPO)} cites notes/{note}.md"


def test_the_verify_loop_does_not_branch_on_a_draft_source():
    """verify.py runs whatever r2lm.generation.drafts.DRAFTS makes; no comparison with a source's name."""
    loop = (REPO / "r2lm" / "generation" / "verify.py").read_text()
    body = loop[loop.index("def decode_verified"):]
    assert not re.search(r"""==\s*["'](window|lookup|drafter|lookup\+drafter)["']""", body)
    assert not re.search(r"""["'](window|lookup|drafter)["']\s+in\s""", body)
