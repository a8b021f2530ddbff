"""``model.generate``: the decoder-only models' one way into :func:`dikkat.generate`."""

from __future__ import annotations

import torch

from dikkat.generation.generate import Prompts, generate
from dikkat.layers.quantized import WeightFormat


class Generates:
    """Mixin for an ``nn.Module`` decoder that meets
    :class:`dikkat.generation.generate.CausalLM`."""

    @torch.no_grad()
    def generate(
        self,
        ids: Prompts,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_id: int | None = None,
        seed: int | None = None,
        weights: WeightFormat | None = None,
    ) -> list[list[int]]:
        """Continue each prompt by up to ``max_new_tokens`` tokens (greedy at temperature 0).

        ``ids`` is a (B, T) tensor or a list of prompts of any lengths; either way the result is
        one list per prompt: the prompt, then its new tokens, cut after the first ``eos_id``.
        Uses a KV cache: one prefill pass, then one-token decode steps (see
        :func:`dikkat.generation.generate`), the linear layers multiplying in the format
        ``weights`` ("fp32", "bf16", "int8", "w8a8"; the parameters themselves stay as they are).
        """
        was_training = self.training
        self.eval()
        try:
            return generate(
                self,  # type: ignore[arg-type]
                ids,
                max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                eos_id=eos_id,
                seed=seed,
                weights=weights,
            )
        finally:
            self.train(was_training)
