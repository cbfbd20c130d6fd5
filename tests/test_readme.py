"""The README's Python examples run as written (one namespace, in order, as a reader pastes them), on a tiny
R2LM with a real tokenizer saved where the examples load their checkpoint from."""

import re
from pathlib import Path

import torch
from conftest import tiny_r2lm, tiny_tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"
CHECKPOINT = "runs/quickstart/smollm2/final"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_python_examples_run(tmp_path):
    blocks = python_blocks()
    assert len(blocks) >= 4 and CHECKPOINT in "".join(blocks)
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"mask_token": "<|mask|>"})
    model = tiny_r2lm(open_gates=True, sidecar_layers=[1, 3], vocab_size=len(tokenizer),
                      mask_token_id=tokenizer.mask_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    namespace = {}
    for block in blocks:
        code = block.replace(CHECKPOINT, str(tmp_path / "ckpt"))
        exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - the documentation's own code
    assert isinstance(namespace["sequences"], torch.Tensor) and namespace["prefix_cache"].stats.hit_rate > 0
