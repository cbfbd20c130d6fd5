"""Fixtures every test gets. The builders the tests share are plain functions in tests/helpers."""

import pytest
import torch

# The helpers' asserts (tests.helpers.bf16's cache check) report their values as a test's own asserts do.
pytest.register_assert_rewrite("tests.helpers")

# Tiny models run faster on one thread, and a shared 2-core machine stalls multi-threaded tiny matmuls.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
