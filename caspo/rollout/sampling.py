"""Counter-based sampling: the noise of a token is a pure function of (sample seed, position, vocab id).

A completion therefore does not depend on which other requests share its batch, and two
backends that compute equal logits produce equal tokens. Sampling is Gumbel-max:
argmax(logits/T + G) with G = -log(-log(U)), U hashed from the counters.
"""

from __future__ import annotations

import functools
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


def nucleus_threshold(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest logit [B, 1] of the top-p nucleus.

    The nucleus holds the most likely tokens, in order, while the mass of the tokens before
    them is below top_p: the smallest such set whose mass reaches top_p. A token tied with
    the last one is kept too, so the set never depends on how a sort orders equal values.
    """
    ordered = logits.sort(dim=-1, descending=True).values
    probs = torch.softmax(ordered, dim=-1)
    in_nucleus = (probs.cumsum(-1) - probs) < top_p
    return ordered.gather(-1, in_nucleus.sum(-1, keepdim=True) - 1)


def cut_threshold(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The smallest logit [B, 1] kept by top-k then top-p (0 / 1.0 disable them; -inf keeps everything)."""
    threshold = logits.new_full((logits.shape[0], 1), float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        threshold = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    if top_p < 1.0:
        threshold = nucleus_threshold(logits.masked_fill(logits < threshold, float("-inf")), top_p)
    return threshold


def truncate_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus-p set to -inf (0 / 1.0 disable them); ties at a cut are kept."""
    return logits.masked_fill(logits < cut_threshold(logits, top_k, top_p), float("-inf"))


def gumbel_pick(scaled: torch.Tensor, threshold: torch.Tensor, seeds: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """argmax of scaled + Gumbel noise over the logits >= threshold: (tokens, log-probs, untruncated log-probs)."""
    kept = scaled.masked_fill(scaled < threshold, float("-inf"))
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, positions, scaled.shape[-1])))
    tokens = (kept.double() + gumbel).argmax(-1)
    picked = scaled.gather(-1, tokens[:, None])[:, 0]
    return tokens, picked - torch.logsumexp(kept, -1), picked - torch.logsumexp(scaled, -1)


@functools.cache
def _gumbel_pick_compiled():
    # One fused kernel for the noise hash, the Gumbel argmax and the normalizers instead of
    # ~30 launches over [B, vocab]; integer hashing and float64 sums keep the tokens exact.
    return torch.compile(gumbel_pick)


def _compiled_pick(scaled, threshold, seeds, positions):
    # The batch varies from step to step, the vocabulary never: one compilation with a symbolic
    # batch and a static reduction length (compiled fully dynamic, the engine ran a third slower on an H200).
    for tensor in (scaled, threshold, seeds, positions):
        torch._dynamo.mark_dynamic(tensor, 0)
    return _gumbel_pick_compiled()(scaled, threshold, seeds, positions)


def sample_next(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: float,
                top_k: int = 0, top_p: float = 1.0, compiled: bool | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick one token per row: (tokens [B], log-probs [B], untruncated log-probs [B]).

    log-probs are under the distribution sampled from, softmax(truncate(logits / T));
    untruncated log-probs under softmax(logits / T) over the whole vocabulary.
    temperature == 0 is greedy, with the log-probs of the temperature-1 distribution.
    compiled: run the Gumbel pick through torch.compile (default: on CUDA). Same tokens either
    way; log-probs agree to float32 rounding.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        logprobs = logits.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(logits, -1)
        return tokens, logprobs, logprobs
    scaled = logits / temperature
    threshold = cut_threshold(scaled, top_k, top_p)  # sorting stays eager: it does not fuse
    pick = _compiled_pick if (logits.is_cuda if compiled is None else compiled) else gumbel_pick
    return pick(scaled, threshold, seeds, positions)
