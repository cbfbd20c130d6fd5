from r2lm.layers.attention import Attention
from r2lm.layers.hybrid import BlockHybridAttention
from r2lm.layers.mamba2 import Mamba2Mixer
from r2lm.layers.mlp import MLP
from r2lm.layers.norm import GatedRMSNorm, RMSNorm
from r2lm.layers.rotary import RotaryEmbedding, apply_rotary
from r2lm.layers.sidecar import ReverseSidecar

__all__ = ["Attention", "BlockHybridAttention", "GatedRMSNorm", "MLP", "Mamba2Mixer", "RMSNorm", "ReverseSidecar", "RotaryEmbedding", "apply_rotary"]
