"""eval/free_drafts.py: verification replayed over a reply commits what a step-by-step count written from the
docstring commits (a perfect source, a silent one, prompt lookup against a brute-force search); end to end on a tiny
converted target, the JSON and PNG come from one run and bad input is refused before anything is written."""

import json

import pytest
import torch

from eval.free_drafts import main, replay, sources
from r2lm import R2LMForDiffusionLM
from r2lm.ngram import NGramTable
from tests.eval.test_lossless_bench import chat_target


def brute_lookup(text: list[int], size: int) -> tuple[list[int], int]:
    """The tokens after the latest earlier occurrence of the text's last 2 tokens (else its last 1), and n."""
    for n in (2, 1):
        if len(text) > n:
            for at in range(len(text) - 2, n - 2, -1):
                if text[at - n + 1 : at + 1] == text[-n:]:
                    return text[at + 1 : at + 1 + size], n
    return [], 0


def brute_replay(prompt, reply, size):
    done = steps = 0
    while done < len(reply):
        draft, _ = brute_lookup(prompt + reply[:done], size)
        agreed = 0
        while agreed < len(draft) and done + agreed < len(reply) and draft[agreed] == reply[done + agreed]:
            agreed += 1
        done, steps = done + min(agreed + 1, len(reply) - done), steps + 1
    return steps


def test_a_replayed_verification_commits_what_the_drafts_agree_with():
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        prompt = torch.randint(0, 4, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        reply = torch.randint(0, 4, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        size = int(torch.randint(1, 6, (1,), generator=g))
        assert replay(prompt, reply, sources({}, size)["lookup"])["steps"] == brute_replay(prompt, reply, size), trial

        def perfect(texts, reply=reply, size=size, prompt=prompt):  # the reply itself: every draft right
            done = len(texts.tokens[0]) - len(prompt)
            return reply[done : done + size] + [-1] * (size - len(reply[done : done + size])), 0

        run = replay(prompt, reply, perfect)
        assert run["steps"] == -(-len(reply) // (size + 1)) and run["tokens"] == len(reply)
        silent = replay(prompt, reply, lambda texts, size=size: ([-1] * size, 0))
        assert silent["steps"] == len(reply) and silent["drafted"] == 0


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("free")
    folder = chat_target(root)
    vocab = R2LMForDiffusionLM.from_pretrained(folder).config.vocab_size
    g = torch.Generator().manual_seed(1)
    NGramTable.build([torch.randint(0, 40, (300,), generator=g).tolist()], vocab, 2, 1).save(root / "t")
    NGramTable.build([[1, 2, 3]], 7, 1, 1).save(root / "small")
    return root, folder


def test_the_json_and_png_come_from_one_run(target):
    root, folder = target
    out = root / "out"
    result = main(["--target", str(folder), "--table", f"t={root / 't'}", "--prompts", "2", "--skip", "1",
                   "--new-tokens", "12", "--max-prompt-tokens", "600", "--threads", "1", "--out", str(out)])
    assert json.loads((out / "free_drafts.json").read_text()) == json.loads(json.dumps(result))
    assert (out / "free_drafts.png").stat().st_size > 0
    assert list(result["sources"]) == ["lookup", "t", "lookup+t"] and result["target"] == "target"
    for cells in result["sources"].values():
        for category in ("code", "chat", "prose"):
            assert 1 <= cells[category]["tau"] <= 5 and 0 <= cells[category]["first_right"] <= 1
    assert all(0 < n <= 2 * 12 for n in result["reply_tokens"].values())


@pytest.mark.parametrize("extra, message", [
    (["--table", "nameless"], "--table takes NAME=DIR"),
    (["--table", "lookup=x"], "--table names must differ and not be 'lookup'"),
    (["--prompts", "0"], "--prompts must be positive"),
    (["--table", "s={small}"], "this n-gram table was built for a vocabulary of 7 tokens"),
])
def test_bad_input_is_refused_before_anything_is_written(target, capsys, extra, message):
    root, folder = target
    extra = [e.format(small=root / "small") for e in extra]
    with pytest.raises(SystemExit):
        main(["--target", str(folder), "--out", str(root / "refused"), *extra])
    assert message in capsys.readouterr().err and not (root / "refused").exists()
