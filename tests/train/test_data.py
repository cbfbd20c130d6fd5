"""The data pipeline (train/data.py): sources, packing, held-out split, rank sharding, deterministic order."""

import hashlib
import json
import os

import pytest
import torch

from tests.helpers.models import tiny_tokenizer
from tests.helpers.processes import python, run_cli
from tests.helpers.training import corpus_paragraphs
from train.config import load_config
from train.data import (
    EvalSet,
    IndexedBatches,
    StreamBatches,
    build_data,
    encode,
    is_heldout,
    is_heldout_text,
    pack,
    stream_sequences,
)
from train.sources import resolve_source

EOS = 0


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def cfg_for(tmp_path, train, **extra):
    items = [f"model={tmp_path}", f"output_dir={tmp_path / 'run'}", f"data.train={train}",
             f"data.cache_dir={tmp_path / 'cache'}", "seq_len=16", "micro_batch_size=2", "grad_accum=2"]
    items += [f"{k}={v}" for k, v in extra.items()]
    return load_config(None, items)


def build(cfg, tok, rank=0, world=1):
    return build_data(cfg, tok, EOS, rank, world, first_on_node=True, barrier=lambda: None)


def expected_stream(tok, docs, seq_len):
    flat = []
    for ids in encode(tok, docs):
        flat += ids + [EOS]
    return [flat[i : i + seq_len] for i in range(0, len(flat) - seq_len + 1, seq_len)]


# ---------------------------------------------------------------------------------------------- packing


def test_pack_appends_eos_to_every_document_and_carries_the_rest():
    seqs, rest = pack([[5, 6, 7], [], [8, 9]], eos_id=EOS, seq_len=3)
    assert seqs == [[5, 6, 7], [EOS, 8, 9]] and rest == [EOS]  # the empty document adds nothing
    seqs, rest = pack([[1]], eos_id=EOS, seq_len=4, carry=rest)
    assert seqs == [] and rest == [EOS, 1, EOS]


def test_text_file_packs_into_eos_separated_sequences(tmp_path, tok):
    docs = corpus_paragraphs(50)
    (tmp_path / "train.txt").write_text("\n\n".join(docs) + "\n")
    data = build(cfg_for(tmp_path, tmp_path / "train.txt"), tok)
    rows = [data.train.dataset[i]["input_ids"] for i in range(data.num_train_sequences)]
    assert rows == expected_stream(tok, docs, 16)  # in document order, nothing lost but the tail
    assert sum(r.count(EOS) for r in rows) >= 45  # one separator per document (the tail may cut the last few)


def test_mask_and_eos_text_inside_documents_stay_ordinary_tokens(tok):
    ids = encode(tok, ["plain <|endoftext|> text"])[0]
    assert EOS not in ids


# ---------------------------------------------------------------------------------------------- formats


def test_jsonl_parquet_and_text_inputs_give_the_same_sequences(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = corpus_paragraphs(40)
    (tmp_path / "a.txt").write_text("\n\n".join(docs) + "\n")
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))
    pq.write_table(pa.table({"body": docs, "n": list(range(len(docs)))}), tmp_path / "a.parquet")
    results = []
    for name in ("a.txt", "a.jsonl", "a.parquet"):
        data = build(cfg_for(tmp_path, tmp_path / name, **{"data.text_field": "body"}), tok)
        results.append(data.train.dataset["input_ids"])
    assert results[0] == results[1] == results[2] == expected_stream(tok, docs, 16)


def test_text_units_line_and_document(tmp_path, tok):
    (tmp_path / "t.txt").write_text("the quick brown fox\njumps over the lazy dog\n\na diffusion model\n")
    by_line = build(cfg_for(tmp_path, tmp_path / "t.txt", **{"data.text_unit": "line", "seq_len": 4}), tok)
    lines = ["the quick brown fox", "jumps over the lazy dog", "a diffusion model"]
    assert by_line.train.dataset["input_ids"] == expected_stream(tok, lines, 4)


def test_folder_and_glob_sources(tmp_path):
    (tmp_path / "d").mkdir()
    for i in range(3):
        (tmp_path / "d" / f"part{i}.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "d" / "notes.bin").write_bytes(b"\0")
    assert len(resolve_source(str(tmp_path / "d")).files) == 3
    assert resolve_source(str(tmp_path / "d" / "part*.jsonl")).builder == "json"
    assert resolve_source([str(tmp_path / "d" / "part0.jsonl"), str(tmp_path / "d" / "part1.jsonl")]).files[1].endswith("part1.jsonl")
    assert resolve_source("HuggingFaceFW/fineweb-edu") .name == "HuggingFaceFW/fineweb-edu"


@pytest.mark.parametrize(
    "make,spec,message",
    [
        (lambda p: None, "missing.txt", "no such file: missing.txt"),
        (lambda p: (p / "empty.jsonl").write_text(""), "{p}/empty.jsonl", "is empty"),
        (lambda p: (p / "f").mkdir(), "{p}/f", "holds no data file"),
        (lambda p: None, "{p}/nothing*.txt", "matches no file"),
        (lambda p: ((p / "a.txt").write_text("x"), (p / "b.jsonl").write_text("{}")), ["{p}/a.txt", "{p}/b.jsonl"], "different formats"),
        (lambda p: (p / "a.txt").write_text("x"), ["{p}/a.txt", "org/some-dataset"], "not a mix"),
    ],
)
def test_bad_sources(tmp_path, make, spec, message):
    make(tmp_path)
    spec = [s.format(p=tmp_path) for s in spec] if isinstance(spec, list) else spec.format(p=tmp_path)
    with pytest.raises(ValueError, match=message):
        resolve_source(spec)


def test_missing_text_field_names_the_columns(tmp_path, tok):
    (tmp_path / "a.jsonl").write_text('{"content": "the quick brown fox"}\n')
    with pytest.raises(ValueError, match=r"has no column 'text' \(columns: \['content'\]\); set data.text_field"):
        build(cfg_for(tmp_path, tmp_path / "a.jsonl"), tok)


def test_data_shorter_than_one_sequence_is_an_error(tmp_path, tok):
    (tmp_path / "a.txt").write_text("the fox\n")  # 7 byte-level tokens + EOS < 16
    with pytest.raises(ValueError, match="yields no complete sequence of 16 tokens"):
        build(cfg_for(tmp_path, tmp_path / "a.txt"), tok)


def test_offline_local_files_work_and_hub_names_fail_clearly(tmp_path):
    """With HF_DATASETS_OFFLINE=1 local files load; an uncached hub dataset is a ValueError that says why."""
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus_paragraphs(30)))
    script = f"""
from tests.helpers.models import tiny_tokenizer
from train.config import load_config
from train.data import build_data
tok = tiny_tokenizer()
def cfg(train):
    return load_config(None, ["model=m", "output_dir=o", f"data.train={{train}}", "data.cache_dir={tmp_path / 'cache'}", "seq_len=16"])
data = build_data(cfg("{tmp_path / 'a.jsonl'}"), tok, 0, 0, 1, True, lambda: None)
print("local", data.num_train_sequences)
try:
    build_data(cfg("r2lm-test-org/no-such-dataset"), tok, 0, 0, 1, True, lambda: None)
except ValueError as err:
    print("hub", err)
"""
    out = run_cli(python("-c", script), env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "local " in out.stdout and int(out.stdout.split("local ")[1].split()[0]) > 0
    assert "hub cannot load hub dataset r2lm-test-org/no-such-dataset (HF_DATASETS_OFFLINE is set" in out.stdout


# ---------------------------------------------------------------------------------------------- held out


def test_heldout_fraction_is_exact_and_disjoint(tmp_path, tok):
    assert sum(is_heldout(i, 0.1) for i in range(1000)) == 100
    assert [i for i in range(30) if is_heldout(i, 0.25)] == [3, 7, 11, 15, 19, 23, 27]
    docs = corpus_paragraphs(200)
    (tmp_path / "a.txt").write_text("\n\n".join(docs) + "\n")
    data = build(cfg_for(tmp_path, tmp_path / "a.txt", **{"data.heldout_fraction": 0.1}), tok)
    held_docs = [d for i, d in enumerate(docs) if is_heldout(i, 0.1)]
    train_docs = [d for i, d in enumerate(docs) if not is_heldout(i, 0.1)]
    assert data.train.dataset["input_ids"] == expected_stream(tok, train_docs, 16)
    assert [data.heldout.batch([i])[0].tolist() for i in range(data.heldout.n)] == expected_stream(tok, held_docs, 16)


def test_separate_heldout_file(tmp_path, tok):
    (tmp_path / "a.txt").write_text("\n\n".join(corpus_paragraphs(100)) + "\n")
    (tmp_path / "h.txt").write_text("\n\n".join(corpus_paragraphs(20, seed=5)) + "\n")
    data = build(cfg_for(tmp_path, tmp_path / "a.txt", **{"data.heldout": tmp_path / "h.txt"}), tok)
    assert data.heldout.n == len(expected_stream(tok, corpus_paragraphs(20, seed=5), 16))


def test_eval_plan_covers_the_heldout_set_once_with_equal_batch_counts():
    rows = [[i] * 4 for i in range(5)]
    plans = [EvalSet(rows, micro_batch_size=2, world=2, max_batches=10).plan(r) for r in range(2)]
    assert len(plans[0]) == len(plans[1]) == 2  # the same number of forwards on every rank (ZeRO-3)
    real = sorted(i for plan in plans for _, idx, w in plan if w for i in idx)
    assert real == list(range(5))
    assert len(EvalSet(rows, 2, 2, max_batches=1).plan(0)) == 1
    assert [w for _, _, w in plans[1]] == [1.0, 0.0]  # rank 1 ran out: a filler batch of weight 0


# ---------------------------------------------------------------------------------------------- order and sharding


class _Rows(list):
    def __getitem__(self, idx):
        return {"input_ids": [list.__getitem__(self, i) for i in idx]} if isinstance(idx, list) else list.__getitem__(self, idx)


def make_batches(n, rank, world, seed=0, mbs=2, gas=3):
    return IndexedBatches(_Rows([[i, i] for i in range(n)]), mbs, gas, rank, world, seed)


def test_rank_shards_are_disjoint_and_cover_each_step():
    n, world, mbs, gas = 50, 2, 2, 3
    ranks = [make_batches(n, r, world) for r in range(world)]
    for step in range(4):
        seen = [i for b in ranks for m in range(gas) for i in b.indices(step, m)]
        assert len(seen) == len(set(seen)) == world * mbs * gas  # disjoint
        positions = sorted(q for b in ranks for m in range(gas) for q in b.positions(step, m))
        assert positions == list(range(step * 12, (step + 1) * 12))  # together: exactly the step's global batch


def test_an_epoch_visits_every_sequence_once_then_reshuffles():
    n, world, gas = 24, 2, 3  # 2 sequences x 3 micro-steps x 2 ranks = 12 per step: 2 steps per epoch
    ranks = [make_batches(n, r, world) for r in range(world)]
    epoch = [i for s in range(2) for b in ranks for m in range(gas) for i in b.indices(s, m)]
    assert sorted(epoch) == list(range(n))
    nxt = [i for s in range(2, 4) for b in ranks for m in range(gas) for i in b.indices(s, m)]
    assert sorted(nxt) == list(range(n)) and nxt != epoch


def test_order_is_a_function_of_seed_and_step_only():
    a, b = make_batches(100, 0, 2, seed=3), make_batches(100, 0, 2, seed=3)
    for step in range(5):  # a reads every step, b jumps straight to the last (a resumed run)
        a(step, 0)
    assert torch.equal(a(7, 1), b(7, 1))
    assert not torch.equal(make_batches(100, 0, 2, seed=4)(7, 1), b(7, 1))
    assert a(0, 0).shape == (2, 2)


def test_stream_batches_fast_forward_to_the_same_batches(tok):
    docs = [{"text": d} for d in corpus_paragraphs(120)]
    reference = StreamBatches(stream_sequences(docs, tok, EOS, 16, "t"), 2, 3)
    sequential = [reference(s, m) for s in range(4) for m in range(3)]
    resumed = StreamBatches(stream_sequences(docs, tok, EOS, 16, "t"), 2, 3)
    assert torch.equal(resumed(2, 1), sequential[2 * 3 + 1])
    assert torch.equal(resumed(3, 2), sequential[-1])
    with pytest.raises(RuntimeError, match="already read"):
        resumed(0, 0)


def test_streaming_shards_documents_across_ranks(tmp_path, tok):
    docs = [f"document number {i} " + corpus_paragraphs(1, seed=i)[0] for i in range(64)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = cfg_for(tmp_path, tmp_path / "a.jsonl", **{"data.streaming": "true", "data.shuffle_buffer": 16, "seq_len": 8})
    texts = []
    for rank in range(2):
        data = build(cfg, tok, rank=rank, world=2)
        rows = torch.cat([data.train(s, m) for s in range(3) for m in range(2)])
        texts.append(tok.decode(rows.flatten().tolist()))
        again = build(cfg, tok, rank=rank, world=2)
        assert torch.equal(again.train(2, 1), rows[-2:])  # deterministic, and resumable by fast-forward
    numbers = [{int(w) for w in t.replace("<|endoftext|>", " ").split() if w.isdigit() and "number " + w in t} for t in texts]
    assert numbers[0] and numbers[1] and not (numbers[0] & numbers[1])  # each document goes to one rank


@pytest.mark.parametrize("shuffle_buffer, world", [(0, 1), (8, 1), (0, 2), (8, 2)])
def test_streaming_heldout_documents_never_reach_training(tmp_path, tok, shuffle_buffer, world):
    """Several files, shuffled and split across ranks by file: the held-out documents stay out of every rank's
    training stream, over several epochs, and every other document is trained on."""
    for f in range(3):
        (tmp_path / f"p{f}.jsonl").write_text("".join(json.dumps({"text": f"doc {f * 13 + i:03d} ."}) + "\n"
                                                      for i in range(13)))
    cfg = cfg_for(tmp_path, tmp_path, **{"data.streaming": "true", "data.heldout_fraction": 0.2, "seq_len": 8,
                                         "data.shuffle_buffer": shuffle_buffer, "eval_batches": 50})
    seen = lambda rows: {int(w) for w in tok.decode(torch.cat(rows).flatten().tolist()).split() if w.isdigit()}  # noqa: E731
    trained = set()
    for rank in range(world):
        data = build(cfg, tok, rank=rank, world=world)
        held = seen([data.heldout.batch([i]) for i in range(data.heldout.n)])
        trained |= seen([data.train(step, m) for step in range(20) for m in range(2)])  # several epochs
    want = {i for i in range(39) if is_heldout_text(f"doc {i:03d} .", 0.2)}
    assert want and held == want  # the held-out stream: exactly those (its rows cover every held-out document)
    assert not trained & held and trained | held == set(range(39))


@pytest.mark.parametrize("text,kind", [(None, "null"), (3, "a number"), (["alpha", "beta"], "an array")],
                         ids=["null", "number", "pair"])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_record_whose_text_is_not_a_string_is_named(tmp_path, tok, text, kind, streaming):
    """The tokenizer would read a 2-list as a text pair ("alphabeta") and fail on null naming nothing."""
    data = tmp_path / "a.jsonl"
    data.write_text(json.dumps({"text": "fine words"}) + "\n" + json.dumps({"text": text}) + "\n")
    cfg = cfg_for(tmp_path, data, **{"data.streaming": str(streaming).lower(), "seq_len": 4})
    with pytest.raises(ValueError, match=rf"^{data}, line 2: its 'text' is {kind}, not a string$"):
        data = build(cfg, tok)
        data.train(0, 0)


GOOD_RECORDS = "".join(json.dumps({"text": d}) + "\n" for d in corpus_paragraphs(30))


@pytest.mark.parametrize("name,content,where", [
    ("a.jsonl", '{"text": "a"}\n\n{"text": "b"} {"text": "c"}\n{"text": "d\n{"text": "e"}\n',
     r"line 4: not JSON \(Unterminated string starting at: column 10\)"),
    ("a.jsonl", '{"text": "a"}\n{"text": "b"},\n', r"line 2: not JSON \(Expecting value: column 14\)"),
    ("a.jsonl", '{"text": "a"}\n42\n', r"line 2: holds a number, not an object \(a record\)"),
    ("a.jsonl", b'{"text": "a"}\n{"text": "\xff"}\n', r"line 2: not UTF-8 text \(byte 0xff at column 11\)"),
    ("a.json", '[{"text": "a"},\n {"text": }]\n', r"line 2: not JSON \(Expecting value: column 11\)"),
], ids=["unterminated", "comma", "number", "not-utf8", "array"])
@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("after", [False, True], ids=["alone", "after-a-good-file"])
def test_a_bad_json_line_is_named_with_its_file_and_line(tmp_path, tok, name, content, where, streaming, after):
    """Before: "DatasetGenerationError: An error occurred while generating the dataset" (in memory) or pyarrow's
    "JSON parse error: Invalid value. in row 2" (streaming: rows count per block, and the file goes unnamed). A
    stream meets a bad record of a later file only as training reaches it."""
    bad = tmp_path / name
    bad.write_bytes(content.encode() if isinstance(content, str) else content)
    files = [tmp_path / "good.jsonl", bad] if after else [bad]
    (tmp_path / "good.jsonl").write_text(GOOD_RECORDS)
    cfg = cfg_for(tmp_path, f"[{', '.join(map(str, files))}]", **{"data.streaming": str(streaming).lower(),
                                                                  "data.shuffle_buffer": 0, "seq_len": 4})
    with pytest.raises(ValueError, match=rf"^{bad}, {where}$"):
        data = build(cfg, tok)
        for step in range(1000):
            data.train(step, 0)


def test_data_changes_name_new_gone_and_changed_files(tmp_path):
    """What a resumed run compares (train/checks.py check_resume): a file touched without a change is unchanged."""
    from train.sources import data_changes, fingerprint

    folder = tmp_path / "data"
    folder.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (folder / name).write_text(f"the words of {name}\n")
    files = resolve_source(str(folder)).files
    record = fingerprint(files)
    assert record[files[0]]["sha256"] == hashlib.sha256(b"the words of a.txt\n").hexdigest()
    later = record[files[0]]["mtime_ns"] + 10**9
    os.utime(files[0], ns=(later, later))  # touched (or copied): the same bytes
    assert data_changes(record, files) == []
    (folder / "b.txt").write_text("the words of B.txt\n")
    os.utime(folder / "b.txt", ns=(later, later))
    (folder / "c.txt").write_text("longer words of c.txt\n")
    (folder / "a.txt").unlink()
    (folder / "d.txt").write_text("new words\n")
    assert data_changes(record, resolve_source(str(folder)).files) == [
        f"{folder / 'b.txt'} changed (the same size, other content)", f"{folder / 'c.txt'} changed (19 bytes then, 22 now)",
        f"{folder / 'd.txt'} is new", f"{folder / 'a.txt'} is gone"]


def test_a_data_folder_skips_hidden_folders(tmp_path, tok):
    """An editor's or notebook's copies (.ipynb_checkpoints/) are not training data."""
    (tmp_path / "data" / ".ipynb_checkpoints").mkdir(parents=True)
    (tmp_path / "data" / "a.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    (tmp_path / "data" / ".ipynb_checkpoints" / "a-checkpoint.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    assert resolve_source(str(tmp_path / "data")).files == [str(tmp_path / "data" / "a.jsonl")]


def test_streaming_with_heldout_fraction_and_epochs(tmp_path, tok):
    docs = corpus_paragraphs(40)
    (tmp_path / "a.txt").write_text("\n\n".join(docs) + "\n")
    cfg = cfg_for(tmp_path, tmp_path / "a.txt", **{"data.streaming": "true", "data.heldout_fraction": 0.25,
                                                  "data.shuffle_buffer": 0})
    data = build(cfg, tok)
    held = [d for d in docs if is_heldout_text(d, 0.25)]
    assert [data.heldout.batch([i])[0].tolist() for i in range(data.heldout.n)] == expected_stream(tok, held, 16)[: data.heldout.n]
    per_epoch = len(expected_stream(tok, [d for d in docs if not is_heldout_text(d, 0.25)], 16))
    steps = per_epoch // 4 + 2  # 4 sequences per step: runs into the second epoch
    assert all(data.train(s, m).shape == (2, 16) for s in range(steps) for m in range(2))
