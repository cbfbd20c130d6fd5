"""The training configuration: one YAML file plus `key=value` overrides, checked before any work starts.

    deepspeed --num_gpus 8 train/pretrain.py --config configs/train/NAME.yaml lr=3e-4 data.streaming=true

Every key is declared once below with its type, default and help text; `--help` prints that table. Unknown keys
(misspellings included) are an error naming them, so a typo never silently falls back to a default.

A resumed run continues the checkpoint's optimizer, LR schedule, data order and noise exactly, so it refuses
changed values of every key except those declared `resume_may_change` (they do not change what is computed:
logging, evaluation and checkpoint frequency, export, tracking ...; train/checks.py check_resume).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
REQUIRED = object()  # sentinel default: the key must be given


def opt(default, help: str, kind=None, choices=None, resume_may_change=False):
    """A config key: default value, help text, expected type(s), allowed values, and whether a resumed run may give
    it another value than its checkpoint's."""
    if kind is None and default is not REQUIRED and default is not None:
        kind = type(default)
    meta = {"help": help, "kind": kind, "choices": choices, "resume_may_change": resume_may_change}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class DataConfig:
    train: Any = opt(REQUIRED, "training data: a text/jsonl/json/parquet file, a folder or glob of them, a list of "
                     "those, or a hub dataset name", kind=(str, list))
    heldout: Any = opt(None, "held-out data (same forms as `train`); when null, `heldout_fraction` of the training "
                       "documents is held out", kind=(str, list))
    heldout_fraction: float = opt(0.0, "fraction of training documents held out when `heldout` is null (every "
                                  "1/f-th document, so it works with streaming too); 0 disables held-out evaluation")
    format: str = opt("auto", "file format; auto = from the file extension", choices=("auto", "text", "json", "parquet", "hub"))
    text_field: str = opt("text", "column holding the text in json/parquet/hub data")
    text_unit: str = opt("paragraph", "what one document is in a plain-text file", choices=("paragraph", "line", "document"))
    hub_config: Any = opt(None, "configuration name of a hub dataset (e.g. sample-10BT)", kind=str)
    hub_split: str = opt("train", "split of a hub dataset to read")
    streaming: bool = opt(False, "stream documents instead of tokenising the whole corpus up front (large corpora); "
                          "a resumed run fast-forwards through the stream to its position")
    shuffle_buffer: int = opt(10000, "documents in the (seeded) shuffle buffer when streaming; 0 = source order")
    num_proc: int = opt(1, "processes for tokenisation (non-streaming); it sets where packing batches start, so the "
                        "packed sequences depend on it")
    cache_dir: Any = opt(None, "datasets cache folder (default: the HF datasets cache)", kind=str,
                         resume_may_change=True)


@dataclass
class WandbConfig:
    mode: str = opt("offline", "offline (written under OUTPUT_DIR/wandb, sync later), online (falls back to offline "
                    "without an API key) or disabled", choices=("offline", "online", "disabled"),
                    resume_may_change=True)
    project: str = opt("r2lm", "wandb project", resume_may_change=True)
    name: Any = opt(None, "run name (default: the output folder's name)", kind=str, resume_may_change=True)
    entity: Any = opt(None, "wandb entity (team or user)", kind=str, resume_may_change=True)
    tags: list = opt([], "run tags", resume_may_change=True)


@dataclass
class CertaintySection:
    entropy_weight: float = opt(2.0, "objective certainty: weight of the entropy term (dParallel: 2)")
    temperature: float = opt(0.5, "objective certainty: temperature tau of softmax(logits / tau) whose entropy is "
                             "minimised where the argmax is already right (dParallel: 0.5)")


FRESH_DRAFTERS = ("target", "random")  # drafter.init values that make a new drafter; any other is a drafter's folder


@dataclass
class DrafterSection:
    layers: int = opt(1, "objective drafter: decoder layers of the drafter (of the target's width)")
    in_block: str = opt("bidirectional", "objective drafter: attention inside the drafted block",
                        choices=("bidirectional", "causal"))
    sidecar: bool = opt(False, "objective drafter: a reverse Mamba sidecar over the block on every drafter layer "
                        "(right-side context inside the block)")
    layout: str = opt("r2lm", "objective drafter: r2lm's own drafter computation, or vLLM's DFlash drafter (dflash: "
                      "q/k norm, no sidecar; r2lm-convert drafter-to-dflash exports it for vLLM's speculative method)",
                      choices=("r2lm", "dflash"))
    block_size: int = opt(8, "objective drafter: the draft length b (tokens drafted per verification)")
    feature_layers: Any = opt(None, "objective drafter: the target layers whose outputs it reads (default: five, from "
                              "the first to the last, evenly spaced)", kind=list)
    draft_vocab_size: int = opt(8192, "objective drafter: it drafts from this many of the tokens most frequent in the "
                                "training replies (0: the whole vocabulary); a smaller LM head costs less per draft")
    init: str = opt("target", "objective drafter: start the drafter's layers from the target's top layers (and its "
                    "final norm), which already read the target's hidden states (target); from random weights "
                    "(random); or go on from a trained drafter's folder (its weights, draft vocabulary and shape: e.g. "
                    "r2lm/drafters/smollm2-135m-instruct, or a run's final/), to adapt it to other data")
    blocks: int = opt(16, "objective drafter: blocks drawn per training sequence (random anchors in its reply)")
    decay: float = opt(0.8, "objective drafter: loss weight of block column j is decay**j (an early token gates the "
                       "acceptance of every later one)")
    replay: float = opt(0.0, "objective drafter: share of each sequence's blocks that open where decoding would open "
                        "the next block after one drafted at a random anchor (right after the drafter's first wrong "
                        "guess: Draft-OPD's replay of its own errors, for a curve that has flattened); costs a forward "
                        "of the drafter without gradients per step")
    conditional: bool = opt(False, "objective drafter: column j's loss counts only in blocks whose guesses before it are "
                            "right (verification reads it only then): the columns of a block learn to follow each "
                            "other's guesses rather than each its own likeliest token")
    feature_weight: float = opt(1.0, "objective drafter: weight of the regression of each block column's last hidden "
                                "state onto the target's own (EAGLE's dense supervision; needs the target's last layer "
                                "among feature_layers); 0 = cross-entropy alone")
    distill: bool = opt(False, "objective drafter: learn the target's own next-token distribution (its logits over "
                        "the draft vocabulary, from its last layer, which must be a feature layer) instead of the text's "
                        "next token: self-distillation, for text the target did not write (train/fixed_text.py)")
    features_dtype: str = opt("float32", "objective drafter: the dtype of the frozen target's forward that computes "
                              "the features (bfloat16: about twice as fast on a CPU with bf16 instructions)",
                              choices=("float32", "bfloat16"))
    max_tokens: int = opt(0, "objective drafter: read only the leading records of data.train up to this many tokens "
                          "(0: all of them): the same corpus at several sizes, for tau against data size")
    features_cache: Any = opt(None, "objective drafter: a folder that keeps the frozen target's features of every "
                              "record (bfloat16), computed once instead of every epoch", kind=str,
                              resume_may_change=True)

    def choices(self) -> dict:
        """The DrafterConfig fields this section sets."""
        out = dict(num_hidden_layers=self.layers, in_block=self.in_block, sidecar=self.sidecar, layout=self.layout,
                   block_size=self.block_size, draft_vocab_size=self.draft_vocab_size)
        if self.feature_layers is not None:
            out["feature_layers"] = list(self.feature_layers)
        return out


@dataclass
class LoraSection:
    enabled: bool = opt(False, "wrap the model with peft LoRA adapters before DeepSpeed (stage 2 of hybrid conversion, "
                        "train/lora.py): only the adapters train; the export (final/) is the adapter, merged with "
                        "python -m convert merge-lora BASE final DST")
    r: int = opt(8, "LoRA rank")
    alpha: float = opt(16.0, "LoRA alpha (the update is scaled by alpha / r)")
    dropout: float = opt(0.0, "dropout on the adapters' input (replayed exactly on resume)")
    target_modules: list = opt(["q_proj", "k_proj", "v_proj", "o_proj"], "module names that get adapters, in every layer")


@dataclass
class TrainConfig:
    model: str = opt(REQUIRED, "R2LM checkpoint folder to start from (python -m convert from-hf ...)", kind=str)
    output_dir: str = opt(REQUIRED, "run folder: checkpoints/, final/ (HF export), metrics.jsonl, train.log, wandb/",
                          kind=str, resume_may_change=True)
    deepspeed: str = opt("configs/deepspeed/zero2.json", "DeepSpeed JSON config (ZeRO stage and communication "
                         "settings); relative paths are tried from the working directory, then the repository root")
    precision: str = opt("auto", "auto = bf16 on CUDA, fp32 on CPU; overrides bf16.enabled of the DeepSpeed config",
                         choices=("auto", "bf16", "fp32"))
    seed: int = opt(0, "seed of the data order, the diffusion noise and anything else random")

    objective: str = opt("block", "training objective: ar | mdlm | block (r2lm.diffusion); certainty (certainty forcing "
                         "after dParallel, on teacher continuations from train/teacher_data.py: block CE on two "
                         "complementary views + certainty.entropy_weight x the entropy of softmax(logits / "
                         "certainty.temperature) where the argmax is already right); or attention_transfer (stage 1 of "
                         "hybrid conversion, train/transfer.py: per-layer MSE of block-hybrid layers to their own softmax "
                         "attention on noised block-diffusion batches; only feature maps and gates train); or drafter "
                         "(a drafter for verify=True beside the frozen model, on teacher records of its own replies: "
                         "train/drafter.py; the drafter.* keys)",
                         choices=("ar", "mdlm", "block", "certainty", "attention_transfer", "drafter"))
    complementary: bool = opt(False, "block objective: also train on the complementary mask of every sample (the "
                              "certainty objective always does)")
    eps: float = opt(1e-3, "diffusion objectives: smallest masking probability")
    freeze_backbone: bool = opt(False, "train only the sidecars and their gates (R2LM plug-in variant)")
    gradient_checkpointing: bool = opt(False, "recompute layer activations in the backward pass to save memory (the "
                                       "same forward, recomputed)", resume_may_change=True)

    seq_len: int = opt(512, "tokens per packed training sequence (at most the model's max_position_embeddings)")
    micro_batch_size: int = opt(4, "sequences per rank per forward")
    grad_accum: int = opt(1, "micro-batches accumulated per optimizer step")
    steps: int = opt(1000, "optimizer steps in the whole run (sets the LR schedule)")
    stop_at: Any = opt(None, "stop after this step with a checkpoint, without finishing the schedule (time-limited "
                       "jobs); rerun with resume=auto to continue", kind=int, resume_may_change=True)

    lr: float = opt(1e-4, "peak learning rate (AdamW)")
    min_lr_ratio: float = opt(0.1, "final learning rate of the cosine decay, as a fraction of lr")
    warmup_steps: int = opt(100, "linear warmup steps")
    weight_decay: float = opt(0.1, "AdamW weight decay, applied to matrices only (not norms, biases, gates, SSM A/D/dt)")
    adam_betas: list = opt([0.9, 0.95], "AdamW betas")
    adam_eps: float = opt(1e-8, "AdamW epsilon")
    grad_clip: float = opt(1.0, "gradient clipping by global norm; 0 disables")

    log_every: int = opt(10, "log a line (and update wandb) every N steps; metrics.jsonl gets every step",
                         resume_may_change=True)
    eval_every: int = opt(200, "held-out evaluation every N steps (and at the end); 0 = only at the end",
                          resume_may_change=True)
    eval_batches: int = opt(8, "held-out micro-batches per rank per evaluation (fewer if the held-out set is smaller)")
    eval_at_start: bool = opt(True, "evaluate once before the first step", resume_may_change=True)
    eval_seed: int = opt(1234, "noise seed of the held-out evaluation, fixed so evaluations are comparable")

    save_every: int = opt(500, "DeepSpeed checkpoint every N steps (and at the end); 0 = only at the end",
                          resume_may_change=True)
    keep_checkpoints: int = opt(2, "complete checkpoints kept (older ones are deleted); 0 keeps all",
                                resume_may_change=True)
    resume: str = opt("auto", "auto = continue from the latest complete checkpoint in OUTPUT_DIR/checkpoints if any; "
                      "never = start fresh (refuses a folder that has checkpoints); or a checkpoint folder path",
                      resume_may_change=True)
    resume_unverified: bool = opt(False, "resume from a checkpoint that has no checksums.sha256 (its manifest deleted, "
                                  "or written before r2lm wrote one), whose files cannot be checked; without it such a "
                                  "checkpoint is refused", resume_may_change=True)
    resume_data_changed: bool = opt(False, "resume although a data file changed since the checkpoint (the batches then "
                                    "differ from the uninterrupted run's); without it the run is refused, naming the "
                                    "file", resume_may_change=True)
    export: bool = opt(True, "write an HF-format R2LM folder to OUTPUT_DIR/final when the run ends",
                       resume_may_change=True)
    export_dtype: str = opt("auto", "dtype of the export; auto = the dtype of the starting checkpoint",
                            choices=("auto", "float32", "bfloat16", "float16"), resume_may_change=True)

    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "data pipeline (train/data.py)"})
    wandb: WandbConfig = field(default_factory=WandbConfig, metadata={"help": "experiment tracking"})
    lora: LoraSection = field(default_factory=LoraSection, metadata={"help": "LoRA adapters (peft)"})
    certainty: CertaintySection = field(default_factory=CertaintySection,
                                        metadata={"help": "certainty forcing (objective certainty)"})
    drafter: DrafterSection = field(default_factory=DrafterSection,
                                    metadata={"help": "a drafter for the frozen model (objective drafter)"})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------- loading


def parse_overrides(items: list[str]) -> dict:
    """`a.b=value` strings -> nested dict; values parsed as YAML scalars (3, 1.0e-4, true, null, [1, 2])."""
    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key=value (dotted keys for nesting: data.train=...)")
        try:
            parsed = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError as err:
            raise ValueError(f"override {item!r}: cannot parse the value as YAML: {err}") from None
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r} conflicts with another override of {part!r}")
        node[parts[-1]] = parsed
    return out


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Read the YAML file (if any), apply overrides, check every key and value. Raises ValueError."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"config file {path} is not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"config file {path} must hold a mapping of keys to values, got {type(raw).__name__}")
    raw = merge(raw, parse_overrides(list(overrides)))
    unknown = sorted(_unknown_keys(TrainConfig, raw))
    if unknown:
        hints = [f"{k} (did you mean {s}?)" if (s := _suggest(k)) else k for k in unknown]
        raise ValueError(f"unknown config key(s): {', '.join(hints)}; run train/pretrain.py --help for the list")
    cfg = _build(TrainConfig, raw, prefix="")
    check_values(cfg)
    return cfg


def resolve_path(value: str) -> Path:
    """A path of the config (model, deepspeed): as given where it exists (or is absolute), else relative to the
    repository, so that the shipped configs' configs/... paths work from any working directory."""
    path = Path(value).expanduser()
    if path.is_absolute() or path.exists():
        return path
    return REPO / path if (REPO / path).exists() else path


def _unknown_keys(cls, raw: dict, prefix: str = ""):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in raw.items():
        f = fields.get(key)
        if f is None:
            yield prefix + str(key)
        elif _is_section(f) and isinstance(value, dict):  # a non-mapping section is reported by _build
            yield from _unknown_keys(type(f.default_factory()), value, prefix + key + ".")


def _is_section(f) -> bool:
    return f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory())


def _suggest(key: str) -> str | None:
    names = [name for name, _ in all_keys(TrainConfig)]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if close:
        return close[0]
    longer = [name for name in names if name.startswith(key + "_")]  # warmup -> warmup_steps
    return longer[0] if len(longer) == 1 else None


def _build(cls, raw: dict, prefix: str, missing: list | None = None):
    top = missing is None
    missing = [] if top else missing
    values = {}
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        if _is_section(f):
            sub = raw.get(f.name, {})
            if not isinstance(sub, dict):
                raise ValueError(f"config key {name} must be a mapping of keys, got {sub!r}")
            values[f.name] = _build(type(f.default_factory()), sub, name + ".", missing)
            continue
        if f.name not in raw:
            if f.default is REQUIRED:
                missing.append(name)
            continue
        values[f.name] = _coerce(name, raw[f.name], f.metadata)
    if top and missing:
        raise ValueError(f"missing required config key(s): {', '.join(sorted(missing, key=lambda n: n.count('.')))}")
    return None if missing else cls(**values)  # a section with missing keys: reported at the top level


def _coerce(name: str, value, meta: dict):
    kind, choices = meta["kind"], meta["choices"]
    if value is None:
        return None  # optional keys only; required values are checked in check_values
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, str):
        try:  # YAML reads "1e-4" (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = any(isinstance(value, k) and not (k is int and isinstance(value, bool)) for k in kinds)
    if not ok:
        expected = " or ".join(k.__name__ for k in kinds)
        raise ValueError(f"config key {name} must be {expected}, got {value!r}")
    if choices and value not in choices:
        raise ValueError(f"config key {name} must be one of {choices}, got {value!r}")
    return value


def check_values(cfg: TrainConfig) -> None:
    """Value checks that need no file access (those come in train/checks.py validate)."""
    positive = ["seq_len", "micro_batch_size", "grad_accum", "steps", "eval_batches"]
    for key in positive:
        if getattr(cfg, key) <= 0:
            raise ValueError(f"config key {key} must be positive, got {getattr(cfg, key)}")
    for key in ["warmup_steps", "log_every", "eval_every", "save_every", "keep_checkpoints", "grad_clip", "weight_decay"]:
        if getattr(cfg, key) < 0:
            raise ValueError(f"config key {key} must be >= 0, got {getattr(cfg, key)}")
    if cfg.log_every == 0:
        cfg.log_every = 1
    if cfg.lr <= 0:
        raise ValueError(f"config key lr must be positive, got {cfg.lr}")
    if not 0 < cfg.eps < 1:
        raise ValueError(f"config key eps (the smallest masking probability) must be in (0, 1), got {cfg.eps}")
    for key in ("seed", "eval_seed"):  # numpy's generators take no negative seed, torch's none from 2**64 on
        if not 0 <= getattr(cfg, key) < 2**63:
            raise ValueError(f"config key {key} must be an integer in [0, 2**63), got {getattr(cfg, key)}")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ValueError(f"config key min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if len(cfg.adam_betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in cfg.adam_betas):
        raise ValueError(f"config key adam_betas must be two numbers in [0, 1), got {cfg.adam_betas}")
    if cfg.stop_at is not None and not 0 < cfg.stop_at <= cfg.steps:
        raise ValueError(f"config key stop_at must be in [1, steps={cfg.steps}], got {cfg.stop_at}")
    if not 0 <= cfg.data.heldout_fraction < 1:
        raise ValueError(f"config key data.heldout_fraction must be in [0, 1), got {cfg.data.heldout_fraction}")
    if cfg.data.heldout is not None and cfg.data.heldout_fraction:
        raise ValueError("give either data.heldout or data.heldout_fraction, not both")
    if cfg.data.shuffle_buffer < 0 or cfg.data.num_proc < 1:
        raise ValueError("data.shuffle_buffer must be >= 0 and data.num_proc >= 1")
    for key in ("train", "heldout"):
        value = getattr(cfg.data, key)
        if isinstance(value, list) and (not value or not all(isinstance(v, str) for v in value)):
            raise ValueError(f"config key data.{key} must be a string or a non-empty list of strings, got {value!r}")
    if cfg.data.train in ("", None):
        raise ValueError("config key data.train is empty: give the training data")
    check_certainty(cfg)
    check_drafter(cfg)
    lora = cfg.lora
    if lora.r <= 0 or lora.alpha <= 0 or not 0 <= lora.dropout < 1:
        raise ValueError(f"config keys lora.r and lora.alpha must be positive and lora.dropout in [0, 1), got r={lora.r}, "
                         f"alpha={lora.alpha}, dropout={lora.dropout}")
    if not lora.target_modules or not all(isinstance(m, str) and m for m in lora.target_modules):
        raise ValueError(f"config key lora.target_modules must be a non-empty list of module names, got {lora.target_modules!r}")


def check_certainty(cfg: TrainConfig) -> None:
    """certainty.* values, and no such key set for another objective (it would be silently ignored)."""
    section = cfg.certainty
    if section.temperature <= 0 or section.entropy_weight < 0:
        raise ValueError(f"config keys certainty.temperature must be positive and certainty.entropy_weight >= 0, got "
                         f"temperature={section.temperature}, entropy_weight={section.entropy_weight}")
    if cfg.objective != "certainty" and section != CertaintySection():
        raise ValueError(f"the certainty.* keys set the certainty objective, but objective is {cfg.objective!r}")


def check_drafter(cfg: TrainConfig) -> None:
    """drafter.* values, and no such key set for another objective (it would be silently ignored)."""
    section = cfg.drafter
    if section.max_tokens < 0:
        raise ValueError(f"config key drafter.max_tokens must be >= 0 (0: every record), got {section.max_tokens}")
    for key in ("layers", "block_size", "blocks"):
        if getattr(section, key) <= 0:
            raise ValueError(f"config key drafter.{key} must be positive, got {getattr(section, key)}")
    if section.feature_weight < 0:
        raise ValueError(f"config key drafter.feature_weight must be >= 0, got {section.feature_weight}")
    if not 0 <= section.replay <= 1:
        raise ValueError(f"config key drafter.replay is a share of the blocks, in [0, 1]: got {section.replay}")
    if section.init not in FRESH_DRAFTERS and not (resolve_path(section.init) / "config.json").is_file():
        raise ValueError(f"config key drafter.init is target, random or a drafter's folder (its config.json and "
                         f"weights); {section.init!r} is none of them")
    if section.draft_vocab_size < 0 or not 0 < section.decay <= 1:
        raise ValueError(f"config keys drafter.draft_vocab_size must be >= 0 and drafter.decay in (0, 1], got "
                         f"{section.draft_vocab_size} and {section.decay}")
    if cfg.objective != "drafter" and dataclasses.replace(section, features_cache=None) != DrafterSection():
        raise ValueError(f"the drafter.* keys set the drafter objective, but objective is {cfg.objective!r}")


# ---------------------------------------------------------------------------------------------- resume


def flatten(values: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a (nested) config dict."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(flatten(value, prefix + key + "."))
        else:
            out[prefix + key] = value
    return out


def resume_conflicts(saved: dict, cfg: TrainConfig) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, cfg's value) of every key that differs from `saved` (the config a checkpoint was
    written with) and may not change on resume. A key the checkpoint's config lacks had its default."""
    fields = dict(all_keys())
    old = {**{name: default_of(f) for name, f in fields.items()}, **flatten(saved)}
    return [(name, old[name], value) for name, value in flatten(cfg.to_dict()).items()
            if not fields[name].metadata["resume_may_change"] and old[name] != value]


# ---------------------------------------------------------------------------------------------- help


def all_keys(cls=TrainConfig, prefix: str = ""):
    """(dotted name, field) for every leaf key."""
    for f in dataclasses.fields(cls):
        if _is_section(f):
            yield from all_keys(type(f.default_factory()), prefix + f.name + ".")
        else:
            yield prefix + f.name, f


def default_of(f):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def keys_help() -> str:
    lines = ["config keys (YAML file and/or key=value overrides):"]
    for name, f in all_keys():
        default = "(required)" if f.default is REQUIRED else default_of(f)
        choices = f" {{{', '.join(f.metadata['choices'])}}}" if f.metadata.get("choices") else ""
        free = "   (may change on resume)" if f.metadata["resume_may_change"] else ""
        lines.append(f"  {name}{choices} = {default}{free}")
        lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)
