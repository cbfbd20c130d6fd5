"""Small files with one purpose (issue 39 item 5): no Python file of the library, the training program or the
evaluations is over MAX_LINES lines. A file that grows past it is split by purpose (as train/pretrain.py was into
checks, trainer and its entry point), not squeezed."""

from tests.helpers import REPO

MAX_LINES = 500
FOLDERS = ("r2lm", "train", "eval")


def test_no_file_is_over_the_limit():
    sizes = {path.relative_to(REPO).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
             for folder in FOLDERS for path in (REPO / folder).rglob("*.py")}
    assert len(sizes) > 50  # the folders were read
    assert {path: lines for path, lines in sizes.items() if lines > MAX_LINES} == {}
