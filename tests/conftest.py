"""Fixtures every test gets. The builders the tests share are plain functions in tests/helpers."""

import getpass
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
