"""eval/cloze.py: held-out multiple-choice items are well formed and deterministic; accuracy is computed."""

import pytest

from eval.cloze import evaluate, make_items
from tests.helpers.models import tiny_r2lm, tiny_tokenizer

TEXTS = [
    "the quick brown fox jumps over the lazy dog and runs far away into the green forest tonight",
    "a diffusion model decodes many tokens at once while keeping an exact cache of everything it committed",
    "python functions take arguments and return values that other functions can use in turn again and again",
    "the world english bible is a public domain translation of the holy bible into modern english prose",
]


def test_items_hold_the_true_continuation():
    tok = tiny_tokenizer()
    items = make_items(tok, TEXTS, items=12, context=6, answer=3, choices=3, seed=1)
    assert items == make_items(tok, TEXTS, items=12, context=6, answer=3, choices=3, seed=1)
    for item in items:
        ids = next(tok(t).input_ids for t in TEXTS if _contains(tok(t).input_ids, item["context"] + item["choices"][item["label"]]))
        assert ids and len(item["choices"]) == 3 and all(len(c) == 3 for c in item["choices"])


def _contains(seq, part):
    return any(seq[i : i + len(part)] == part for i in range(len(seq) - len(part) + 1))


@pytest.mark.parametrize("kind", [dict(sidecar_layers=[1]), dict(attention="bidirectional", sidecar_layers=[])])
def test_accuracy_is_reported(kind):
    tok = tiny_tokenizer()
    model = tiny_r2lm(vocab_size=len(tok) + 1, mask_token_id=len(tok), **kind)
    result = evaluate(model, tok, TEXTS, items=6, context=6, answer=3, choices=3, mc_num=4)
    assert result["items"] == 6 and 0.0 <= result["accuracy"] <= 1.0 and result["chance"] == 1 / 3


def test_too_little_text():
    with pytest.raises(ValueError, match="need at least 4 held-out documents"):
        make_items(tiny_tokenizer(), TEXTS[:2], items=3, context=6, answer=3, choices=4, seed=0)
