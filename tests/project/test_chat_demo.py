"""scripts/chat_demo.py, the quickstart's last step, on a tiny model: every verified line is the reference's greedy
text (it says so, and exits 0), each decoder is warmed up and timed for every prompt, AR in every pass."""

import importlib.util
from collections import Counter

import torch

from r2lm import R2LMForDiffusionLM
from r2lm.convert.from_hf import convert_from_hf
from r2lm.drafter import Drafter, DrafterConfig
from tests.helpers import REPO
from tests.helpers.models import sharp_hf, tiny_tokenizer

SCRIPT = REPO / "scripts" / "chat_demo.py"
spec = importlib.util.spec_from_file_location("chat_demo", SCRIPT)
chat_demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chat_demo)

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %} the{% endif %}"


def test_the_demo_checks_every_verified_line_against_the_reference(tmp_path, capsys, monkeypatch):
    source = tmp_path / "hf"
    tokenizer = tiny_tokenizer()  # byte-level: 256 bytes, merges, specials; [MASK] added as convert from-hf adds it
    tokenizer.add_special_tokens({"mask_token": "<|mask|>"})
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(source)
    sharp_hf("qwen3", vocab_size=len(tokenizer)).save_pretrained(source)
    r2lm = convert_from_hf(source, tmp_path / "r2lm", mask_token_id=tokenizer.mask_token_id, sidecar_layers=[1],
                           block_size=4)
    torch.manual_seed(0)  # an untrained drafter: its line must be the reference's text all the same
    Drafter(DrafterConfig.for_target(R2LMForDiffusionLM.from_pretrained(r2lm).config, block_size=4)).save_pretrained(
        tmp_path / "drafter")
    calls = Counter()
    generate = chat_demo.generate

    def counted(model, ids, **options):  # which decoder ran: AR is block size 1, parallel has a threshold
        calls["AR" if options.get("block_size") == 1 else "parallel" if "threshold" in options
              else "drafter" if "drafter" in options else options.get("verify_draft", "window")] += 1
        return generate(model, ids, **options)

    monkeypatch.setattr(chat_demo, "generate", counted)
    prompts = ["the quick brown fox", "a diffusion model"]
    assert chat_demo.main([str(r2lm), "--reference", str(source), "--max-new-tokens", "6", "--passes", "3",
                           "--threads", "1", "--drafter", str(tmp_path / "drafter"), *[a for p in prompts for a in ("--prompt", p)]]) == 0
    out = capsys.readouterr().out
    assert "identical to the original model's own greedy generate: True" in out
    table = out[out.index("decoding"):].splitlines()[1:]
    assert [line.split()[0] for line in table] == ["cached", "verify,", "verify,", "verify,", "AR"]
    # warm-up, then each prompt once in the first pass; AR (the yardstick) in every pass
    assert calls["AR"] == 1 + 3 * len(prompts) and all(n >= 1 + len(prompts) for n in calls.values())
    assert set(calls) == {"AR", "parallel", "window", "lookup", "drafter"}
