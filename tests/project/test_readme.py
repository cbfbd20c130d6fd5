"""The README's Python examples run as written (one namespace, in order, as a reader pastes them), on a tiny
R2LM with a real tokenizer saved where the examples load their checkpoint from, and an untrained drafter for it
where they load their drafter from."""

import re

import torch

from r2lm.drafter import Drafter, DrafterConfig
from tests.helpers import REPO
from tests.helpers.models import tiny_r2lm, tiny_tokenizer

README = REPO / "README.md"
CHECKPOINT = "runs/quickstart/smollm2/final"
DRAFTER = "runs/drafter/run/final"


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
    Drafter(DrafterConfig.for_target(model.config, block_size=4)).save_pretrained(tmp_path / "drafter")  # untrained
    namespace = {}
    assert DRAFTER in "".join(blocks)
    for block in blocks:
        code = block.replace(CHECKPOINT, str(tmp_path / "ckpt")).replace(DRAFTER, str(tmp_path / "drafter"))
        exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - the documentation's own code
    assert isinstance(namespace["sequences"], torch.Tensor) and namespace["prefix_cache"].stats.hit_rate > 0
