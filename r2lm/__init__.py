"""r2lm: bifocal diffusion language models (causal attention with an exact KV cache, a reverse Mamba sidecar
for right context, block-hybrid linear attention) and cached parallel decoding."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from r2lm.cache import KVCache
from r2lm.configuration_r2lm import R2LMConfig
from r2lm.generation import GenerateOutput, generate
from r2lm.layout import Layout, dual_stream
from r2lm.modeling_r2lm import R2LMForDiffusionLM, R2LMModel

# As transformers registers its own models: AutoModel gives the decoder stack, AutoModelForCausalLM the model with
# its LM head and generate() (what lm-eval and pipelines load).
AutoConfig.register(R2LMConfig.model_type, R2LMConfig, exist_ok=True)
AutoModel.register(R2LMConfig, R2LMModel, exist_ok=True)
AutoModelForCausalLM.register(R2LMConfig, R2LMForDiffusionLM, exist_ok=True)

__all__ = ["GenerateOutput", "KVCache", "Layout", "R2LMConfig", "R2LMForDiffusionLM", "R2LMModel", "dual_stream",
           "generate"]
