"""N-gram tables (r2lm.ngram) and their drafts in verified decoding: the table drafts what a brute-force count of
the corpus, written from the module's description, drafts; whatever it drafts, the output is transformers' greedy
output; a table is written whole, read back equal, refused when damaged, not a table, or built for another
vocabulary."""

import json
import shutil
from collections import Counter

import numpy as np
import pytest
import torch

from r2lm import R2LMForDiffusionLM, generate
from r2lm.generation.policy import Adaptive, Longest
from r2lm.ngram import CONFIG, TABLE, NGramTable, TableConfig, main, reply_labels, sharegpt_replies
from tests.generation.test_drafter import trained
from tests.helpers.decoding import left_padded
from tests.helpers.models import MASK_ID, VOCAB, make_model_dir, tiny_conversion

FILL = 99


def brute_force(corpus: list[list[int]], order: int, min_count: int, text: list[int], size: int, labels=None):
    """(drafts, confidences): each next token the one most often after the longest context of 1 .. order tokens
    ending the text (and the tokens drafted before it) seen at least min_count times inside one sequence of the
    corpus (the lowest id among equals), with its share of that context's occurrences; FILL (0.0) once none is.
    With `labels`, the token after a context at position i of a sequence is its label there (none where -1)."""
    follows: dict[tuple, Counter] = {}
    for number, sequence in enumerate(corpus):
        after = sequence if labels is None else labels[number]
        for i in range(1, len(sequence)):
            for n in range(1, min(order, i) + 1):
                if after[i] >= 0:
                    follows.setdefault(tuple(sequence[i - n : i]), Counter())[after[i]] += 1
    text, drafts, confidences = list(text), [], []
    for _ in range(size):
        guess = None
        for n in range(min(order, len(text)), 0, -1):
            counts = follows.get(tuple(text[-n:]))
            if min(text[-n:]) >= 0 and counts and sum(counts.values()) >= min_count:
                most = max(counts.values())
                guess = (min(t for t, c in counts.items() if c == most), most / sum(counts.values()))
                break
        if guess is None:
            break
        drafts.append(guess[0])
        confidences.append(guess[1])
        text.append(guess[0])
    return drafts + [FILL] * (size - len(drafts)), confidences + [0.0] * (size - len(drafts))


def test_drafts_are_the_brute_force_count():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        vocab = int(torch.randint(3, 7, (1,), generator=g))  # few tokens: contexts recur, counts tie
        corpus = [torch.randint(0, vocab, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(int(torch.randint(0, 5, (1,), generator=g)))]
        order, min_count = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        table = NGramTable.build(corpus, vocab, order, min_count)
        size = int(torch.randint(1, 6, (1,), generator=g))
        texts = [torch.randint(0, vocab, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(3)]
        drafts, confidences = table.draft(texts, size, FILL)
        for row, tokens in enumerate(texts):
            want, sure = brute_force(corpus, order, min_count, tokens, size)
            assert drafts[row].tolist() == want, (trial, row, tokens, corpus)
            assert confidences[row].tolist() == pytest.approx(sure), (trial, row)


def test_labelled_drafts_are_the_brute_force_count_of_the_labels():
    """A table counting other tokens after each context (the target's greedy ones) drafts what a count of those
    labels drafts; positions labelled -1 count nothing."""
    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        vocab = int(torch.randint(3, 7, (1,), generator=g))
        corpus = [torch.randint(0, vocab, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(int(torch.randint(1, 5, (1,), generator=g)))]
        labels = [torch.randint(-1, vocab, (len(sequence),), generator=g).tolist() for sequence in corpus]
        order, min_count = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        table = NGramTable.build(corpus, vocab, order, min_count, labels=labels)
        assert table.config.tokens == sum(label >= 0 for row in labels for label in row)
        texts = [torch.randint(0, vocab, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(3)]
        drafts, confidences = table.draft(texts, 4, FILL)
        for row, tokens in enumerate(texts):
            want, sure = brute_force(corpus, order, min_count, tokens, 4, labels)
            assert drafts[row].tolist() == want, (trial, row, tokens, corpus, labels)
            assert confidences[row].tolist() == pytest.approx(sure), (trial, row)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 5\)"):
        NGramTable.build([[1, 2, 5]], 5)
    with pytest.raises(ValueError, match="order must be in"):
        NGramTable.build([[1, 2]], 5, order=9)
    with pytest.raises(ValueError, match="min_count must be a positive integer"):
        NGramTable.build([[1, 2]], 5, min_count=0)
    with pytest.raises(ValueError, match="labels must be one sequence per text sequence, of its length"):
        NGramTable.build([[1, 2]], 5, labels=[[1]])
    with pytest.raises(ValueError, match=r"a label is outside the vocabulary \[0, 5\)"):
        NGramTable.build([[1, 2]], 5, labels=[[-1, 5]])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(transformers model, its R2LM conversion, a table of the target's greedy text on the tests' prompts with a
    token in five changed: its drafts are mostly right, not always)."""
    hf, target = tiny_conversion(tmp_path_factory.mktemp("ngram"), "qwen3", sidecar_layers=[])
    ids, mask = left_padded()
    text = hf.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=None)
    g = torch.Generator().manual_seed(7)
    corpus = []
    for row, pad in zip(text, (mask == 0).sum(1).tolist(), strict=True):
        row = row[pad:].clone()
        changed = torch.rand(len(row), generator=g) < 0.2
        row[changed] = torch.randint(0, MASK_ID - 1, (int(changed.sum()),), generator=g)
        corpus.append(row.tolist())
    return hf, target, NGramTable.build(corpus, VOCAB, min_count=1)


def test_reply_labels_are_the_replies_or_the_targets_greedy_tokens(setup):
    """Inside the reply spans: the reply's own tokens, or with the model transformers' greedy token after the
    record's text before each position; -1 elsewhere."""
    hf, target, _ = setup
    ids = torch.randint(0, MASK_ID - 1, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    spans = [[5, 12], [20, 40]]
    inside = torch.zeros(40, dtype=torch.bool)
    for start, end in spans:
        inside[start:end] = True
    text = torch.tensor(reply_labels(ids, spans))
    assert text[inside].tolist() == torch.tensor(ids)[inside].tolist() and (text[~inside] == -1).all()
    with torch.no_grad():
        greedy = hf(torch.tensor([ids])).logits[0].argmax(-1)  # greedy[p - 1]: the token after ids[:p]
    labels = torch.tensor(reply_labels(ids, spans, target))
    assert labels[inside].tolist() == greedy[torch.nonzero(inside)[:, 0] - 1].tolist() and (labels[~inside] == -1).all()


def test_a_table_of_records_counts_their_replies_or_the_models_greedy_tokens(tmp_path, capsys):
    """`python -m r2lm.ngram build --records FILE [--greedy [--cache DIR]]`: the table NGramTable.build counts of
    the records' labels, the labels kept in the cache and read back from there, another model's cache refused;
    misuse and a broken record are refused by name, and nothing is written."""
    folder = make_model_dir(tmp_path / "model")
    g = torch.Generator().manual_seed(4)
    records = [{"ids": torch.randint(0, 200, (n,), generator=g).tolist(), "spans": [[3, n // 2], [n // 2 + 2, n]]}
               for n in (30, 41, 25)]
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    model = R2LMForDiffusionLM.from_pretrained(folder).eval()
    ids = [r["ids"] for r in records]
    for greedy in (False, True):
        out = tmp_path / f"table{greedy}"
        main(["build", "--model", str(folder), "--out", str(out), "--records", str(path), "--min-count", "1",
              "--dtype", "float32"] + ["--greedy"] * greedy)
        labels = [reply_labels(r["ids"], r["spans"], model if greedy else None) for r in records]
        want = NGramTable.build(ids, model.config.vocab_size, min_count=1, labels=labels)
        table = NGramTable.load(out)
        assert torch.equal(table.keys, want.keys) and torch.equal(table.next, want.next)
        assert ("greedy" in table.config.corpus) == greedy and table.config.tokens == sum(
            (label >= 0).sum() for label in labels)
    cache = tmp_path / "cache"  # --greedy's labels kept as made, read back by a run started again
    args = ["build", "--model", str(folder), "--records", str(path), "--min-count", "1", "--dtype", "float32",
            "--greedy", "--cache", str(cache)]
    main(args + ["--out", str(tmp_path / "cached")])
    assert torch.equal(NGramTable.load(tmp_path / "cached").next, table.next)
    with np.load(cache / "000000.npz") as shard:
        assert shard["labels"].tolist() == np.concatenate(labels).tolist()
        np.savez(cache / "000000.npz", labels=np.where(shard["labels"] >= 0, 7, -1), lengths=shard["lengths"])
    main(args + ["--out", str(tmp_path / "read")])
    assert set(NGramTable.load(tmp_path / "read").next.tolist()) == {7}  # read, not made again
    other = make_model_dir(tmp_path / "other", hidden_size=48)
    with pytest.raises(SystemExit):
        main(args[:2] + [str(other)] + args[3:] + ["--out", str(tmp_path / "refused")])
    assert "holds labels of another model or records" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(records[0]) + "\n" + json.dumps({"ids": [1, 2], "spans": [[1, 5]]}) + "\n")
    for args, message in ((["--greedy"], "--greedy and --max-tokens read --records"),
                          (["--records", str(path), "--cache", str(cache)], "--cache keeps --greedy's labels"),
                          (["--records", str(broken)], "line 2: a reply span lies outside the record's 2 tokens"),
                          (["--records", str(tmp_path / "none.jsonl")], "no such file")):
        with pytest.raises(SystemExit):
            main(["build", "--model", str(folder), "--out", str(tmp_path / "refused")] + args)
        assert message in capsys.readouterr().err
        assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("kind", ["ngram", "lookup+ngram", "lookup+ngram+drafter"])
def test_drafts_never_change_the_output(setup, kind):
    """A left-padded batch, an EOS that stops a row early, every draft whole or the adaptive policy's choices:
    transformers' greedy output, with drafts accepted."""
    hf, target, table = setup
    options = dict(drafter=trained(target)) if "drafter" in kind else {}
    ids, mask = left_padded()
    for eos in (None, "row 0's sixth"):
        greedy = hf.generate(ids, attention_mask=mask, max_new_tokens=23, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
        eos_id = None if eos is None else int(greedy[0, ids.shape[1] + 5])
        if eos_id is not None:
            greedy = hf.generate(ids, attention_mask=mask, max_new_tokens=23, do_sample=False, pad_token_id=0,
                                 eos_token_id=eos_id)
        for policy in (Longest(), Adaptive()):
            out = generate(target, ids, mask, max_new_tokens=23, verify=True, ngram=table, verify_draft=kind,
                           verify_policy=policy, eos_token_id=eos_id, pad_token_id=0, **options)
            got = out.sequences[:, : greedy.shape[1]]
            assert torch.equal(got, greedy), (kind, eos, type(policy).__name__)
            if isinstance(policy, Longest):
                assert out.steps < out.sequences.shape[1] - ids.shape[1]  # drafts were accepted: fewer steps than tokens


def test_a_table_of_another_vocabulary_and_misused_options_are_refused(setup):
    _, target, table = setup
    ids = torch.randint(0, MASK_ID - 1, (1, 5))
    other = NGramTable.build([[1, 2, 3]], VOCAB - 1)
    with pytest.raises(ValueError, match=f"built for a vocabulary of {VOCAB - 1} tokens"):
        generate(target, ids, max_new_tokens=4, verify=True, ngram=other)
    cases = [(dict(ngram=table), "pass verify=True"),
             (dict(verify=True, verify_draft="ngram"), r"needs an n-gram table \(ngram=...\)"),
             (dict(verify=True, ngram=table, verify_draft="lookup"), "does not use the ngram given"),
             (dict(verify=True, ngram="table"), "ngram must be an r2lm.ngram.NGramTable")]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            generate(target, ids, max_new_tokens=4, **options)


def test_a_table_is_saved_whole_and_read_back_equal(setup, tmp_path):
    table = setup[2]
    table.save(tmp_path / "table")
    back = NGramTable.load(tmp_path / "table")
    assert back.config == table.config and torch.equal(back.keys, table.keys) and torch.equal(back.next, table.next)
    assert torch.allclose(back.confidence, table.confidence, atol=1e-3)  # kept in float16
    assert (back.draft([[3, 4, 5, 6]], 5, FILL)[0] == table.draft([[3, 4, 5, 6]], 5, FILL)[0]).all()
    # an existing folder is replaced only when asked, and only if r2lm wrote it; nothing else is touched
    with pytest.raises(ValueError, match="already exists; pass --overwrite"):
        table.save(tmp_path / "table")
    table.save(tmp_path / "table", overwrite=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="it was not written by r2lm"):
        table.save(other, overwrite=True)
    assert (other / "notes.txt").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["other", "table"]


@pytest.mark.parametrize("damage", [TABLE, CONFIG])
def test_a_damaged_table_is_refused_by_name(setup, tmp_path, damage):
    setup[2].save(tmp_path / "table")
    path = tmp_path / "table" / damage
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{damage} is damaged"):
        NGramTable.load(tmp_path / "table")
    with pytest.raises(ValueError, match="is not an n-gram table folder"):
        NGramTable.load(tmp_path)


def test_the_shipped_table_loads_and_drafts():
    """r2lm/ngrams/smollm2-135m-instruct: small, checked against its checksums, counted from ShareGPT's training
    split in SmolLM2's vocabulary, found by its target's digest; a one-token context it holds drafts its token."""
    from r2lm.ngram import SHIPPED

    folder = SHIPPED / "smollm2-135m-instruct"
    assert sorted(p.name for p in folder.iterdir()) == ["checksums.sha256", CONFIG, TABLE]
    assert (folder / TABLE).stat().st_size <= 8 * 2**20
    table = NGramTable.load(folder)
    config = json.loads((folder / CONFIG).read_text())
    assert TableConfig(**config) == table.config and table.config.vocab_size == 49153
    assert len(config["target_digest"]) == 16 and "training split" in table.config.corpus and table.config.tokens > 10**7
    bits, order = table.config.bits, table.config.order
    single = (table.keys >> (bits * order)) == 1  # contexts of one token
    token = int(table.keys[single][100] & (2**bits - 1))
    drafts, confidence = table.draft([[token]], 4, FILL)
    assert int(drafts[0, 0]) == int(table.next[single][100]) and (confidence[0, :1] > 0).all()


def test_a_damaged_copy_of_the_shipped_table_is_refused(tmp_path):
    from r2lm.ngram import SHIPPED

    copy = tmp_path / "table"
    shutil.copytree(SHIPPED / "smollm2-135m-instruct", copy)
    path = copy / TABLE
    data = bytearray(path.read_bytes())
    data[-20] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{TABLE} is damaged"):
        NGramTable.load(copy)


def test_sharegpt_replies_are_the_training_split_assistant_turns():
    from r2lm.workloads import conversation_of, heldout_conversations, sharegpt_split

    conversations = [c for _, c in zip(range(50), sharegpt_split("train"), strict=False)]
    held = heldout_conversations()
    assert not any(conversation_of(c["id"]) in held for c in conversations)
    want = [turn["value"] for c in conversations for turn in c["conversations"] if turn["from"] == "gpt" and turn["value"]]
    assert list(sharegpt_replies(limit=50)) == want and want
