"""Teacher continuations for certainty forcing (objective=certainty; docs/notes/parallelism.md section 2, dParallel).

    python train/teacher_data.py --teacher CKPT --prompts heldout.txt --out data/teacher.jsonl \\
        --prompt-tokens 32 --max-new-tokens 128 [--student STUDENT_CKPT] [--max-prompts 5000] [--batch-size 16]
    deepspeed --num_gpus 8 train/pretrain.py --config ... objective=certainty data.train=data/teacher.jsonl

The teacher continues every prompt and each record's `text` is prompt + continuation, so the training data
pipeline (train/data.py) reads the file unchanged: one document per record, followed by EOS when packed.

Teachers:
- an R2LM checkpoint (the student itself, or a trained one), decoded with r2lm's cached `generate()`: its own
  block size and threshold unless --block-size / --threshold say otherwise. An R2LM freshly converted from an AR
  model (gates at 0) is that AR model only with --block-size 1;
- a transformers causal-LM checkpoint (the original pretrained model, e.g. the base a student was converted
  from), decoded with its own `generate()`.

Prompts come from a text file (paragraphs separated by blank lines; --text-unit line for one per line) or a
jsonl / json / parquet file (--prompt-field), read with `datasets`; --prompt-tokens N keeps the first N tokens of
every document that has that many (e.g. held-out paragraphs: real text, see scripts/make_corpus.py). Prompts are
tokenised with the teacher's tokenizer exactly as the training pipeline tokenises documents.

Batches are left-padded, so a batch costs what its longest prompt costs in every row. --pool-batches K sorts each
pool of K batches (prompts p*K*B .. (p+1)*K*B - 1) by length before cutting it into batches, so that prompts of
like length share a batch: real chat prompts vary tenfold in length, and the padding they would carry is most of
the prefill. K = 1 (the default) keeps the file's order.

Decoding is greedy (--temperature 0, the default) or sampled with a seed: the batch that starts at position s of
its pool's order (first prompt p*K*B) draws from a generator seeded by (--seed, p*K*B + s), so the same command
gives the same file, and a record does not depend on --max-prompts (the last pool is always generated whole when
the prompts file has more; the rows past --max-prompts are dropped).

Resume: re-running the same command appends only the missing records (a larger --max-prompts extends the file).
Records are appended a pool at a time, in prompt order, and flushed; a partial last line left by a killed run is
cut off and its record generated again, and a failed write (a full disk) is undone to the last whole record. The
settings that decide the records (--dtype resolved: "auto" is the dtype it stands for on this device) are kept in
OUT.settings (JSON), written with the first records of a new OUT: a re-run with other settings is refused, naming
them. One run at a time writes OUT: it holds an exclusive lock on OUT.lock (train/lock.py), and a second run is
refused at once, naming the holder. Every check (a writable folder, the lock, files, tokenizers, settings, lengths)
runs before the teacher loads.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a file (python train/teacher_data.py, as the scripts and README do), not a
    sys.path.insert(0, str(REPO))  # module: the repository becomes importable (python -m train.teacher_data needs none)

from train.teacher_records import (  # noqa: E402  (light: no torch import)
    LOCK_SUFFIX,
    Prompt,
    complete_path,
    done_records,
    mark_complete,
    record,
    settings_of,
    write_records,
)

logger = logging.getLogger("train.teacher_data")

# safetensors' names of the floating-point dtypes --dtype auto may stand for
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


# ---------------------------------------------------------------------------------------------- checks


def check_arguments(args) -> None:
    for name in ("max_new_tokens", "batch_size", "pool_batches", "prompt_tokens", "max_prompts", "block_size", "top_k"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.threshold is not None and not 0 < args.threshold <= 1:
        raise ValueError(f"--threshold must be in (0, 1], got {args.threshold}")
    if args.temperature == 0 and (args.top_p is not None or args.top_k is not None):
        raise ValueError("--top-p / --top-k filter sampling: give --temperature > 0 with them")
    out = Path(args.out)
    if out.suffix != ".jsonl":
        raise ValueError(f"--out {out}: the output is a jsonl file (one record per line, appended on resume); "
                         "name it *.jsonl")
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder; give a file name ending in .jsonl")
    check_writable_folder(out)


def check_writable_folder(out: Path) -> None:
    """The folder of `out` (or the folder it would be made in) can take new files: found now, not after the teacher
    has loaded and generated its first batch."""
    folder = next(p for p in out.absolute().parents if p.exists())
    if not folder.is_dir():
        raise ValueError(f"--out {out}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):  # access(2) also says EROFS for a read-only filesystem
        raise ValueError(f"--out {out}: the folder {folder} is not writable (a read-only filesystem, or no write "
                         "permission): give an --out where files can be written")


def checkpoint_kind(folder: str, what: str) -> str:
    """'r2lm' or 'causal_lm' (a transformers causal LM) for a checkpoint folder; ValueError otherwise."""
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ValueError(f"{what} {folder} is not a checkpoint folder (no config.json)")
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{what} {folder}: cannot read config.json: {err}") from None
    if model_type == "r2lm":
        return "r2lm"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{what} {folder} (model_type {model_type!r}) is neither an R2LM checkpoint nor a transformers "
                         "causal LM")
    return "causal_lm"


def load_tokenizer(folder: str, what: str):
    from transformers import AutoTokenizer

    import r2lm  # noqa: F401  (registers the r2lm config, which AutoTokenizer reads)

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{what} {folder} has no usable tokenizer: {err}") from err


def check_same_vocabulary(teacher_tok, student_tok, teacher: str, student: str) -> None:
    """The student must read the teacher's text with the teacher's tokens: every teacher token has the same id in
    the student's vocabulary, and the student's extra tokens are special tokens (the [MASK] conversion adds)."""
    ours, theirs = teacher_tok.get_vocab(), student_tok.get_vocab()
    differ = sorted((i, token) for token, i in ours.items() if theirs.get(token) != i)
    special = set(student_tok.all_special_tokens) | {t.content for t in student_tok.added_tokens_decoder.values() if t.special}
    extra = sorted((i, token) for token, i in theirs.items() if token not in ours and token not in special)
    if differ or extra:
        examples = [f"{token!r} is id {i} in the teacher, {theirs.get(token)} in the student" for i, token in differ[:3]]
        examples += [f"{token!r} (id {i}) is only in the student" for i, token in extra[:3]]
        raise ValueError(
            f"the teacher's tokenizer ({teacher}, {len(ours)} tokens) differs from the student's ({student}, "
            f"{len(theirs)} tokens): {len(differ) + len(extra)} tokens differ, e.g. {'; '.join(examples)}. The student "
            "learns the teacher's text token by token: use a teacher with the student's vocabulary"
        )


def read_prompts(args, tokenizer, limit: int | None) -> list[Prompt]:
    """The first `limit` (None: all) prompts: documents of --prompts, tokenised like the training pipeline does, cut
    to --prompt-tokens."""
    from r2lm.text import encode
    from train.config import DataConfig
    from train.data import load_documents
    from train.sources import resolve_source

    source = resolve_source(args.prompts, "auto", "--prompts")
    if source.builder == "hub":
        raise ValueError(f"--prompts: no such file: {args.prompts}")
    section = DataConfig(train=args.prompts, text_field=args.prompt_field, text_unit=args.text_unit)
    docs = iter(load_documents(source, section, streaming=True))  # streamed: no datasets cache is written
    names = itertools.repeat(None)
    if args.id_field:  # the same records' ids, read alongside
        names = (str(row["text"]) for row in load_documents(
            source, DataConfig(train=args.prompts, text_field=args.id_field, text_unit=args.text_unit), streaming=True))
    prompts: list[Prompt] = []
    while limit is None or len(prompts) < limit:
        texts = [row["text"] for row in itertools.islice(docs, 256)]
        if not texts:
            break
        tokens = chat_encode(tokenizer, texts) if args.chat else encode(tokenizer, [t or "" for t in texts])
        for ids, name in zip(tokens, names, strict=False):  # (names: endless when there is no --id-field)
            if not ids or (args.prompt_tokens and len(ids) < args.prompt_tokens):
                continue
            ids = ids[: args.prompt_tokens] if args.prompt_tokens else ids
            prompts.append(Prompt(ids, tokenizer.decode(ids), name))
    prompts = prompts[:limit]
    if not prompts:
        need = f" of at least {args.prompt_tokens} tokens" if args.prompt_tokens else ""
        raise ValueError(f"--prompts {args.prompts} holds no prompt{need}")
    return prompts


def chat_encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as a user turn through the tokenizer's chat template, ready for the assistant's reply (the template's
    own special tokens are real ones)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("--chat: the teacher's tokenizer has no chat template")
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": t or ""}], tokenize=False,
                                              add_generation_prompt=True) for t in texts]
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def check_lengths(prompts: list[Prompt], teacher: str, max_new_tokens: int) -> None:
    limit = json.loads((Path(teacher) / "config.json").read_text()).get("max_position_embeddings")
    longest = max(len(p.ids) for p in prompts)
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(f"the longest prompt ({longest} tokens) + --max-new-tokens {max_new_tokens} exceeds the "
                         f"teacher's max_position_embeddings {limit}: give --prompt-tokens or fewer new tokens")


def checkpoint_dtype(folder: str) -> str:
    """The dtype transformers' dtype="auto" loads a checkpoint in: its config's, else its first floating-point
    weight's (from the safetensors header; no weights are read)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    if config.get("dtype") or config.get("torch_dtype"):
        return str(config.get("dtype") or config["torch_dtype"]).removeprefix("torch.")
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(path, "pt") as weights:
            for name in weights.keys():
                if (dtype := weights.get_slice(name).get_dtype()) in SAFETENSORS_DTYPES:
                    return SAFETENSORS_DTYPES[dtype]
    raise ValueError(f"--dtype auto: the teacher {folder} names no dtype in config.json and has no safetensors "
                     "weights to read it from: give --dtype")


def device_and_dtype(args) -> tuple[str, str]:
    """The device and the concrete dtype the teacher runs in ("auto": float32 on CPU, the checkpoint's on GPU)."""
    import torch

    from r2lm.device import resolve_device

    try:
        device = str(resolve_device(args.device))
    except ValueError as err:
        raise ValueError(f"--device: {err}") from None
    if args.dtype != "auto":
        return device, args.dtype
    return device, "float32" if torch.device(device).type == "cpu" else checkpoint_dtype(args.teacher)


def eos_ids_of(folder: str, tokenizer) -> list[int]:
    """The teacher's EOS ids, its tokenizer's and its generation config's: a continuation ends at any of them."""
    from transformers import GenerationConfig

    try:
        config_eos = GenerationConfig.from_pretrained(folder).eos_token_id
    except OSError:  # no generation_config.json: the model config's
        config_eos = json.loads((Path(folder) / "config.json").read_text()).get("eos_token_id")
    config_eos = config_eos if isinstance(config_eos, list) else [config_eos]
    ids = sorted({i for i in [tokenizer.eos_token_id, *config_eos] if i is not None})
    if not ids:
        raise ValueError(f"the teacher {folder} defines no EOS token (tokenizer, generation_config.json or "
                         "config.json): its continuations would never end")
    return ids


# ---------------------------------------------------------------------------------------------- decoding


class Teacher:
    """A teacher checkpoint and the way it continues a left-padded batch of prompts."""

    def __init__(self, folder: str, kind: str, tokenizer, args, device: str, dtype: str):
        import torch

        self.kind, self.args = kind, args
        self.device = torch.device(device)
        if kind == "r2lm":
            from r2lm import R2LMForDiffusionLM as model_class
        else:
            from transformers import AutoModelForCausalLM as model_class
        try:
            self.model = model_class.from_pretrained(folder, dtype=getattr(torch, dtype)).to(self.device).eval()
        except OSError as err:  # no or unreadable weights
            raise ValueError(f"cannot load the teacher {folder}: {err}") from err
        if kind == "r2lm":  # the CPU decode speedup, as r2lm-generate applies it (r2lm.ops.linear)
            from r2lm.ops.linear import install

            install(self.model)
        self.eos_ids = eos_ids_of(folder, tokenizer)
        # which model wrote the replies (r2lm.drafter.target_digest: a drafter's training refuses another model's)
        self.digest = None
        if kind == "r2lm":
            from r2lm.drafter import target_digest

            self.digest = target_digest(self.model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.steps = self.new_tokens = 0  # R2LM teachers: row steps and tokens, for the tokens-per-step report

    def continue_batch(self, prompts: list[Prompt], seed: int) -> list[tuple[list[int], bool]]:
        """(new token ids, the EOS that ended them included, whether an EOS ended them) for each prompt."""
        import torch

        width = max(len(p.ids) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p.ids)) + p.ids for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p.ids)) + [1] * len(p.ids) for p in prompts], device=self.device)
        sequences = self._generate(ids, mask, seed)[:, width:].tolist()
        out = []
        for row in sequences:
            stop = next((i for i, token in enumerate(row) if token in self.eos_ids), None)
            out.append((row if stop is None else row[: stop + 1], stop is not None))
        return out

    def _generate(self, ids, mask, seed: int):
        import torch

        a = self.args
        if self.kind == "r2lm":
            from r2lm import generate

            generator = torch.Generator(device=self.device).manual_seed(seed)
            decoding = {k: v for k, v in (("block_size", a.block_size), ("threshold", a.threshold)) if v is not None}
            out = generate(self.model, ids, mask, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                           top_k=a.top_k, top_p=a.top_p, generator=generator, eos_token_id=self.eos_ids,
                           pad_token_id=self.pad_id, **decoding)
            self.steps += out.row_steps  # the steps of the rows still decoding at each (a stopped row waits)
            self.new_tokens += out.new_tokens
            return out.sequences
        from transformers import GenerationConfig

        sample = a.temperature > 0
        config = GenerationConfig(max_new_tokens=a.max_new_tokens, do_sample=sample, eos_token_id=self.eos_ids,
                                  pad_token_id=self.pad_id, **({"temperature": a.temperature, "top_k": a.top_k or 0,
                                                                 "top_p": a.top_p or 1.0} if sample else {}))
        torch.manual_seed(seed)  # transformers samples from the global generator
        with torch.no_grad():
            return self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)


# ---------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train/teacher_data.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", required=True, help="R2LM or transformers causal-LM checkpoint folder")
    parser.add_argument("--prompts", required=True, help="text / jsonl / json / parquet file of documents")
    parser.add_argument("--out", required=True, help="output jsonl file (records appended; resumable)")
    parser.add_argument("--student", help="the R2LM checkpoint to be trained: its tokenizer must have the teacher's "
                        "vocabulary (checked before any work)")
    parser.add_argument("--prompt-field", default="text", help="jsonl / parquet column of the documents (default: text)")
    parser.add_argument("--text-unit", default="paragraph", choices=("paragraph", "line", "document"),
                        help="what one document is in a text file (default: paragraph)")
    parser.add_argument("--chat", action="store_true", help="each document is a user turn: the teacher's chat "
                        "template wraps it, ready for the reply (e.g. ShareGPT prompts: python -m r2lm.workloads)")
    parser.add_argument("--id-field", help="jsonl / parquet column of each document's id, kept in its record as "
                        "`id` (e.g. ShareGPT's conversation id: a drafter's training refuses held-out ones)")
    parser.add_argument("--prompt-tokens", type=int, help="keep the first N tokens of every document of at least N "
                        "tokens (default: whole documents)")
    parser.add_argument("--max-prompts", type=int, help="use the first N prompts (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per continuation (default: 128)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per generate() call (default: 8)")
    parser.add_argument("--pool-batches", type=int, default=1, help="sort each pool of this many batches by prompt "
                        "length, so that a batch pads little (default: 1, the file's order; e.g. 8 for prompts of "
                        "mixed lengths; a killed run loses at most one pool's work)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    parser.add_argument("--top-k", type=int, help="sampling: keep the k most likely tokens")
    parser.add_argument("--top-p", type=float, help="sampling: nucleus probability")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: 0)")
    parser.add_argument("--block-size", type=int, help="R2LM teachers: decoding block size (default: the teacher's; 1 "
                        "for an AR teacher, i.e. a checkpoint converted from a causal LM and not trained since)")
    parser.add_argument("--threshold", type=float, help="R2LM teachers: confidence threshold (default: the teacher's)")
    parser.add_argument("--device", help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="auto = float32 on CPU, the checkpoint's dtype on GPU")
    return parser


def prepare(args):
    """The checks after the arguments' (generate_records holds OUT's lock for them), before the teacher loads:
    (teacher kind, tokenizer, prompts, records wanted, device, dtype, settings, records already done). `prompts`
    runs to the end of the last pool: the batches, and so what a seed samples, do not depend on --max-prompts (the
    rows past it are generated and dropped)."""
    kind = checkpoint_kind(args.teacher, "--teacher")
    if kind != "r2lm" and (args.block_size is not None or args.threshold is not None):
        raise ValueError("--block-size / --threshold set R2LM (diffusion) decoding; the teacher is a transformers "
                         "causal LM, which decodes token by token")
    tokenizer = load_tokenizer(args.teacher, "--teacher")
    eos_ids_of(args.teacher, tokenizer)
    if args.student is not None:
        checkpoint_kind(args.student, "--student")
        check_same_vocabulary(tokenizer, load_tokenizer(args.student, "--student"), args.teacher, args.student)
    pool = args.batch_size * args.pool_batches
    limit = None if args.max_prompts is None else -(-args.max_prompts // pool) * pool
    prompts = read_prompts(args, tokenizer, limit)
    wanted = min(len(prompts), args.max_prompts or len(prompts))
    check_lengths(prompts, args.teacher, args.max_new_tokens)
    device, dtype = device_and_dtype(args)
    settings = settings_of(args, dtype)
    return kind, tokenizer, prompts, wanted, device, dtype, settings, done_records(Path(args.out), settings, prompts)


def pool_order(prompts: list[Prompt], start: int, size: int, sort: bool) -> list[int]:
    """The positions of the pool that starts at `start`, in the order they are batched: by prompt length (ties in
    file order) when `sort`, else the file's."""
    members = range(start, min(start + size, len(prompts)))
    return sorted(members, key=lambda i: len(prompts[i].ids)) if sort else list(members)


def generate_records(args) -> int:
    """Append the missing records of `args.out`, holding its lock; returns how many were written."""
    from train.lock import RunLock

    check_arguments(args)
    out = Path(args.out)
    lock = RunLock(out.parent, out.name + LOCK_SUFFIX, option="--out", target=out)
    try:
        written = locked_generate_records(args, out)
    except BaseException:
        lock.release(discard=True)  # let go; the folders it made (and their lock file) are removed again
        raise
    lock.release()
    return written


def locked_generate_records(args, out: Path) -> int:
    """generate_records' work, once it holds the lock on `out`."""
    from tqdm.auto import tqdm

    from r2lm.diffusion import noise_seed

    kind, tokenizer, prompts, wanted, device, dtype, settings, done = prepare(args)
    if done >= wanted:
        logger.info("%s already holds %d records for %d prompts: nothing to do", out, done, wanted)
        mark_complete(out, done)
        return 0
    if done:
        logger.info("%s holds %d of %d records: generating the other %d", out, done, wanted, wanted - done)
    complete_path(out).unlink(missing_ok=True)  # incomplete until this run has written every record
    teacher = Teacher(args.teacher, kind, tokenizer, args, device, dtype)
    b, pool = args.batch_size, args.batch_size * args.pool_batches
    written = 0
    with tqdm(total=wanted, initial=done, desc="teacher", unit="prompt", dynamic_ncols=True) as progress:
        for start in range(done // pool * pool, wanted, pool):  # fixed pools: a resumed pool is generated as before
            members = pool_order(prompts, start, pool, sort=args.pool_batches > 1)
            results = {}
            for s in range(0, len(members), b):
                batch = members[s : s + b]
                results.update(zip(batch, teacher.continue_batch([prompts[i] for i in batch],
                                                                 noise_seed(args.seed, start + s)), strict=True))
                progress.update(sum(done <= i < wanted for i in batch))
            records = [record(i, prompts[i], *results[i], tokenizer, teacher.digest)
                       for i in sorted(results) if done <= i < wanted]
            try:
                write_records(out, settings, records)
            except OSError as err:
                raise ValueError(f"cannot write {err.filename or out}: {err.strerror or err}. {out} keeps the "
                                 f"{done + written} records written so far, whole: free space (or fix the error) and "
                                 "rerun the same command to resume") from None
            written += len(records)
    mark_complete(out, done + written)
    per_step = f", {teacher.new_tokens / teacher.steps:.2f} tokens per denoising step" if teacher.steps else ""
    logger.info("wrote %d records to %s%s", written, out, per_step)
    return written


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("datasets", "transformers", "DeepSpeed", "deepspeed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        generate_records(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
