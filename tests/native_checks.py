"""Helpers of the native-engine tests: a small engine, requests, and the transformers oracle's decisions."""

import torch

from caspo.rollout.base import Request
from caspo.rollout.native import NativeEngine
from caspo.rollout.sampling import sample_seed, truncate_logits, uniform_noise


def engine(model, **kw):
    kw.setdefault("max_seq_len", 64)
    kw.setdefault("capacity_tokens", 64 * 16)
    return NativeEngine(model, **kw)


def requests(n, max_new=12, seed=0):
    """Prompts of 1-3 tokens; max_new_tokens varies so sequences leave at different steps."""
    return [Request([5 + i % 7, 9, 11 + i % 3][: 1 + i % 3], seed=sample_seed(seed, 0, i, 0),
                    max_new_tokens=max_new - i % 4) for i in range(n)]


def with_and_without(model, kernel: str, reqs, sp):
    """(completions with the engine option `kernel` on, with it off) for the same requests."""
    on = engine(model, **{kernel: True})
    assert getattr(on.runner, kernel)
    return on.generate(reqs, sp), engine(model, **{kernel: False}).generate(reqs, sp)


def hf_logits(model, sequence):
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(torch.tensor([sequence], device=device), use_cache=False).logits[0].float()


def decision_scores(model, request, tokens, sp):
    """The scores whose argmax picked each token of `tokens`: the oracle's logits plus the request's noise."""
    logits = hf_logits(model, request.prompt_ids + tokens)[len(request.prompt_ids) - 1:-1]
    if sp.temperature == 0:
        return logits
    n, device = len(tokens), logits.device
    noise = uniform_noise(torch.full((n,), request.seed, device=device), torch.arange(n, device=device),
                          logits.shape[-1])
    return truncate_logits(logits / sp.temperature, sp.top_k, sp.top_p).double() - torch.log(-torch.log(noise))


def assert_equal_up_to_near_tie(model, reqs, got, expected, sp, tol=1e-2, share=0.6):
    """Tokens agree up to the first position where the oracle's two best scores are within `tol`."""
    compared = total = 0
    for request, a, b in zip(reqs, got, expected):
        top2 = decision_scores(model, request, b.tokens, sp).topk(2, dim=-1).values
        close = ((top2[:, 0] - top2[:, 1]) < tol).nonzero()
        j = int(close[0]) if len(close) else len(b.tokens)
        assert a.tokens[:j] == b.tokens[:j]
        if j == len(b.tokens):
            assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason)
        compared, total = compared + j, total + len(b.tokens)
    assert compared >= share * total  # the check is not vacuous
