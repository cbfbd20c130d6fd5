"""lm-evaluation-harness backend for r2lm checkpoints: `--model r2lm`.

    python -m eval.lm_eval_adapter --model r2lm --model_args pretrained=PATH[,mode=ar][,mc_num=128] \\
        --tasks arc_easy,hellaswag [--include_path eval/tasks] [--batch_size 32] [--output_path out/]

lm-eval 0.4.13 finds model backends only in its registry (it reads no entry points, and `--include_path`
loads tasks, not models), so a backend that lives outside the package must be registered in the process
that runs the evaluation. Importing this module registers "r2lm" (lazily, by path, after lm-eval's own
backends); `python -m eval.lm_eval_adapter ...` does that and then runs lm-eval's own CLI (`lm_eval.__main__.
cli_evaluate`) with the same arguments, subcommands included (`run`, `ls`, `validate`). From Python:

    import eval.lm_eval_adapter  # registers "r2lm"
    lm_eval.simple_evaluate(model="r2lm", model_args="pretrained=PATH", tasks=[...], task_manager=...)

model_args (all optional but `pretrained`):
    pretrained      HF-format R2LM checkpoint folder (tokenizer in the same folder unless `tokenizer=`)
    mode            auto | ar | diffusion (eval.likelihood.eval_mode: pass `ar` for the AR baseline)
    mc_num          Monte-Carlo samples per loglikelihood request (LLaDA's estimator; default 128)
    mc_batch_size   Monte-Carlo samples per forward (default 32; lm-eval's --batch_size batches generation)
    block_size      window size for scoring and generation (default: config.block_size; AR generates at 1)
    threshold       confidence threshold of generate_until (default 0.9)
    greedy_check    compute is_greedy of loglikelihood requests: true (default) or false (reports False)
    seed            mask seed of the estimator (default 0)
    max_length      context limit in tokens (default: config.max_position_embeddings)
    prefix_token_id the token rolling windows and empty contexts are conditioned on (default, as lm-eval's own hf
                    model: the tokenizer's BOS, else its EOS)
    device, dtype   default cuda if available / bfloat16 on cuda, float32 on cpu. lm-eval's CLI passes its --device
                    (default cuda:0) to every backend: a device this machine lacks falls back to that default, with a
                    warning, as lm-eval's hf model does

Every model_arg is checked before the model loads: a value out of range, an argument the backend does not take (a
misspelt name) or a `pretrained` that is no R2LM checkpoint folder is a ValueError naming it.

Requests:
    loglikelihood          exact next-token log-likelihood (ar) or LLaDA's Monte-Carlo ELBO estimate (diffusion:
                           the continuation after the context in the model's decoding layout), eval.likelihood
    loglikelihood_rolling  the same on lm-eval's rolling windows of the string, summed: exact for ar, the
                           negative ELBO (a bound: perplexities are upper bounds) for diffusion variants
    generate_until         r2lm.generate: threshold decoding, stop strings `until`, `max_gen_toks`; temperature /
                           do_sample / top_p / top_k are honoured; the returned text stops before the first stop
                           string
"""

from __future__ import annotations

import difflib
import inspect
import logging
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from eval import common
from r2lm import scoring
from r2lm.device import device_available

try:
    from lm_eval.api.model import TemplateLM
except ImportError as err:  # pragma: no cover - lm-eval is an optional dependency
    raise ImportError("the lm-eval adapter needs lm-eval: pip install 'lm-eval==0.4.13'") from err

logger = logging.getLogger("eval.lm_eval_adapter")
NAME = "r2lm"


def resolve_device(device: str | None) -> str:
    """`device`, or the default (cuda if available, else cpu) when it is None or a device this machine lacks: lm-eval's
    HFLM falls back the same way for a device outside the ones it finds (it only logs it; we warn)."""
    default = "cuda" if torch.cuda.is_available() else "cpu"
    if device is None:
        return default
    try:
        wanted = torch.device(device)
    except RuntimeError:  # not a device name at all
        wanted = None
    if wanted is not None and device_available(wanted):
        return str(device)
    logger.warning("device %r is not available on this machine; using %s", device, default)
    return default


FLAGS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def _flag(name: str, value) -> bool:
    """A yes/no argument: a bool, 0 / 1, or one of FLAGS' words (lm-eval passes model_args' true / false as bools)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in FLAGS:
        return FLAGS[value.strip().lower()]
    raise ValueError(f"{name} must be true or false, got {value!r}")


def _int(name: str, value, low: int = 1, high: int | None = None, what: str = "") -> int:
    """An integer argument in [low, high] (`what` names the bound): lm-eval passes model_args' digits as an int,
    a Python caller may pass "8"."""
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name}={value} is above {what} {high}")
    return value


def _threshold(value) -> float:
    try:
        threshold = None if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        threshold = None
    if threshold is None or not 0 < threshold <= 1:
        raise ValueError(f"threshold must be a number in (0, 1], got {value!r}")
    return threshold


def _batch_size(value) -> int | None:
    """lm-eval's batch_size: a positive integer, or auto / auto:N (None: the backend's own default)."""
    if value is None or (isinstance(value, str) and value.strip().startswith("auto")):
        return None
    return _int("batch_size", value)


def check_arguments(unknown: dict) -> None:
    """Refuse model_args the backend does not take, naming them (and the likely meant one): a misspelt option
    would otherwise leave its default in place."""
    if not unknown:
        return
    known = sorted(n for n in inspect.signature(R2LMEvalLM.__init__).parameters if n not in ("self", "unknown"))
    names = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, known, n=1)
        names.append(f"{name} (did you mean {close[0]}?)" if close else name)
    raise ValueError(f"unknown r2lm model_args: {', '.join(names)}; the backend takes {', '.join(known)}")


def checkpoint_config(pretrained, tokenizer):
    """The config of the checkpoint folder `pretrained`, every part checked before the model loads: transformers
    takes a path it cannot find for a hub repo id ("Repo id must be in the form ...")."""
    from r2lm import R2LMConfig
    from r2lm.checkpoints import check_weights, has_tokenizer, read_config

    folder = Path(str(pretrained))
    if folder.is_file():
        raise ValueError(f"pretrained={pretrained} is a file; give the R2LM checkpoint folder that holds it")
    if not folder.is_dir():
        raise ValueError(f"pretrained={pretrained}: no such folder (give an R2LM checkpoint folder)")
    model_type = read_config(folder).get("model_type")
    if model_type != "r2lm":
        raise ValueError(f"pretrained={pretrained} is a {model_type!r} checkpoint, not an R2LM one; convert it first "
                         "(python -m convert from-hf ...)")
    check_weights(folder)
    if tokenizer is None and not has_tokenizer(folder):
        raise ValueError(f"pretrained={pretrained} has no tokenizer (tokenizer.json, tokenizer_config.json or "
                         "tokenizer.model): give tokenizer=PATH")
    return R2LMConfig.from_pretrained(folder)


class R2LMEvalLM(TemplateLM):
    """lm-eval model backend for an R2LMForDiffusionLM checkpoint (any attention kind, AR or diffusion)."""

    backend = "causal"

    def __init__(self, pretrained=None, model=None, tokenizer=None, mode: str = "auto", mc_num: int = 128,
                 mc_batch_size: int | None = None, batch_size=None, block_size: int | None = None,
                 threshold: float = 0.9, greedy_check=True, seed: int = 0, max_length: int | None = None,
                 prefix_token_id: int | None = None, device: str | None = None, dtype: str = "auto",
                 max_batch_size=None, **unknown):
        super().__init__()
        # every argument is checked before the model loads (a ValueError naming it)
        check_arguments(unknown)
        if mode not in scoring.MODES:
            raise ValueError(f"mode must be one of {scoring.MODES}, got {mode!r}")
        self.mc_num = _int("mc_num", mc_num)
        self.mc_batch_size = 32 if mc_batch_size is None else _int("mc_batch_size", mc_batch_size)
        # lm-eval's --batch_size (default 1) batches generate_until prompts; the estimator batches its own samples
        self.gen_batch_size = _batch_size(batch_size) or 8
        self.greedy_check = _flag("greedy_check", greedy_check)
        self.threshold = _threshold(threshold)
        self.seed = _int("seed", seed, 0)
        if dtype != "auto" and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"dtype must be auto or a torch dtype name (float32, bfloat16, float16), got {dtype!r}")
        if isinstance(tokenizer, str) and not Path(tokenizer).is_dir() and (
                Path(tokenizer).is_file() or tokenizer.startswith(("/", "./", "../", "~"))):  # else: a hub name
            raise ValueError(f"tokenizer={tokenizer}: no such folder (give the folder of a tokenizer)")
        if model is None and pretrained is None:
            raise ValueError("give pretrained=PATH (an R2LM checkpoint folder)")
        config = model.config if model is not None else checkpoint_config(pretrained, tokenizer)
        limit = config.max_position_embeddings
        block = block_size if block_size is not None else config.block_size
        self.block_size = _int("block_size", block)
        self._max_length = limit if max_length is None else _int(
            "max_length", max_length, 1, limit, "the model's max_position_embeddings")
        self._prefix = None if prefix_token_id is None else _int(
            "prefix_token_id", prefix_token_id, 0, config.vocab_size - 1, "the model's last token id")

        from transformers import AutoTokenizer

        if model is None:
            model, tok = common.load_model(str(pretrained), resolve_device(device), dtype)
            tokenizer = tokenizer or tok
        if isinstance(tokenizer, str) or tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer or str(pretrained))
        self.model, self.tokenizer = model.eval(), tokenizer
        self.mode = scoring.eval_mode(model, mode)
        self.caches = scoring.ContextCache()  # block models: a context's KV cache, shared by its choices
        self._device = model.device
        eos = common.eos_of(tokenizer, model)
        if eos is None:
            raise ValueError("the tokenizer defines no EOS token (lm-eval's end-of-text token)")
        self._eot = eos
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        logger.info("r2lm backend: %s", common.describe(model, self.mode))

    # ---------------------------------------------------------------- TemplateLM plumbing

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        """What lm-eval's HFLM conditions rolling windows and empty contexts on: the given prefix_token_id, else the
        tokenizer's BOS, else EOS (TemplateLM's default is always EOS)."""
        if self._prefix is not None:
            return self._prefix
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "r2lm").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"]

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # ---------------------------------------------------------------- scoring

    @property
    def _request_tokens(self) -> int:
        """Context + continuation tokens one scored request may have: the model reads them all, but an AR model never
        reads the continuation's last token (it only predicts it), as in lm-eval's HFLM."""
        return self.max_length + (self.mode == "ar")

    def _score(self, context: list[int], continuation: list[int], greedy: bool) -> tuple[float, bool]:
        room = self._request_tokens
        if len(continuation) > room - 1:
            raise ValueError(f"a continuation of {len(continuation)} tokens does not fit in max_length {self.max_length}")
        context = context[-(room - len(continuation)) :]
        ll = scoring.answer_loglikelihood(self.model, context, continuation, mode=self.mode, mc_num=self.mc_num,
                                          batch_size=self.mc_batch_size, block_size=self.block_size, seed=self.seed,
                                          caches=self.caches)
        is_greedy = greedy and scoring.greedy_reproduces(self.model, context, continuation, self.mode, self.block_size)
        return ll, bool(is_greedy)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        out = []
        for key, context, continuation in tqdm(requests, desc="r2lm loglikelihood", disable=disable_tqdm or self.rank):
            result = self._score(context, continuation, self.greedy_check)
            out.append(result)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils

        out = []
        for req in tqdm(requests, desc="r2lm loglikelihood_rolling", disable=disable_tqdm or self.rank):
            (string,) = req.args
            windows = map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self._request_tokens - 1, context_len=1))
            total = sum(self._score(ctx, cont, False)[0] for ctx, cont in windows)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return out

    # ---------------------------------------------------------------- generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from r2lm import generate

        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        bar = tqdm(total=len(requests), desc="r2lm generate_until", disable=disable_tqdm or self.rank)
        for indices in groups.values():
            kwargs = dict(requests[indices[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", 256))
            do_sample = _flag("generate_until's do_sample", kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            options = dict(
                block_size=1 if self.mode == "ar" else int(kwargs.pop("block_size", self.block_size)),
                threshold=float(kwargs.pop("threshold", self.threshold)),
                temperature=temperature if do_sample or temperature > 0 else 0.0,
                top_p=kwargs.pop("top_p", None), top_k=kwargs.pop("top_k", None),
            )
            if kwargs:
                logger.warning("generate_until ignores %s", sorted(kwargs))
            encoded = {i: self.tok_encode(requests[i].args[0]) for i in indices}
            order = sorted(indices, key=lambda i: -len(encoded[i]))
            for first in range(0, len(order), self.gen_batch_size):
                rows = order[first : first + self.gen_batch_size]
                prompts = [encoded[i][-max(self.max_length - max_new, 1) :] or [self._eot] for i in rows]
                width = max(map(len, prompts))
                ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for r, p in enumerate(prompts):
                    ids[r, width - len(p) :] = torch.tensor(p)
                    mask[r, width - len(p) :] = 1
                out = generate(self.model, ids.to(self._device), mask.to(self._device), max_new_tokens=max_new,
                               stop_strings=until or None, tokenizer=self.tokenizer, eos_token_id=self._eot,
                               pad_token_id=self.pad_id, **options)
                for r, i in enumerate(rows):
                    text = self.tok_decode(out.sequences[r, width:].tolist())
                    for stop in until:
                        if stop and stop in text:
                            text = text[: text.index(stop)]
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(rows))
        bar.close()
        return results


def register() -> None:
    """Register the "r2lm" backend (idempotent). lm-eval's own backends are registered first: its `get_model`
    only imports them while the registry is empty."""
    import lm_eval.models  # noqa: F401
    from lm_eval.api.registry import model_registry

    if NAME not in model_registry:  # once registered (placeholder, or the class once resolved), leave it
        model_registry.register(NAME, target="eval.lm_eval_adapter:R2LMEvalLM")


register()


def main(argv=None) -> None:
    """lm-eval's CLI with the "r2lm" backend registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
