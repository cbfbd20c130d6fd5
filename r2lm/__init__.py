"""r2lm: bifocal diffusion language models (causal attention with an exact KV cache, a reverse Mamba sidecar
for right context, block-hybrid linear attention) and cached parallel decoding."""

from transformers import AutoConfig, AutoModel

from r2lm.cache import KVCache
from r2lm.configuration_r2lm import R2LMConfig
from r2lm.generation import GenerateOutput, generate
from r2lm.layout import Layout, dual_stream
from r2lm.modeling_r2lm import R2LMForDiffusionLM

AutoConfig.register(R2LMConfig.model_type, R2LMConfig, exist_ok=True)
AutoModel.register(R2LMConfig, R2LMForDiffusionLM, exist_ok=True)

__all__ = ["GenerateOutput", "KVCache", "Layout", "R2LMConfig", "R2LMForDiffusionLM", "dual_stream", "generate"]
