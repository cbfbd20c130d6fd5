"""`generate()`: the one decode loop (docs/design.md section 4) for every model kind.

    for each block of max_new_tokens:
        until the block has no [MASK]:                 # the loop's exit test: the one host sync of a step
            logits = context.read(block)               # the block's logits (exact cache, recompute, canvas...)
            propose a token per masked position, unmask by the rule (>= 1 per row; its plan made at the block's start)
            step_callback(StepInfo); EOS stops rows
        stop strings, stopping criteria, streamer      # r2lm.generation.stopping: the tail both loops share
        context.commit(block)                          # exact cache: appended by the next block's first read
        rows that finished leave the batch (context.keep_rows)

How the committed text is held and read is the context's business (r2lm.generation.contexts): the exact KV cache
of causal and block_causal models, its recompute oracle (use_cache=False), and the canvas of bidirectional
models with their approximate caches. Unmasking rules: the table of r2lm.unmasking; confidences:
r2lm.generation.sampling. Options and their checks: r2lm.generation.options. `model.generate` reaches this through r2lm.generation.mixin.
"""

from __future__ import annotations

import torch

from r2lm.generation.contexts import open_context
from r2lm.generation.options import Request, make_request
from r2lm.generation.outputs import GenerateOutput, StepInfo, spread
from r2lm.generation.sampling import propose
from r2lm.generation.stopping import Stopper
from r2lm.generation.verify import decode_verified
from r2lm.unmasking import select


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, generation_config=None,
             **options) -> GenerateOutput:
    """Decode up to `max_new_tokens` after left-padded prompts `input_ids` [B, P].

    Options (r2lm.generation.options groups them, each group checked beside the code that uses it; defaults come
    from `generation_config`, else the model's generation_config.json): max_new_tokens=128, suffix_ids (infilling);
    block_size (the model's), one unmasking rule of r2lm.unmasking.RULES: threshold=0.9 | factor | steps
    (LLaDA's total steps); confidence ("max_prob", "margin", "entropy"); temperature=0.0 (greedy), top_k, top_p,
    do_sample, generator; eos_token_id, pad_token_id, stop_strings + tokenizer, stopping_criteria (transformers
    StoppingCriteria, checked after each block; verify=True: after every token), streamer, step_callback (called
    with a StepInfo after every step);
    use_cache=True, compile=False (torch.compile the cached decode step), prefix_cache (an r2lm.prefix.PrefixCache:
    exact cross-request reuse); verify=False (lossless: the model's greedy AR output, drafted and verified by the
    causal pass, r2lm.generation.verify; block_size is then the draft length) with verify_windows (drafting
    windows per verification forward, 2 .. block_size + 1, default all), verify_draft (r2lm.generation.drafts:
    "window", "lookup", "ngram", "lookup+ngram", "drafter", "lookup+drafter", "lookup+ngram+drafter"), drafter (an
    r2lm.drafter.Drafter) and ngram (an r2lm.ngram.NGramTable); bidirectional models
    only: approximate_cache (None, "prefix" or "dual": Fast-dLLM, APPROXIMATE), bicache (an r2lm.prefix.BiCache:
    APPROXIMATE reuse of a stored shared prefix).
    """
    r = make_request(model, input_ids, attention_mask, generation_config, **options)
    return decode_verified(model, r) if r.verifying.verify else decode(model, r)


def decode(model, r: Request) -> GenerateOutput:
    ids, suffix, kind = r.prompt.input_ids, r.prompt.suffix_ids, model.config.kind
    (batch, prompt_len), n, b = ids.shape, r.max_new_tokens, r.unmasking.block_size
    u, s = r.unmasking, r.sampling
    canvas = torch.cat([ids, ids.new_full((batch, n), r.mask_id), suffix], 1)
    stopper = Stopper(r.stopping, ids, r.prompt.attention_mask)
    step = end = 0
    row_steps = torch.zeros((), dtype=torch.long, device=ids.device)  # read once, at the end: no sync per step
    # The rows still decoding: once a row has finished (EOS, a stop) it leaves the forwards at the end of its block,
    # so a batch costs about its rows' own forwards. `work` is their canvas (the canvas itself until a row leaves),
    # `rows` their indices in the batch (None: every row). Not under compile=True (a new batch size recompiles).
    work, rows, leave = canvas, None, not r.caching.compile
    context = open_context(model, r, canvas)
    try:
        for start in range(0, n, b):
            end = min(start + b, n)
            block = work[:, prompt_len + start : prompt_len + end]  # a view: unmasking writes straight into it
            finished = stopper.finished if rows is None else stopper.finished[rows]
            block.masked_fill_(finished[:, None], stopper.pad_id)  # rows finished (compile=True keeps them): no more
            columns = kind.window_columns(prompt_len, start, end, b, n, suffix.shape[1])
            window = work[:, columns]  # a view: it follows the unmasking
            inputs = min(columns.stop - prompt_len, end) - start  # block positions that are window inputs
            masked, window_masked, done = block == r.mask_id, inputs > 0, False  # a running row's new block: all [MASK]
            plan = u.plan(masked, r.num_blocks)
            # every row's first position of the step's columns, for the step callback (rows share the block's)
            starts = torch.full((batch,), start, device=ids.device) if r.step_callback is not None else None
            for i in range(end - start):  # at least one token per row and step: at most L steps
                logits = context.read(start, window, end - start, clean=not window_masked)
                row_steps += masked.any(1).sum()  # the rows this step decodes
                tokens, conf = propose(logits, r.mask_id, s.temperature, s.top_k, s.top_p, u.confidence, s.generator)
                take = select(conf, masked, plan, u.rule, i)
                block.copy_(torch.where(take, tokens, block))
                if r.step_callback is not None:
                    seen = ((masked, False), (tokens, stopper.pad_id), (conf, 0.0), (take, False), (logits, 0.0))
                    r.step_callback(StepInfo(step, starts, *(spread(x, rows, batch, f) for x, f in seen)))
                stopper.check_eos(block, start, rows)
                step += 1
                masked = block == r.mask_id
                finished = stopper.finished if rows is None else stopper.finished[rows]
                # the one host sync of a step: anything left in the block, is its window clean, has every row
                # stopped, has one of them
                flags = int(masked.any() * 8 + masked[:, :inputs].any() * 4 + finished.all() * 2 + finished.any())
                left, window_masked, done, leaving = flags >> 3, flags >> 2 & 1, flags >> 1 & 1, flags & 1
                if not left:
                    break
            if rows is not None:  # the text of the rows that left is final in the canvas; bring the others' up to date
                canvas[rows, prompt_len + start : prompt_len + end] = block
            if stopper.advance(canvas, prompt_len, end):  # stop strings / criteria (they read the text anyway)
                finished = stopper.finished if rows is None else stopper.finished[rows]
                done, leaving = (bool(x) for x in torch.stack([finished.all(), finished.any()]).tolist())
            if done:
                break
            context.commit(window)
            if leaving and leave:
                stay = ~finished
                rows = torch.arange(batch, device=ids.device)[stay] if rows is None else rows[stay]
                work = work[stay]
                context.keep_rows(stay, work)
    finally:
        context.close()
    # whole blocks: as wide as the last block decoded
    return stopper.output(canvas[:, : prompt_len + end], prompt_len, context.forwards, step, row_steps)
