"""Counter-based sampling: the noise of a token is a pure function of (sample seed, position, vocab id).

A completion therefore does not depend on which other requests share its batch, and two
backends that compute equal logits produce equal tokens. Sampling is Gumbel-max:
argmax(logits/T + G) with G = -log(-log(U)), U hashed from the counters.
"""

from __future__ import annotations

import hashlib

import torch

MASK32 = 0xFFFFFFFF


def sample_seed(run_seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """The seed of one sample from (run seed, outer step, global prompt index, sample index)."""
    key = f"{run_seed}/{step}/{prompt_index}/{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1  # fits int64


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding 32-bit values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """U in (0, 1) of shape [B, V] for int64 `seeds` [B] and `positions` [B]."""
    device = seeds.device
    vocab = torch.arange(vocab_size, device=device, dtype=torch.int64)
    seed_lo = (seeds & MASK32)[:, None]
    seed_hi = ((seeds >> 32) & MASK32)[:, None]
    h = _fmix32(seed_lo ^ _fmix32(seed_hi ^ 0x9E3779B9))
    h = _fmix32(h ^ ((positions[:, None] * 0x27D4EB2F) & MASK32))
    h = _fmix32(h ^ ((vocab[None, :] * 0x165667B1 + 0x61C88647) & MASK32))
    return ((h >> 8).to(torch.float64) + 0.5) / float(1 << 24)


def truncate_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus-p set to -inf (0 / 1.0 disable them)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p  # keep the token that crosses p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                temperature: float, top_k: int = 0, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; returns (tokens [B], log-probs [B] of the distribution sampled from).

    temperature == 0 is greedy, with the log-prob of the temperature-1 distribution.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    scaled = truncate_logits(logits / temperature, top_k, top_p)
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, positions, logits.shape[-1])))
    tokens = (scaled.double() + gumbel).argmax(-1)
    return tokens, torch.log_softmax(scaled, -1).gather(-1, tokens[:, None])[:, 0]
