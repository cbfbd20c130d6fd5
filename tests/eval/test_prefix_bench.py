"""The prefix-cache benchmark's generate() measurement (eval/prefix_runs.py) on a tiny model: it runs, and what it
reports holds (every policy's first-token logits equal no cache's; the shared prefix is found in the cache)."""

from types import SimpleNamespace

import torch

from eval.prefix_runs import POLICIES, run_generate
from eval.prefix_workloads import Workload
from tests.helpers.models import MASK_ID, tiny_r2lm


def test_run_generate_reports_exact_reuse():
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, MASK_ID - 1, (40,), generator=g).tolist()
    requests = [shared + torch.randint(0, MASK_ID - 1, (6,), generator=g).tolist() for _ in range(4)]
    workload = Workload("tiny", requests, ["qa"] * len(requests))
    out = run_generate(tiny_r2lm(open_gates=True), workload, 64, SimpleNamespace(block_tokens=8, checkpoints=4), "tiny")
    assert set(out) == set(POLICIES)
    for policy in ("lru", "arc"):
        assert out[policy]["max_logit_diff_vs_none"] < 1e-4 and out[policy]["argmax_agree"] == 1.0
        assert out[policy]["hit_tokens"] >= 3 * 40 - 3 * 8  # requests 2-4 reuse the shared prefix's full blocks
