"""Builders and checks shared by the tests, imported as `tests.helpers.NAME` (pytest puts the repository root on
sys.path for the `tests` package; subprocesses get it through PYTHONPATH, see processes.run_cli):

- models:      tiny random R2LM and transformers models (`tiny_r2lm`, `peaky`, `sharp_hf`, `tiny_conversion`), the
               tiny BPE tokenizer, and a tiny checkpoint folder (`make_model_dir`)
- decoding:    left-padded prompt batches, and verified decoding's reference (`ar_greedy`)
- checkpoints: folders the converters and loaders read: damaged weights, the LLaDA / Dream / LLaDA2 source layouts,
               a LoRA adapter, a small GGUF file transformers loads (`gguf_file`)
- training:    a small corpus, fast training overrides, an in-process training run, teacher records
- processes:   subprocesses in the repository root (`run_cli`, `python`), the deepspeed launcher, a free port
- bf16:        the bf16 cache check shared by the bf16 decoding and training tests

Fixtures live in tests/conftest.py; these are plain functions, so that parametrize lists, module-level constants
and subprocesses can use them too.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
