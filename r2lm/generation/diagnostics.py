"""How much parallelism a model leaves on the table: a step callback that measures, for one generate() call,

    accepted TPF   tokens a row accepts per denoising step (what the unmasking rule took; verify=True: the draft
                   tokens verification accepted, AR's own next token not counted)
    oracle TPF     window positions per step whose proposal (argmax; verify=True: the draft) already equals the
                   token finally committed there: what an oracle that knew which proposals are right could have
                   accepted (Learn2PD's diagnostic). Far above the accepted TPF: the rule (its threshold) is what
                   limits parallelism; near it: the model must become surer (parallelism training).

Both are averaged over (row, step) pairs in which the row still had a [MASK] in its block (verify=True: a draft to
verify). Each row's step columns start at its own position (`StepInfo.start`): verify=True rows commit their own
lengths.

    meter = ParallelismMeter()
    out = generate(model, ids, step_callback=meter, ...)
    meter.summary(out.sequences[:, ids.shape[1]:])   # {"accepted_tpf": ..., "oracle_tpf": ..., "steps": ...}
"""

from __future__ import annotations

import torch


class ParallelismMeter:
    def __init__(self):
        self.records = []  # (start [B], masked [B, L], proposals [B, L], accepted [B, L]) per step

    def __call__(self, step) -> None:
        self.records.append((step.start.clone(), step.masked.clone(), step.proposals.clone(), step.accepted.clone()))

    def summary(self, generated: torch.Tensor) -> dict:
        """generated [B, n]: the call's generated tokens (sequences after the prompt)."""
        pairs = accepted = oracle = 0
        for start, masked, proposals, taken in self.records:
            at = start.to(generated.device)[:, None] + torch.arange(masked.shape[1], device=generated.device)
            # positions past the output (the call stopped before the block's end, a draft ran past max_new_tokens)
            # are not counted
            inside = at < generated.shape[1]
            final = generated.gather(1, at.clamp(max=generated.shape[1] - 1))
            masked = masked & inside
            active = masked.any(1)
            pairs += int(active.sum())
            accepted += int((taken & masked)[active].sum())
            oracle += int(((proposals == final) & masked)[active].sum())
        return {"accepted_tpf": accepted / max(pairs, 1), "oracle_tpf": oracle / max(pairs, 1), "steps": len(self.records),
                "row_steps": pairs}
