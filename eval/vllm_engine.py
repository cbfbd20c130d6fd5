"""vLLM's offline engine on given token ids, run inside the serving environment (scripts/serve_env.sh), which holds
vLLM and not r2lm: this file imports nothing of r2lm. r2lm's side (eval.vllm_peer) writes the requests and reads the
answer as JSON.

    $R2LM_SERVE_PYTHON eval/vllm_engine.py REQUESTS.json ANSWER.json

REQUESTS: {"model": a stock folder, "speculative_config": vLLM's (or null), "batches": [[[ids], ...], ...] (the
prompts each batch decodes together), "max_tokens": N, "stop_token_ids": [ids] (null: every row to max_tokens),
"repeats": R, "max_model_len": L}. Greedy. The batches are decoded in turn, R times over (the first pass's
outputs kept). ANSWER: {"load_s", "batches": [{"outputs": [[ids], ...] (EOS included where a row stopped),
"tokens": [...], "seconds": [...] (one per pass), "spec": the speculative counters of its first pass: drafts (one per
row and verification forward), draft_tokens, accepted}]}.
"""

from __future__ import annotations

import json
import sys
import time

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted"}


def counters(llm) -> dict:
    """The engine's speculative-decoding counters so far (zeros without a speculative method)."""
    out = dict.fromkeys(COUNTERS.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            out[COUNTERS[metric.name]] = int(getattr(metric, "value", 0))
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
              max_num_seqs=max(len(b) for b in r["batches"]), speculative_config=r.get("speculative_config"),
              disable_log_stats=False, gpu_memory_utilization=memory_share())
    load_s = time.perf_counter() - started
    stops = r.get("stop_token_ids")
    params = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=stops is None,
                            stop_token_ids=stops or None)
    batches = [[TokensPrompt(prompt_token_ids=ids) for ids in batch] for batch in r["batches"]]
    llm.generate(batches[0][:1], params, use_tqdm=False)  # warm-up: first-call costs are not decoding speed
    answer = [{"tokens": [], "seconds": []} for _ in batches]
    for repeat in range(r["repeats"]):
        for batch, entry in zip(batches, answer, strict=True):
            before = counters(llm)
            began = time.perf_counter()
            done = llm.generate(batch, params, use_tqdm=False)
            entry["seconds"].append(time.perf_counter() - began)
            entry["tokens"].append(sum(len(o.outputs[0].token_ids) for o in done))
            if repeat == 0:
                after = counters(llm)
                entry["outputs"] = [list(o.outputs[0].token_ids) for o in done]
                entry["spec"] = {k: after[k] - before[k] for k in after}
    open(answer_path, "w").write(json.dumps({"load_s": load_s, "batches": answer}) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    main(sys.argv[1], sys.argv[2])
