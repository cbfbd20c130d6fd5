"""eval.downstream: the infilling layouts (right context reaches the span through the sidecar only, never through
causal attention; without right context block infilling is `generate`), the stdlib split, function extraction,
and both runners end to end with well-formed JSON."""

import json

import pytest
import torch

from eval import downstream as ds
from r2lm import generate
from tests.helpers.models import MASK_ID, peaky, tiny_r2lm, tiny_tokenizer


def batch(rows=4, left=9, right=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MASK_ID - 1, (rows, left), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    ids[1, :3] = 0
    return ids, mask, torch.randint(0, MASK_ID - 1, (rows, right), generator=g)


def infill(model, left, mask, m, right, block_size, **options):
    out = generate(model, left, mask, max_new_tokens=m, suffix_ids=right, block_size=block_size, threshold=0.6,
                   eos_token_id=[], **options)
    return out.sequences[:, left.shape[1] :]


@pytest.mark.parametrize("overrides", [dict(), dict(prediction="inplace"), dict(attention="block_causal"),
                                       dict(hybrid_layers=[0], hybrid_feature_dim=8)],
                         ids=["causal", "inplace", "block_causal", "hybrid"])
@pytest.mark.parametrize("m", [3, 7, 13])
def test_infilling_with_the_cache_equals_recompute(overrides, m):
    """Spans longer than a window are filled window by window; the suffix joins the windows it falls in."""
    model = peaky(sidecar_layers=[1, 3], **overrides)
    left, mask, right = batch()
    cached = infill(model, left, mask, m, right, 4)
    assert torch.equal(cached, infill(model, left, mask, m, right, 4, use_cache=False))
    assert not (cached == MASK_ID).any()


def test_the_first_infilling_window_is_the_span_and_its_right_context():
    """Against a window built by hand: [x_{a-1}, [MASK] * m, right] read against the prefilled left context."""
    model = peaky(sidecar_layers=[1, 3])
    left, mask, right = batch()
    seen = []
    infill(model, left, mask, 3, right, 9, step_callback=lambda s: seen.append(s.logits))
    cache = model.new_cache(4, 32)
    model.prefill(left[:, :-1], cache, attention_mask=mask[:, :-1])
    window = torch.cat([left[:, -1:], torch.full((4, 3), MASK_ID), right], 1)
    # the decoder reads the prompt and the window in one forward, this oracle in two: float32 rounding of other
    # matmul shapes (up to 5e-5 relative on some CPUs), where a wrong context differs by whole units
    torch.testing.assert_close(seen[0], model.denoise(window, cache)[:, :3], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m", [3, 6])
def test_a_causal_model_without_sidecar_never_sees_the_right_context(m):
    model = peaky()
    left, mask, right = batch()
    want = generate(model, left, mask, max_new_tokens=m, block_size=8, threshold=0.6, eos_token_id=[]).sequences[:, 9:]
    assert torch.equal(infill(model, left, mask, m, right, 8), want)
    assert torch.equal(infill(model, left, mask, m, (right + 7) % 90, 8), want)


def test_right_context_reaches_the_span_through_the_sidecar_and_bidirectional_attention():
    left, mask, right = batch(rows=8)
    changed = (right + 7) % 90
    r2lm = peaky(sidecar_layers=[1, 3])
    assert not torch.equal(infill(r2lm, left, mask, 3, right, 9), infill(r2lm, left, mask, 3, changed, 9))
    bidir = peaky(attention="bidirectional")
    assert not torch.equal(infill(bidir, left, mask, 3, right, 3), infill(bidir, left, mask, 3, changed, 3))
    # right-context tokens in a later window than the span are invisible to it (block factorisation): with block 4
    # the span's window [x_{a-1}, span, right_0, ..] holds no right-context token but right_0 after a 3-token span
    moved = torch.cat([right[:, :1], changed[:, 1:]], 1)
    assert torch.equal(infill(r2lm, left, mask, 3, right, 4), infill(r2lm, left, mask, 3, moved, 4))


def test_single_stream_infilling_fills_every_position():
    model = peaky(attention="bidirectional", prediction="inplace")
    left, mask, right = batch()
    span, nfe = ds.infill(model, left, mask, 5, right, mode="single", threshold=0.99)
    assert not (span == MASK_ID).any() and 1 <= nfe <= 5


def test_stdlib_split_is_deterministic_disjoint_and_path_stable(tmp_path):
    for name in ["a.py", "b.py", "pkg/c.py", "pkg/d.py", "site-packages/x.py", "pkg/__pycache__/c.py", "e.txt"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    train, held = ds.stdlib_split(seed=0, heldout_fraction=0.5, root=tmp_path)
    assert ds.stdlib_split(seed=0, heldout_fraction=0.5, root=tmp_path) == (train, held)
    names = sorted(p.relative_to(tmp_path).as_posix() for p in train + held)
    assert names == ["a.py", "b.py", "pkg/c.py", "pkg/d.py"] and not set(train) & set(held)
    (tmp_path / "z.py").write_text("y = 2\n")  # another file changes no other file's side
    train2, held2 = ds.stdlib_split(seed=0, heldout_fraction=0.5, root=tmp_path)
    assert set(held) <= set(held2) and set(train) <= set(train2)
    full_train, full_held = ds.stdlib_split(seed=0)
    assert 0.02 < len(full_held) / (len(full_train) + len(full_held)) < 0.1
    assert ds.stdlib_split(seed=1)[1] != full_held


SOURCE = '''import os


@decorator
def documented(a, b=1):
    """Add.

    More words.
    """
    c = a + b
    return c


def bare(x):
    return x


def only_doc():
    """Nothing else."""


class K:
    def method(self):
        """Not top level."""
        return 1


async def fetch(url):
    """Fetch it."""
    return await get(url)
'''


def test_extract_functions_splits_prompt_and_body(tmp_path):
    (tmp_path / "m.py").write_text(SOURCE)
    (tmp_path / "broken.py").write_text("def f(:\n")
    fns = ds.extract_functions([tmp_path / "m.py", tmp_path / "broken.py"])
    assert [f["name"] for f in fns] == ["documented", "fetch"]
    assert fns[0]["prompt"].startswith("@decorator\ndef documented") and fns[0]["prompt"].endswith('    """\n')
    assert fns[0]["body"] == "    c = a + b\n    return c\n"
    assert ds.extract_functions([tmp_path / "m.py"], first_lines=1)[0]["body"] == "    return c\n"
    assert ds.cut_body("    x = 1\n\n    return x\ndef g():\n    pass\n") == "    x = 1\n\n    return x\n"
    assert ds.body_of("\n    return x\ndef g():\n") == "    return x\n"
    assert ds.body_of(" more docstring\n    return x\n") == ""  # did not end the docstring line
    assert ds.normalise("    return c  \n\n\n") == ds.normalise("    return c\n")
    assert ds.parses(fns[0]["prompt"] + fns[0]["body"]) and not ds.parses(fns[0]["prompt"] + "    return (\n")


def test_code_prompts_stop_before_the_docstrings_newline(tmp_path):
    """BPE merges that newline with the body's indentation, so the model generates it (see eval.downstream)."""
    (tmp_path / "m.py").write_text(SOURCE)
    tok = tiny_tokenizer()
    items = ds.code_items(tok, heldout_fraction=0.999, root=tmp_path)
    assert [it["name"] for it in items] == ["documented", "fetch"]
    for it in items:
        assert tok.decode(it["prompt_ids"]) == it["prompt"][:-1]


@pytest.fixture
def tiny_checkpoint(tmp_path):
    def make(name, **overrides):
        tok = tiny_tokenizer()
        model = tiny_r2lm(open_gates=True, vocab_size=len(tok) + 1, mask_token_id=len(tok), eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, **overrides)
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
        return tmp_path / name
    return make


TEXT = "\n\n".join(
    ["the quick brown fox jumps over the lazy dog and a diffusion model decodes many tokens at once " * 2] * 4)


@pytest.mark.parametrize("overrides,mode,want", [
    (dict(sidecar_layers=[1, 3]), "auto", "block"),
    (dict(attention="bidirectional"), "auto", "single"),
    (dict(), "ar", "ar"),
], ids=["r2lm", "bidirectional", "ar"])
def test_infilling_runner_end_to_end(tiny_checkpoint, tmp_path, overrides, mode, want):
    path = tiny_checkpoint("m", **overrides)
    (tmp_path / "heldout.txt").write_text(TEXT)
    out = tmp_path / "infill.json"
    result = ds.main(["infill", str(path), "--data", str(tmp_path / "heldout.txt"), "--mode", mode, "--span-lengths",
                      "2", "5", "--right-context", "3", "--left-context", "16", "--max-items", "3", "--batch-size", "2",
                      "--block-size", "8", "--out", str(out), "--device", "cpu"])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result)) and saved["mode"] == want
    for m in ("2", "5"):
        r = saved["results"][m]
        assert r["items"] == 3 and 0 <= r["exact_match"] <= r["token_accuracy"] <= 1 and r["forwards"] > 0
        assert len(r["examples"]) == 3 and set(r["examples"][0]) == {"left", "span", "prediction", "right"}


def test_infill_items_are_the_same_for_every_model():
    tok = tiny_tokenizer()
    a = ds.infill_items(tok, [TEXT] * 3, [2, 4], right_context=3, left_context=10, seed=1, eos_id=0)
    b = ds.infill_items(tok, [TEXT] * 3, [2, 4], right_context=3, left_context=10, seed=1, eos_id=0)
    assert a == b and len(a) == 6
    for it in a:
        ids = tok(TEXT, add_special_tokens=False)["input_ids"]
        assert it["span"] == ids[it["start"] : it["start"] + it["span_length"]] and len(it["right"]) == 3
        assert it["left"][-1] == ids[it["start"] - 1] and len(it["left"]) <= 11


@pytest.mark.parametrize("overrides,mode", [(dict(sidecar_layers=[1, 3]), "auto"), (dict(attention="bidirectional"), "auto"),
                                            (dict(), "ar")], ids=["r2lm", "bidirectional", "ar"])
def test_code_completion_runner_end_to_end(tiny_checkpoint, tmp_path, overrides, mode):
    root = tmp_path / "stdlib"
    root.mkdir()
    (root / "m.py").write_text(SOURCE)
    (root / "n.py").write_text(SOURCE.replace("documented", "other"))
    path = tiny_checkpoint("m", **overrides)
    out = tmp_path / "code.json"
    result = ds.main(["code", str(path), "--mode", mode, "--stdlib-root", str(root), "--heldout-fraction", "0.999",
                      "--max-functions", "3", "--max-new-tokens", "12", "--max-body-tokens", "500", "--batch-size", "2",
                      "--out", str(out),
                      "--device", "cpu"])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result))
    r = saved["results"]
    assert r["functions"] == 3 and len(saved["per_function"]) == 3
    for key in ("exact_match", "parses", "parses_nonempty", "empty", "similarity"):
        assert 0 <= r[key] <= 1
    assert r["parses_nonempty"] <= r["parses"]
    for rec in saved["per_function"]:
        assert set(rec) == {"file", "name", "exact_match", "parses", "parses_nonempty", "empty", "similarity"}
