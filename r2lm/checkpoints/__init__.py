"""r2lm's on-disk formats, in one place: the converters (r2lm.convert), the training program (train/) and the CLIs
read and write checkpoints only through this package.

- hf:       HF-format folders: config.json, generation_config.json, safetensors weights (unreadable or damaged
            files and NaN / inf refused), tokenizers
- writing:  writing a folder: destination checks (sources, training folders, --overwrite, space), then atomically
            (temporary folder, sealed, swapped into place; killed writers' leftovers removed by the next writer)
- manifest: checksums.sha256, the one manifest of every folder r2lm writes: it lists every file with its sha256,
            so --overwrite recognises r2lm's folders, resume and export verify them, and loaders their weights
- training: training runs and their DeepSpeed checkpoints: tags, complete / latest checkpoints, trainer state
- zero:     a DeepSpeed ZeRO checkpoint's fp32 weights
- export:   a ZeRO checkpoint exported as an HF-format R2LM folder. It builds a model, so it sits above the model,
            which reads its own checkpoints through the modules above: this __init__ does not import it
            (`from r2lm.checkpoints.export import export_deepspeed_checkpoint`)
"""

from r2lm.checkpoints.hf import (
    check_finite,
    check_tokenizer,
    check_weights,
    copy_tokenizer_files,
    has_tokenizer,
    load_tokenizer,
    read_config,
    read_generation_config,
    read_state_dict,
    read_tensors,
    weight_files,
)
from r2lm.checkpoints.manifest import (
    LEGACY_MANIFEST,
    MANIFEST,
    DamagedCheckpointError,
    read_manifest,
    seal,
    verify_checkpoint,
    verify_files,
)
from r2lm.checkpoints.training import (
    STATE_FILE,
    complete_checkpoints,
    first_intact,
    latest_checkpoint,
    read_state,
    resolve_checkpoint,
    tag_of,
)
from r2lm.checkpoints.writing import (
    OVERWRITE_HELP,
    atomic_output_dir,
    check_destination,
    check_replaceable,
    write_checkpoint,
)
from r2lm.checkpoints.zero import load_fp32_state_dict

__all__ = [
    "LEGACY_MANIFEST", "MANIFEST", "OVERWRITE_HELP", "STATE_FILE", "DamagedCheckpointError", "atomic_output_dir",
    "check_destination", "check_finite", "check_replaceable", "check_tokenizer", "check_weights",
    "complete_checkpoints", "copy_tokenizer_files", "first_intact", "has_tokenizer",
    "latest_checkpoint", "load_fp32_state_dict", "load_tokenizer", "read_config",
    "read_generation_config", "read_manifest", "read_state", "read_state_dict", "read_tensors", "resolve_checkpoint",
    "seal", "tag_of", "verify_checkpoint", "verify_files", "weight_files", "write_checkpoint",
]
