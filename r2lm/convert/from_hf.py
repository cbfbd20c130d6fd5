"""transformers Qwen3 / Qwen2 / Llama checkpoint -> R2LM checkpoint (docs/design.md section 7).

The backbone's tensors keep their names; sidecars are added with zero gates (the converted model is the
backbone, bit for bit, until training opens them); a [MASK] token is added to the tokenizer and the
embeddings when the vocabulary has none.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from r2lm.checkpoints import (
    check_destination,
    check_finite,
    has_tokenizer,
    load_tokenizer,
    read_config,
    read_generation_config,
    read_state_dict,
    write_checkpoint,
)
from r2lm.configuration_r2lm import R2LMConfig
from r2lm.convert.gguf import reading_gguf
from r2lm.modeling_r2lm import R2LMForDiffusionLM

logger = logging.getLogger(__name__)

SUPPORTED = ("qwen3", "qwen2", "llama")
DEFAULT_MASK_TOKEN = "<|mask|>"


def r2lm_config_from_hf(hf_config, **diffusion) -> R2LMConfig:
    """The R2LM config of a transformers Qwen3 / Qwen2 / Llama config, plus the diffusion fields given."""
    arch = hf_config.model_type
    if arch not in SUPPORTED:
        raise ValueError(f"unsupported source architecture {arch!r}; supported: {', '.join(SUPPORTED)}")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(f"{arch} checkpoint uses sliding-window attention, which r2lm does not support")
    bias = bool(getattr(hf_config, "attention_bias", False))
    return R2LMConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_hidden_layers=hf_config.num_hidden_layers,
        num_attention_heads=hf_config.num_attention_heads,
        num_key_value_heads=hf_config.num_key_value_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
        hidden_act=hf_config.hidden_act,
        max_position_embeddings=hf_config.max_position_embeddings,
        initializer_range=hf_config.initializer_range,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_parameters=_whole_head_rope(arch, dict(hf_config.rope_parameters)),
        # Qwen2: bias on q/k/v only; Qwen3 and Llama: `attention_bias` on q/k/v/o.
        attention_bias=True if arch == "qwen2" else bias,
        o_proj_bias=False if arch == "qwen2" else bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=arch == "qwen3",
        tie_word_embeddings=hf_config.tie_word_embeddings,
        pad_token_id=hf_config.pad_token_id,
        bos_token_id=hf_config.bos_token_id,
        eos_token_id=hf_config.eos_token_id,
        dtype=hf_config.dtype,
        **diffusion,
    )


def _whole_head_rope(arch: str, rope: dict) -> dict:
    """transformers' Qwen3 / Qwen2 / Llama rotate the whole head: their default RoPE ignores a
    partial_rotary_factor, which r2lm's rotary code would honour (LLaDA 2 rotates part of the head), so it is
    dropped; with another RoPE type transformers' own model cannot run it, so it is refused."""
    factor = rope.pop("partial_rotary_factor", 1.0)
    if factor != 1.0:
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"{arch} checkpoint with partial_rotary_factor {factor} and rope_type "
                             f"{rope['rope_type']!r}: transformers' {arch} rotates the whole head, so this is unsupported")
        logger.warning("%s: partial_rotary_factor %s ignored, as transformers' %s does (it rotates the whole head)",
                       arch, factor, arch)
    return rope


@contextlib.contextmanager
def seeded(seed: int):
    """New parameters (sidecars, feature maps) initialised from `seed`, so that the same conversion gives the same
    bits; the caller's random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def is_sidecar_weight(name: str) -> bool:
    return ".sidecar." in name


def load_backbone(model: R2LMForDiffusionLM, state: dict[str, torch.Tensor], *, fresh) -> None:
    """Copy a state dict into `model` by name. Every tensor but the `fresh(name)` ones (the layers this conversion
    adds, which keep their initialisation; each converter names its own) must be present with the right shape, and
    nothing else may be."""
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k: v for k, v in model.state_dict().items() if not fresh(k)}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    unexpected = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state))
    if unexpected:
        raise ValueError(f"checkpoint has tensors the config does not describe: {unexpected[:5]}")
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing[:5]}")
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise ValueError(f"{key} has shape {tuple(tensor.shape)} but the config implies {tuple(expected[key].shape)}")
    model.load_state_dict(state, strict=False)


def check_mask_id(mask_id: int, given: str, src, config, generation, tokenizer) -> None:
    """Refuse a [MASK] id that is also a token with another role in the source: its EOS, padding, BOS or unknown
    id (config, generation config or tokenizer), or any token its tokenizer treats as special (a chat template's
    role markers such as <|im_start|>), the tokenizer's own mask token excepted. Every [MASK] still to decode would
    read as that token, and the model could never write it."""
    roles = (("EOS", "eos_token_id"), ("pad", "pad_token_id"), ("BOS", "bos_token_id"), ("unknown", "unk_token_id"))
    for role, field in roles:
        for where, source in (("config", config), ("generation config", generation), ("tokenizer", tokenizer)):
            value = getattr(source, field, None)
            if mask_id in (value if isinstance(value, list | tuple) else [value]):
                raise ValueError(
                    f"{given} is the {role} token id of {src} (its {where}'s {field} is {value}): the converted model "
                    "could never generate it (every [MASK] would read as that token); give a [MASK] token of its own, "
                    "or leave --mask-token-id and --mask-token out to add a new one"
                )
    if tokenizer is None:
        return
    special = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    special.update(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=True))
    for token, i in special.items():
        if i == mask_id and token != tokenizer.mask_token:
            raise ValueError(
                f"{given} is {token!r}, a special token of {src}'s tokenizer (a chat template's marker or another "
                "role): the converted model could never write it; give a [MASK] token of its own, or leave "
                "--mask-token-id and --mask-token out to add a new one"
            )


def add_mask_row(model: R2LMForDiffusionLM, mask_id: int) -> None:
    """Make room for `mask_id` and set its embedding (and untied output) row to the mean row.

    The mean embedding keeps the new input in the distribution the backbone was trained on."""
    if mask_id >= model.config.vocab_size:
        model.resize_token_embeddings(mask_id + 1, mean_resizing=False)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[mask_id] = emb[:mask_id].float().mean(0).to(emb.dtype)
        if not model.config.tie_word_embeddings:
            head = model.lm_head.weight
            head[mask_id] = head[:mask_id].float().mean(0).to(head.dtype)


def gguf_path(src: Path, gguf_file: str) -> Path:
    """The GGUF file `gguf_file` names in SRC: a name relative to SRC, or an absolute path inside it. A file outside
    SRC is refused: SRC is the folder a conversion reads (generation config and other files beside the model) and
    protects (DST may not be, contain or lie inside it)."""
    if not src.is_dir():
        raise ValueError(f"SRC {src} is not a folder; with --gguf-file, SRC is the folder that holds the GGUF file")
    path = (src / gguf_file).resolve()
    if not path.is_relative_to(src.resolve()):
        raise ValueError(f"--gguf-file {gguf_file} lies outside SRC {src}; give the folder that holds it as SRC and "
                         f"its name as --gguf-file (here: SRC {path.parent}, --gguf-file {path.name})")
    if not path.is_file():
        raise ValueError(f"no GGUF file {src / gguf_file}")
    return path


def check_gguf(path: Path) -> None:
    """Read a GGUF file's header and tensor table (memory-mapped: nothing is dequantised), so that a truncated or
    corrupt file is refused naming it (transformers' loader fails with numpy's "cannot reshape array", a struct
    error or "is not a valid JSON file")."""
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise ValueError(f"--gguf-file needs the gguf package (pip install gguf): {err}") from None
    try:
        GGUFReader(path)  # a tensor whose data the file does not hold fails to take its shape
    except Exception as err:  # ValueError (magic, version), struct.error, OSError (empty file), IndexError ...
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt): {err}") from None


def read_gguf(src: Path, gguf_file: str, dst, overwrite: bool):
    """(config, state dict, tokenizer, transformers' model) of a GGUF file, dequantised by transformers (after the
    destination checks)."""
    path = gguf_path(src, gguf_file)
    # Dequantised weights take about 32 / bits-per-weight times the file's size: 8x for 4-bit quantisation.
    check_destination(dst, [src], overwrite, needed_bytes=8 * path.stat().st_size)
    logger.info("reading %s: transformers' GGUF loader dequantises its quantised weights to %s", path,
                torch.get_default_dtype())
    name = path.relative_to(src.resolve()).as_posix()
    try:
        with reading_gguf():  # the file parsed once for the config, the weights and the tokenizer
            model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name, local_files_only=True)
    except Exception as err:  # an architecture or field it lacks, or a damaged file: checked only now (a read of
        check_gguf(path)  # the whole file, as each of transformers' loaders does), so that a damaged one is named
        raise ValueError(f"transformers cannot load {path}: {err}") from err
    config = model.config
    if hasattr(config, "quantization_config"):  # the weights are dequantised now: nothing of it carries over
        del config.quantization_config
    if config.model_type not in SUPPORTED:
        raise ValueError(f"unsupported architecture {config.model_type!r} in {path}; supported: {', '.join(SUPPORTED)}")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    check_finite(state, path)
    return config, state, tokenizer, model


# what --check allows between the source's logits and the R2LM's, both in float32 (closed gates run the source's
# operations; the margin is for kernels that order a sum another way)
CHECK_TOLERANCE = 1e-3
PROBE = "The quick brown fox jumps over the lazy dog. def main():\n    return 0"


def logit_gap(source, model, tokenizer) -> float:
    """max |logit| difference between the source (a transformers causal LM) and the R2LM converted from it, both in
    float32, on a probe text (token ids 1..32 without a tokenizer)."""
    ids = tokenizer(PROBE, return_tensors="pt").input_ids if tokenizer is not None else torch.arange(1, 33)[None]
    source, model = (m if m.dtype == torch.float32 else copy.deepcopy(m).float() for m in (source, model))
    with torch.no_grad():
        theirs = source.eval()(ids).logits
        ours = model.eval()(ids).logits[..., : theirs.shape[-1]]
    return (ours - theirs).abs().max().item()


def convert_from_hf(
    src,
    dst,
    sidecar_layers=(),
    mask_token: str = DEFAULT_MASK_TOKEN,
    mask_token_id: int | None = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    seed: int = 0,
    gguf_file: str | None = None,
    check: bool = False,
    **diffusion,
) -> Path:
    """Convert the checkpoint folder `src` into an R2LM checkpoint folder `dst`; returns `dst`.

    seed: initialises the sidecars (the same seed gives the same output, bit for bit).
    gguf_file: read the model and tokenizer from this GGUF file in `src` (llama.cpp's format) through
        transformers' GGUF loader, which dequantises quantised weights to floating point.
    check: before writing, run the source (transformers) and the R2LM on a probe text in float32 and refuse a gap
        in their logits above CHECK_TOLERANCE (causal attention, shifted prediction: what the source computes).
    diffusion: R2LMConfig fields (attention, prediction, block_size, sidecar_d_state, ...)."""
    src = Path(src)
    if check and (diffusion.get("attention", "causal"), diffusion.get("prediction", "shift")) != ("causal", "shift"):
        raise ValueError("--check compares the R2LM with the source model, which it computes only with causal "
                         "attention and shifted prediction (the defaults)")
    generation = read_generation_config(src) if src.is_dir() else None  # a corrupt one: refused before any work
    source = None
    if gguf_file is not None:
        hf_config, state, tokenizer, source = read_gguf(src, gguf_file, dst, overwrite)
    else:
        dst = check_destination(dst, [src], overwrite)
        arch = read_config(src).get("model_type")
        if arch not in SUPPORTED:
            raise ValueError(f"unsupported source architecture {arch!r} in {src}; supported: {', '.join(SUPPORTED)}")
        hf_config = AutoConfig.from_pretrained(src, local_files_only=True)
        tokenizer = load_tokenizer(src) if has_tokenizer(src) else None
    arch = hf_config.model_type
    config = r2lm_config_from_hf(hf_config, sidecar_layers=list(sidecar_layers), **diffusion)
    if mask_token_id is not None and not 0 <= mask_token_id < config.vocab_size:
        raise ValueError(
            f"--mask-token-id {mask_token_id} is outside the vocabulary of {src} (ids 0..{config.vocab_size - 1}); give "
            f"an existing id, or leave it out to use --mask-token (added to the vocabulary if missing)"
        )
    if mask_token_id is not None:
        check_mask_id(mask_token_id, f"--mask-token-id {mask_token_id}", src, config, generation, tokenizer)
    dtype = dtype or config.dtype or torch.float32
    new_token = False
    if mask_token_id is None and tokenizer is not None:
        existing = tokenizer.get_vocab().get(mask_token)
        if existing is not None:  # checked before it becomes the tokenizer's mask token
            check_mask_id(existing, f"--mask-token {mask_token!r} (id {existing})", src, config, generation, tokenizer)
            mask_token_id = existing
        else:
            tokenizer.add_special_tokens({"mask_token": mask_token})
            mask_token_id, new_token = tokenizer.convert_tokens_to_ids(mask_token), True
        tokenizer.mask_token = mask_token
    elif mask_token_id is None:  # no tokenizer: a new id after the vocabulary
        mask_token_id, new_token = config.vocab_size, True
    if gguf_file is None:  # every check above is cheap: the weights are read last
        state = read_state_dict(src)

    logger.info("building R2LM (%s, %d layers, sidecars on %s) in %s", arch, config.num_hidden_layers, config.sidecar_layers, dtype)
    with seeded(seed):  # the sidecars' initialisation, and the resized embeddings' before the mask row is set
        model = R2LMForDiffusionLM._from_config(config, dtype=dtype)
        load_backbone(model, state, fresh=is_sidecar_weight)
        if new_token or mask_token_id >= model.config.vocab_size:
            add_mask_row(model, mask_token_id)
    model.config.mask_token_id = mask_token_id
    model.config._check()
    added = sum(p.numel() for n, p in model.named_parameters() if is_sidecar_weight(n))
    logger.info("R2LM: %.1fM parameters, the source's and %.1f%% more in sidecars", model.num_parameters() / 1e6,
                100 * added / (model.num_parameters() - added))
    if check:
        if source is None:
            source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True)
        gap = logit_gap(source, model, tokenizer)
        if not gap <= CHECK_TOLERANCE:  # (a NaN gap fails too)
            raise ValueError(f"--check: the R2LM does not compute what {src} computes: max |logit gap| {gap:.2e} on "
                             f"a probe text, above {CHECK_TOLERANCE:g}; nothing was written")
        logger.info("checked: the R2LM computes what %s computes (closed gates): max |logit gap| %.1e on a probe "
                    "text, float32", src, gap)
    del source

    write_checkpoint(model, dst, src, overwrite, tokenizer)
    logger.info("mask token id %d; %s", mask_token_id, "added" if new_token else "already in the vocabulary")
    return dst
