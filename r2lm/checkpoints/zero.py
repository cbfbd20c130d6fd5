"""The weights of a DeepSpeed ZeRO training checkpoint (stage 1, 2 or 3): the fp32 master weights reassembled from
the per-rank shards with DeepSpeed's own `zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint` (CPU only, no
process group needed). Their export as an HF-format R2LM folder builds a model: r2lm.checkpoints.export.
"""

from __future__ import annotations

from pathlib import Path

import torch


def load_fp32_state_dict(root: Path, tag: str) -> dict[str, torch.Tensor]:
    """The fp32 weights of checkpoint `tag` under `root` (every ZeRO stage), reassembled on the CPU."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as err:
        raise ValueError(f"reading the DeepSpeed checkpoint {root / tag} needs deepspeed (pip install "
                         f"'r2lm[train]'): {err}") from None
    try:
        return get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
    except (FileNotFoundError, ValueError, KeyError) as err:
        raise ValueError(f"cannot reassemble the ZeRO checkpoint {root / tag}: {err}") from err
