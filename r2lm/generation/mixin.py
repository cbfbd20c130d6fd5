"""`model.generate`: the generator (r2lm.generation.decoding) as a method, with transformers' surface.

R2LMForDiffusionLM inherits it, as transformers' models inherit GenerationMixin: the model reaches the generator
only through this class, and the generator uses the model only through its methods (prefill, forward with a
plan, prompt_layout, config.kind), importing nothing of r2lm.modeling_r2lm.
"""

from __future__ import annotations

import torch
from transformers import GenerationMixin

from r2lm.generation.decoding import generate


class R2LMGenerationMixin(GenerationMixin):
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, generation_config=None,
                 **kwargs):
        """Cached parallel decoding (r2lm.generate) with transformers' surface: options default to
        `generation_config`, else `self.generation_config` (generation_config.json of the checkpoint: block_size,
        threshold and the other decoding options, plus transformers' own eos_token_id, do_sample, temperature,
        top_k, top_p, max_new_tokens), and `kwargs` override both. Returns the sequences [B, P + new], or the
        GenerateOutput with `return_dict_in_generate=True`."""
        return_dict = kwargs.pop("return_dict_in_generate", False)
        out = generate(self, input_ids, attention_mask, generation_config=generation_config, **kwargs)
        return out if return_dict else out.sequences
