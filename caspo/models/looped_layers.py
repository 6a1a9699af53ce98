"""Building blocks of the looped LM (`caspo.models.looped`): RMSNorm, RoPE, GQA attention over one
KV-cache plane, the SwiGLU MLP, the two block layouts, and the additive causal/padding mask."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache

if TYPE_CHECKING:
    from caspo.models.looped import LoopedConfig


class RMSNorm(nn.Module):
    """y = w ⊙ x / sqrt(mean(x²) + ε), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin of angle p·θ^(−2i/d) for i < d/2, each repeated to [B, T, d] (rotate-half layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float) / head_dim)
    angles = position_ids[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ⊙ cos + rotate_half(x) ⊙ sin, with x of shape [B, heads, T, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]


class Attention(nn.Module):
    """Causal GQA attention; kv head j serves query heads j·G .. j·G+G−1 (G = heads / kv_heads)."""

    def __init__(self, cfg: LoopedConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)

    def forward(self, x, cos, sin, mask, cache: Cache | None, plane: int):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, plane)  # this plane's keys/values of all tokens so far
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class MLP(nn.Module):
    """W_down(act(W_gate x) ⊙ W_up x)."""

    def __init__(self, cfg: LoopedConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """ouro:     z ← z + N2(Attn(N1 z));  z ← z + N4(MLP(N3 z))
    nanbeige: z ← z + Attn(N1 z);      z ← z + MLP(N3 z)"""

    def __init__(self, cfg: LoopedConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # N1
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # N3
        self.sandwich = cfg.layout == "ouro"
        if self.sandwich:
            self.input_layernorm_2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # N2
            self.post_attention_layernorm_2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # N4

    def forward(self, z, cos, sin, mask, cache: Cache | None, plane: int):
        a = self.self_attn(self.input_layernorm(z), cos, sin, mask, cache, plane)
        z = z + (self.input_layernorm_2(a) if self.sandwich else a)
        m = self.mlp(self.post_attention_layernorm(z))
        return z + (self.post_attention_layernorm_2(m) if self.sandwich else m)


def causal_mask(attention_mask: torch.Tensor | None, B: int, T: int, past: int, dtype, device) -> torch.Tensor:
    """Additive [B, 1, T, past+T] mask: query i (absolute index past+i) sees key j iff j ≤ past+i and
    attention_mask[b, j] = 1. Blocked entries get the dtype's most negative value (not −inf), so a
    fully padded query row yields finite, ignorable outputs instead of NaN."""
    S = past + T
    keys = torch.arange(S, device=device)
    allowed = (keys[None, :] <= past + torch.arange(T, device=device)[:, None])[None, None]
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape != (B, S):
            raise ValueError(f"attention_mask must be [batch, past+new] = [{B}, {S}], "
                             f"got {tuple(attention_mask.shape)}")
        allowed = allowed & attention_mask[:, None, None, :].bool()
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min).expand(B, 1, T, S)
