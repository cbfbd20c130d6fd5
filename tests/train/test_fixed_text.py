"""train/fixed_text.py: ShareGPT's training conversations as drafter records, read as they are. No held-out
conversation (nor an --exclude file's) is written; every reply span is exactly an assistant turn's tokens up to its
end-of-turn token, as decoding would tokenise them; the records train a drafter (train/drafter.py reads them)."""

import json

import pytest

from r2lm.workloads import conversation_of, is_heldout_prompt
from tests.helpers.models import make_model_dir
from train.drafter import read_records
from train.fixed_text import encode_conversation, main, messages_of

# the tiny tokenizer has no chat template: ChatML with its own specials
CHAT = ("{% for m in messages %}<|pad|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|pad|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = make_model_dir(tmp_path_factory.mktemp("fixed") / "model", sidecar_layers=[])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


def test_reply_spans_are_the_assistant_turns_as_decoding_reads_them(target):
    _, tokenizer = target
    conversation = {"id": "x_0", "conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "the quick"},
        {"from": "gpt", "value": "brown fox"}, {"from": "human", "value": "jumps"}, {"from": "gpt", "value": "over"},
        {"from": "gpt", "value": "broken order: cut here"}]}
    messages = messages_of(conversation)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    ids, spans = encode_conversation(tokenizer, messages, max_tokens=10_000)
    assert len(spans) == 2 and ids == ids[: spans[-1][1]]
    for (start, end), k in zip(spans, (2, 4), strict=True):
        prompt = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
        assert ids[:start] == tokenizer(prompt, add_special_tokens=False).input_ids  # the prompt decoding reads
        assert tokenizer.decode(ids[start:end]) == messages[k]["content"] + tokenizer.eos_token
    short, short_spans = encode_conversation(tokenizer, messages, max_tokens=spans[0][1])
    assert short_spans == spans[:1] and short == ids[: spans[0][1]]  # the turns after the last reply that fits


@pytest.mark.slow
def test_no_heldout_or_excluded_conversation_is_written(target, tmp_path):
    """On the packaged ShareGPT file (a few seconds)."""
    folder, _ = target
    out = tmp_path / "text.jsonl"
    assert main(["--target", str(folder), "--out", str(out), "--max-tokens", "30000"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records and sum(len(r["ids"]) for r in records) >= 30000
    assert not [r["id"] for r in records if is_heldout_prompt(r["id"])]
    assert all(r["spans"][0][0] == r["prompt_tokens"] and r["source"] == "sharegpt-text" for r in records)
    exclude = tmp_path / "exclude.jsonl"
    exclude.write_text("".join(json.dumps({"id": r["id"]}) + "\n" for r in records[:3]))
    again = tmp_path / "again.jsonl"
    assert main(["--target", str(folder), "--out", str(again), "--max-tokens", "30000", "--exclude", str(exclude)]) == 0
    left = {conversation_of(json.loads(line)["id"].partition("/")[2]) for line in again.read_text().splitlines()}
    assert not left & {conversation_of(r["id"].partition("/")[2]) for r in records[:3]}
    windows = read_records([str(out)], 64, "data.train")  # what training reads: seq_len windows with a reply token
    assert windows and all(0 < a < b <= len(w.ids) for w in windows for a, b in w.spans)


def test_bad_arguments_are_refused(target, tmp_path, capsys):
    folder, _ = target
    assert main(["--target", str(folder), "--out", str(tmp_path / "x.txt")]) == 2
    assert "name it *.jsonl" in capsys.readouterr().err
    assert main(["--target", str(folder), "--out", str(tmp_path / "x.jsonl"), "--max-tokens", "0"]) == 2
    assert "--max-tokens must be positive" in capsys.readouterr().err
    assert main(["--target", str(folder), "--out", str(tmp_path / "x.jsonl"), "--exclude", str(tmp_path / "no")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()
