"""vLLM's offline engine on given token ids, run inside the serving environment (scripts/serve_env.sh), which holds
vLLM and not r2lm: this file imports nothing of r2lm. r2lm's side (eval.vllm_peer) writes the requests and reads the
answer as JSON.

    $R2LM_SERVE_PYTHON eval/vllm_engine.py REQUESTS.json ANSWER.json

REQUESTS: {"model": stock folder, "speculative_config": vLLM's (or null), "prompts": [[ids], ...],
"max_tokens": N, "batch_sizes": [1, 8], "repeats": R, "max_model_len": L}. Greedy, every prompt to max_tokens
(ignore_eos: equal lengths, as r2lm's side decodes them). ANSWER: per batch size the token ids of each output,
tokens/s of each repeat, and the speculative counters (drafts, draft tokens, accepted tokens; the mean acceptance
length is 1 + accepted / drafts: the tokens one verification forward commits).
"""

from __future__ import annotations

import json
import sys
import time


def counters(llm) -> dict:
    """The engine's speculative-decoding counters so far (zeros without a speculative method)."""
    wanted = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
              "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out = dict.fromkeys(wanted.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in wanted:
            out[wanted[metric.name]] = int(getattr(metric, "value", 0))
    return out


def memory_share() -> float:
    """The share of this machine's memory vLLM may reserve: on CPU its default (0.92) is refused whenever other
    processes hold more than 8%, so 80% of what is free now."""
    import psutil

    memory = psutil.virtual_memory()
    return round(0.8 * memory.available / memory.total, 3)


def main(requests_path: str, answer_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    r = json.loads(open(requests_path).read())
    started = time.perf_counter()
    llm = LLM(model=r["model"], dtype="float32", enforce_eager=True, seed=0, max_model_len=r["max_model_len"],
              max_num_seqs=max(r["batch_sizes"]), speculative_config=r.get("speculative_config"),
              disable_log_stats=False, gpu_memory_utilization=memory_share())
    load_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in r["prompts"]]
    answer = {"load_s": load_s, "batches": {}}
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up: first-call costs are not decoding speed
    for batch in r["batch_sizes"]:
        runs, outputs, before = [], None, counters(llm)
        for _ in range(r["repeats"]):
            for start in range(0, len(prompts), batch):
                group = prompts[start : start + batch]
                began = time.perf_counter()
                done = llm.generate(group, params, use_tqdm=False)
                seconds = time.perf_counter() - began
                runs.append({"tokens": sum(len(o.outputs[0].token_ids) for o in done), "seconds": seconds})
                if outputs is None or len(outputs) < len(prompts):
                    outputs = (outputs or []) + [list(o.outputs[0].token_ids) for o in done]
        after = counters(llm)
        answer["batches"][str(batch)] = {"outputs": outputs, "runs": runs,
                                         "spec": {k: after[k] - before[k] for k in after}}
    open(answer_path, "w").write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    main(sys.argv[1], sys.argv[2])
