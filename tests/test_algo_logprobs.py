import math

import pytest
import torch

from caspo.algo import token_entropy, token_logprobs


def reference_logprobs(logits, tokens, temperature):
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def random_inputs(dtype=torch.float32, B=3, T=5, V=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(B, T, V, generator=gen)).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    return logits, tokens


def test_token_logprobs_by_hand():
    # softmax([0, ln 2, ln 3]) = [1/6, 2/6, 3/6]; doubling the logits and τ = 2 gives the same
    logits = torch.tensor([[[0.0, math.log(2), math.log(3)], [0.0, 2 * math.log(2), 2 * math.log(3)]]])
    out = token_logprobs(logits[:, :1], torch.tensor([[2]]))
    assert out.item() == pytest.approx(math.log(0.5))
    out = token_logprobs(logits[:, 1:], torch.tensor([[0]]), temperature=2.0)
    assert out.item() == pytest.approx(math.log(1 / 6))


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_token_logprobs_matches_log_softmax_and_its_gradient(chunk_size, temperature):
    logits, tokens = random_inputs()
    x = logits.clone().requires_grad_()
    ref = logits.clone().requires_grad_()
    out = token_logprobs(x, tokens, temperature=temperature, chunk_size=chunk_size)
    expected = reference_logprobs(ref, tokens, temperature)
    assert out.dtype == torch.float32 and out.shape == tokens.shape
    torch.testing.assert_close(out, expected)
    upstream = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(1))
    (g,) = torch.autograd.grad(out, x, upstream)
    (g_ref,) = torch.autograd.grad(expected, ref, upstream)
    torch.testing.assert_close(g, g_ref)


def test_token_logprobs_gradcheck_fp64():
    logits, tokens = random_inputs(torch.float64, B=2, T=3, V=5)
    logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, tokens, temperature=0.7, chunk_size=2), (logits,))


@pytest.mark.parametrize("chunk_size", [2, 1024])
def test_token_logprobs_bf16_upcasts(chunk_size):
    logits, tokens = random_inputs(torch.bfloat16)
    x = logits.clone().requires_grad_()
    out = token_logprobs(x, tokens, temperature=0.8, chunk_size=chunk_size)
    assert out.dtype == torch.float32
    # exact fp32 math on the bf16 values, not bf16 math
    torch.testing.assert_close(out, reference_logprobs(logits, tokens, 0.8), atol=1e-5, rtol=1e-5)
    (g,) = torch.autograd.grad(out.sum(), x)
    assert g.dtype == torch.bfloat16
    ref = logits.float().requires_grad_()
    (g_ref,) = torch.autograd.grad(reference_logprobs(ref, tokens, 0.8).sum(), ref)
    torch.testing.assert_close(g.float(), g_ref, atol=1e-2, rtol=1e-2)


def test_token_logprobs_keeps_no_fp32_vocab_copy_for_backward():
    logits, tokens = random_inputs(torch.bfloat16, B=4, T=8, V=64)
    logits.requires_grad_()
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(logits, tokens, chunk_size=4)
    full = logits.numel()
    assert not [s for s in saved if s[0] == torch.float32 and s[1] >= full]


def test_token_entropy():
    logits, _ = random_inputs(torch.float32)
    for temperature, chunk_size in [(1.0, 1), (0.7, 4), (1.3, 1024)]:
        p = torch.softmax(logits / temperature, dim=-1)
        expected = -(p * p.log()).sum(-1)
        torch.testing.assert_close(token_entropy(logits, temperature, chunk_size), expected)
    # uniform over 4 → ln 4; a one-hot (−inf elsewhere) → exactly 0, not nan
    special = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [5.0, -math.inf, -math.inf, -math.inf]]])
    out = token_entropy(special, chunk_size=1)
    assert out[0, 0].item() == pytest.approx(math.log(4))
    assert out[0, 1].item() == 0.0
    bf16 = token_entropy(logits.bfloat16())
    assert bf16.dtype == torch.float32


def test_invalid_arguments():
    logits, tokens = random_inputs()
    with pytest.raises(ValueError, match="temperature must be > 0, got 0.0"):
        token_logprobs(logits, tokens, temperature=0.0)
    with pytest.raises(ValueError):
        token_logprobs(logits, tokens[:, :-1])
    with pytest.raises(ValueError):
        token_entropy(logits, chunk_size=0)
