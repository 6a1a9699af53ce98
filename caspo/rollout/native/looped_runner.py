"""The native runner of a looped (fixed-depth recurrent) LM, `model_type: caspo_looped`.

It computes what `caspo.models.looped.LoopedForCausalLM` computes, over the engine's KV cache,
with the attention, MLP and RMSNorm of the Qwen2/Llama runner (`runner.py`):

    x = Embed(tokens)                                   # [B, T, hidden]
    for t in range(depth):
        for l, layer in enumerate(layers):              # the same L layers in every loop
            x = layer(x, rope, batch, cache.layer(t, l))  # writes, then reads, plane t of layer l
        x = FinalNorm(x)                                # the normed state replaces the stream
    hidden = x;  logits = LMHead(hidden)                # the last loop's logits

Recurrence planes: the cache is built with `planes=depth, layers=L`, so (loop t, layer l) is one
of depth × L virtual layers that share the slot table: loop t attends only to loop-t keys of
earlier tokens of its slot, and prefix copies, sleep and wake cover every plane at once.

Layouts: "nanbeige" blocks are the pre-norm Llama layer of `runner.py` (q/o may be non-square);
"ouro" blocks add the sandwich norms N2, N4 on the attention and MLP outputs. Ouro's exit gate
is loaded and published by name (the trainer's `named_parameters()` carry it) but never
evaluated: at fixed depth the logits come from the last loop.
"""

from __future__ import annotations

import torch
from torch import nn

from caspo.rollout.native.kv_cache import KVCache
from caspo.rollout.native.runner import Batch, DecoderLayer, RMSNorm, Runner
from caspo.rollout.native.spec import LoopedSpec


class SandwichLayer(DecoderLayer):
    """Ouro's block: z ← z + N2(Attn(N1 z));  z ← z + N4(MLP(N3 z))."""

    def __init__(self, spec: LoopedSpec, dtype: torch.dtype):
        super().__init__(spec, dtype)
        self.input_layernorm_2 = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)  # N2
        self.post_attention_layernorm_2 = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)  # N4

    def forward(self, x, rope, batch: Batch, kv) -> torch.Tensor:
        x = x + self.input_layernorm_2(self.self_attn(self.input_layernorm(x), rope, batch, kv))
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x)))


class LoopedBackbone(nn.Module):
    def __init__(self, spec: LoopedSpec, dtype: torch.dtype):
        super().__init__()
        layer = SandwichLayer if spec.layout == "ouro" else DecoderLayer
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(layer(spec, dtype) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        if spec.layout == "ouro":
            # Held only so that checkpoints and publications match by name; never evaluated.
            self.early_exit_gate = nn.Linear(spec.hidden_size, 1, dtype=dtype)


class LoopedCausalLM(Runner):
    """The looped decoder. Build it with `loading.build_runner(LoopedCausalLM, spec, ...)`."""

    def __init__(self, spec: LoopedSpec, dtype: torch.dtype):
        super().__init__(spec, dtype)
        self.model = LoopedBackbone(spec, dtype)

    def forward(self, tokens: torch.Tensor, batch: Batch, cache: KVCache) -> torch.Tensor:
        """Hidden states h_T [B, T, hidden] of `tokens` [B, T]; writes their K/V into every plane of `cache`."""
        if (cache.planes, cache.layers) != (self.spec.depth, self.spec.num_layers):
            raise ValueError(f"a KV cache of {cache.planes} planes × {cache.layers} layers cannot hold a looped model "
                             f"of depth {self.spec.depth} × {self.spec.num_layers} layers")
        x = self.model.embed_tokens(tokens)
        rope = self.rope(batch)
        for loop in range(self.spec.depth):
            for index, layer in enumerate(self.model.layers):
                x = layer(x, rope, batch, cache.layer(loop, index))
            x = self.model.norm(x)  # h_t: the next loop's input
        return x
