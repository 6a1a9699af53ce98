"""The LM-head log-probs, entropies and KLs that never build the [N, V] logits, against the full formula."""

import pytest
import torch

from caspo.algo import head_categorical_kl, head_token_logprobs, head_token_loss, token_entropy, token_logprobs


def inputs(dtype=torch.float32, B=3, T=5, H=6, V=17, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) / 2).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    return hidden, weight, tokens


def full_formula(hidden, weight, tokens, temperature):
    logp = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)
    return logp.gather(-1, tokens[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradients_equal_the_full_vocabulary_formula(chunk_size, temperature):
    hidden, weight, tokens = inputs()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, entropy = head_token_logprobs(h, w, tokens, temperature, chunk_size, with_entropy=True)
    expected, expected_entropy = full_formula(h_ref, w_ref, tokens, temperature)
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy.detach(), atol=1e-5, rtol=1e-5)
    assert not entropy.requires_grad
    upstream = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(logp, (h, w), upstream)
    expected_grads = torch.autograd.grad(expected, (h_ref, w_ref), upstream)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_chunk_math_gives_the_eager_values_and_gradients(backend):
    # aot_eager runs the same torch ops as eager (the one-hot by comparison instead of a scatter adds g to the
    # same product): equal bit for bit; inductor's generated code sums in another order
    tol = {"atol": 0.0, "rtol": 0.0} if backend == "aot_eager" else {"atol": 1e-5, "rtol": 1e-5}
    hidden, weight, tokens = inputs(B=3, T=7, V=37)
    runs = []
    for compile_backend in (None, backend):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, entropy = head_token_logprobs(h, w, tokens, 0.6, 4, with_entropy=True, compile_backend=compile_backend)
        upstream = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(1))
        runs.append((logp, entropy, *torch.autograd.grad(logp, (h, w), upstream)))
    for got, want in zip(runs[1], runs[0]):
        torch.testing.assert_close(got, want, **tol)
    expected, _ = full_formula(hidden, weight, tokens, 0.6)
    torch.testing.assert_close(runs[1][0], expected, atol=1e-5, rtol=1e-5)


def test_compiled_chunk_math_compiles_once_for_every_chunk_size():
    # a micro-batch's last chunk has fewer rows than the others: it must reuse the graph, not compile again
    torch._dynamo.reset()
    hidden, weight, tokens = inputs(B=2, T=7, V=37)  # 14 rows: chunks of 4, 4, 4 and 2
    with torch._dynamo.config.patch(error_on_recompile=True):
        for rows in (14, 11, 7):  # last chunks of 2, 3 and 3 rows
            h = hidden.reshape(-1, 6)[:rows].clone().requires_grad_()
            logp, _ = head_token_logprobs(h, weight, tokens.reshape(-1)[:rows], 0.6, 4, compile_backend="aot_eager")
            logp.sum().backward()
            assert torch.isfinite(h.grad).all()


def test_gradcheck_fp64():
    hidden, weight, tokens = inputs(torch.float64, B=2, T=3, H=4, V=5)
    hidden.requires_grad_(), weight.requires_grad_()
    assert torch.autograd.gradcheck(lambda h, w: head_token_logprobs(h, w, tokens, 0.7, 2)[0], (hidden, weight))


def test_bf16_equals_the_bf16_head_then_the_chunked_log_softmax():
    # what the update computed before: bf16 logits from nn.Linear, then token_logprobs in fp32
    hidden, weight, tokens = inputs(torch.bfloat16, V=64)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, _ = head_token_logprobs(h, w, tokens, 0.8, chunk_size=4)
    before = token_logprobs(h_ref @ w_ref.T, tokens, temperature=0.8)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, before, atol=1e-6, rtol=0)
    grads = torch.autograd.grad(logp.sum(), (h, w))
    grads_before = torch.autograd.grad(before.sum(), (h_ref, w_ref))
    for got, want in zip(grads, grads_before):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def clipped_surrogate(logp, advantages, old, mask):
    """A PPO-clip loss, token-mean over the mask: each token's term reads its own log-prob only."""
    ratio = torch.exp(torch.clamp(logp - old, -20, 20))
    per_token = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))
    return torch.where(mask, per_token, 0.0).sum() / mask.sum()


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
@pytest.mark.parametrize("dtype,backend", [(torch.float32, None), (torch.float64, None), (torch.bfloat16, None),
                                           (torch.float32, "aot_eager")])
def test_a_token_separable_loss_has_the_same_gradient_taken_in_the_forward(chunk_size, dtype, backend):
    hidden, weight, tokens = inputs(dtype, B=3, T=7, V=37)
    gen = torch.Generator().manual_seed(2)
    advantages, old = torch.randn(tokens.shape, generator=gen), torch.randn(tokens.shape, generator=gen) - 3.5
    mask = torch.rand(tokens.shape, generator=gen) > 0.25
    runs = []
    for in_forward in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if in_forward:
            loss, logp, entropy = head_token_loss(h, w, tokens, lambda x: clipped_surrogate(x, advantages, old, mask),
                                                  0.6, chunk_size, with_entropy=True, compile_backend=backend)
            assert not logp.requires_grad and not entropy.requires_grad
        else:
            logp, entropy = head_token_logprobs(h, w, tokens, 0.6, chunk_size, with_entropy=True,
                                                compile_backend=backend)
            loss = clipped_surrogate(logp, advantages, old, mask)
        # an incoming gradient of 2 (a power of two: scaling the products before or after them rounds alike)
        runs.append((loss.detach(), logp.detach(), entropy, *torch.autograd.grad(2.0 * loss, (h, w))))
    assert runs[0][3].abs().max() > 0
    for got, want in zip(runs[1], runs[0]):  # the same operations on the same numbers: equal bit for bit
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_under_a_loss_scale_the_forward_takes_the_gradient_a_scaled_backward_would():
    # fp16 with advantages so small that ∂L/∂z underflows in fp16 unless the loss scale is in it
    hidden, weight, tokens = inputs(torch.float16, B=3, T=7, V=37)
    advantages = 1e-6 * torch.randn(tokens.shape, generator=torch.Generator().manual_seed(2))
    scale = 1024.0

    def surrogate(logp):  # REINFORCE's term, token-mean: no clip zeroes a token's gradient
        return -(advantages * logp).mean()

    def scaled_gradients(way):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if way == "backward":
            loss = surrogate(head_token_logprobs(h, w, tokens, 0.6, 4)[0])
        else:
            loss = head_token_loss(h, w, tokens, surrogate, 0.6, 4, grad_scale=scale if way == "forward" else 1.0)[0]
        return torch.autograd.grad(scale * loss, (h, w))

    recomputed, taken, unscaled = (scaled_gradients(way) for way in ("backward", "forward", "forward unscaled"))
    assert (recomputed[0] != 0).float().mean() > 0.9
    for got, want in zip(taken, recomputed):  # a power-of-two scale: the same roundings, bit for bit
        assert torch.equal(got, want)
    # unscaled, ∂L/∂z falls among fp16's subnormals (below 6.1e-5), coarsely rounded: the hidden states' gradient is off
    error = (unscaled[0].float() - recomputed[0].float()).abs().max()
    assert error > 0.25 * recomputed[0].float().abs().max()


def test_a_loss_that_reads_other_tokens_needs_the_backward():
    # a sequence-level ratio: a token's gradient reads its row's other log-probs, which the forward does not
    # know yet when it takes the token's chunk (they stand at 0 there), so the two ways differ
    hidden, weight, tokens = inputs()

    def sequence_level(logp):
        return logp.mean(-1).exp().sum()

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = torch.autograd.grad(sequence_level(head_token_logprobs(h, w, tokens, 1.0, 2)[0]), h)[0]
    loss, _, _ = head_token_loss(h, w, tokens, sequence_level, 1.0, 2)
    torch.testing.assert_close(loss, sequence_level(head_token_logprobs(h, w, tokens, 1.0, 2)[0]).detach())
    assert not torch.allclose(torch.autograd.grad(loss, h)[0], expected, atol=1e-3)


def test_keeps_no_logits_sized_tensor_for_backward():
    hidden, weight, tokens = inputs(torch.float32, B=4, T=16, H=8, V=512)
    hidden.requires_grad_(), weight.requires_grad_()
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        head_token_logprobs(hidden, weight, tokens, chunk_size=8)
    assert saved and max(saved) <= weight.numel()  # hidden, weight, tokens and one normaliser per row
    assert max(saved) < tokens.numel() * weight.shape[0]


def test_categorical_kl_equals_the_formula_and_is_zero_for_equal_heads():
    hidden_p, weight_p, _ = inputs(seed=0)
    hidden_q, weight_q, _ = inputs(seed=1)
    log_p = torch.log_softmax(hidden_p @ weight_p.T / 0.9, -1)
    log_q = torch.log_softmax(hidden_q @ weight_q.T / 0.9, -1)
    expected = (log_p.exp() * (log_p - log_q)).sum(-1)
    kl = head_categorical_kl(hidden_p, weight_p, hidden_q, weight_q, 0.9, chunk_size=4)
    torch.testing.assert_close(kl, expected, atol=1e-6, rtol=1e-5)
    assert (kl > 0).all()
    assert head_categorical_kl(hidden_p, weight_p, hidden_p, weight_p).abs().max() == 0


def test_entropy_matches_token_entropy_with_minus_inf_logits():
    # a head row of -inf logits (a banned token) contributes 0, not nan
    hidden = torch.tensor([[1.0, 0.2], [0.5, 0.5]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-float("inf"), -float("inf")]])
    _, entropy = head_token_logprobs(hidden, weight, torch.tensor([0, 1]), with_entropy=True)
    torch.testing.assert_close(entropy, token_entropy(hidden @ weight.T))
    assert torch.isfinite(entropy).all()


def test_bad_arguments_are_named():
    hidden, weight, tokens = inputs()
    with pytest.raises(ValueError, match="share a dtype"):
        head_token_logprobs(hidden.double(), weight, tokens)
    with pytest.raises(ValueError, match="disagree on H"):
        head_token_logprobs(hidden[..., :3], weight, tokens)
    with pytest.raises(ValueError, match="leading dims"):
        head_token_logprobs(hidden, weight, tokens[:, :2])
    with pytest.raises(ValueError, match="temperature"):
        head_token_logprobs(hidden, weight, tokens, temperature=0.0)


@pytest.mark.gpu
def test_on_cuda_the_head_adds_its_weight_gradient_into_fp32_inside_the_gemm():
    """bf16 on CUDA: each chunk's ∂L/∂W is added to the fp32 total by the GEMM (addmm's out_dtype form) rather
    than rounded to bf16 first, so the total equals the sum of the chunks' exact products to fp32 rounding."""
    from caspo.algo.head_logprobs import _chunk_grad_logits, _chunk_stats, _gemm_adds_into_fp32

    if not hasattr(torch.ops.aten.addmm, "dtype_out"):
        pytest.skip(f"torch {torch.__version__} has no addmm with out_dtype (from 2.8)")
    device = torch.device("cuda")
    assert _gemm_adds_into_fp32(device, torch.bfloat16), f"torch {torch.__version__}'s CUDA addmm refuses out_dtype"
    hidden, weight, tokens = (t.to(device) for t in inputs(torch.bfloat16, B=4, T=64, H=32, V=512))
    w = weight.clone().requires_grad_()
    logp, _ = head_token_logprobs(hidden, w, tokens, 0.8, chunk_size=16)
    (grad_weight,) = torch.autograd.grad(logp.sum(), (w,))
    # the head's own per-chunk ∂L/∂z (bf16), their products summed in float64
    h, flat, z_grads = hidden.reshape(-1, 32), tokens.reshape(-1), []
    for start in range(0, h.shape[0], 16):
        logits, rows = h[start:start + 16] @ weight.T, flat[start:start + 16]
        lse = _chunk_stats(logits, rows, 0.8, False)[1]
        z_grads.append(_chunk_grad_logits(logits, lse, rows, torch.ones_like(lse), 0.8))
    exact = torch.cat(z_grads).double().T @ h.double()
    # one bf16 rounding at the end (the gradient's dtype), none per chunk
    torch.testing.assert_close(grad_weight, exact.to(torch.bfloat16), atol=0, rtol=2 ** -7)
