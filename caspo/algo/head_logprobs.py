"""Log-probs, entropies and KLs from hidden states and the LM head, without the ``[N, V]`` logits.

At the 1.5B shape one micro-batch of 8 × 2,048 response tokens has 2.5 GB of bf16
logits over Qwen's 151,936-token vocabulary, and autograd would keep them (and an
fp32 copy for the log-softmax) until the backward. Here the head's matmul runs
``chunk_size`` rows at a time: the forward keeps one log-normaliser per row, and
the backward recomputes each chunk's logits from the saved hidden states. When the
loss is known in the forward and each token's term reads only its own log-prob
(`head_token_loss`), each chunk's gradients are taken from the logits at hand
instead, and nothing is recomputed.

The matmul runs in the dtype of its inputs (the caller casts them to the autocast
dtype, as `nn.Linear` would be under autocast); the softmax math is fp32 (fp64 for
fp64 inputs), so values equal `token_logprobs(hidden @ weight.T, ...)` to rounding.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.autograd.function import once_differentiable


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _check(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, chunk_size: int) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and head weight ({weight.dtype}) must share a dtype")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and head weight {tuple(weight.shape)} disagree on H")


class _HeadSelectiveLogSoftmax(torch.autograd.Function):
    """z = h Wᵀ / τ;   logp_i = z_{i,a_i} − logsumexp_v z_{i,v};   H_i = logsumexp_i − Σ_v p_{i,v} z_{i,v}.

    Backward, with g_i the incoming gradient and p_i = softmax(z_i):

        ∂L/∂z_i = g_i · (onehot(a_i) − p_i)
        ∂L/∂h_i = (∂L/∂z_i) W / τ,      ∂L/∂W = Σ_i (∂L/∂z_i)ᵀ h_i / τ
    """

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, chunk_size, with_entropy, compile_backend):
        stats, _ = _chunk_functions(compile_backend)
        dtype = _softmax_dtype(hidden.dtype)
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            logp[rows], lse[rows], chunk_entropy = stats(hidden[rows] @ weight.T, tokens[rows], temperature,
                                                         with_entropy)
            if with_entropy:
                entropy[rows] = chunk_entropy
        ctx.save_for_backward(hidden, weight, tokens, lse)
        ctx.temperature, ctx.chunk_size, ctx.compile_backend = temperature, chunk_size, compile_backend
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, tokens, lse = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        _, grad_logits = _chunk_functions(ctx.compile_backend)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=lse.dtype) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            grad_z = grad_logits(hidden[rows] @ weight.T, lse[rows], tokens[rows], grad_logp[rows], temperature)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_z @ weight
            if grad_weight is not None:
                _add_weight_gradient(grad_weight, grad_z, hidden[rows])
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


class _HeadTokenLoss(torch.autograd.Function):
    """L = Σ_i ℓ_i(logp_i), a loss in which each token's term reads only its own log-prob, with its gradient
    taken in the forward, chunk by chunk, from the logits the log-probs came from.

    g_i = ∂L/∂logp_i is known once token i's chunk has its log-probs, so that chunk's z serves the products
    `_HeadSelectiveLogSoftmax.backward` would recompute it for:

        ∂L/∂z_i = g_i · (onehot(a_i) − p_i),   ∂L/∂h_i = (∂L/∂z_i) W / τ,   ∂L/∂W = Σ_i (∂L/∂z_i)ᵀ h_i / τ

    The backward scales them by the incoming gradient: one [n, H] × [H, V] product a token fewer. With a loss
    scale s (fp16) the forward takes the gradient of s·L, so that its half-precision products are those of
    a backward that receives s, and the backward divides s out of what it receives.
    """

    @staticmethod
    def forward(ctx, hidden, weight, tokens, token_loss, temperature, chunk_size, with_entropy, compile_backend,
                grad_scale):
        stats, grad_logits = _chunk_functions(compile_backend)
        dtype = _softmax_dtype(hidden.dtype)
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=dtype) if ctx.needs_input_grad[1] else None
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            logits = hidden[rows] @ weight.T
            logp[rows], lse, chunk_entropy = stats(logits, tokens[rows], temperature, with_entropy)
            if with_entropy:
                entropy[rows] = chunk_entropy
            if grad_hidden is None and grad_weight is None:
                continue
            grad_logp = _rows_gradient(token_loss, logp, rows)
            if grad_scale != 1.0:
                grad_logp = grad_logp * grad_scale
            grad_z = grad_logits(logits, lse, tokens[rows], grad_logp, temperature)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_z @ weight
            if grad_weight is not None:
                _add_weight_gradient(grad_weight, grad_z, hidden[rows])
        # kept on ctx, not saved: the backward scales them in place
        ctx.grad_hidden, ctx.grad_weight = grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype)
        ctx.grad_scale = grad_scale
        ctx.mark_non_differentiable(logp, entropy)
        return token_loss(logp).detach(), logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        grad_hidden, grad_weight = ctx.grad_hidden, ctx.grad_weight
        ctx.grad_hidden = ctx.grad_weight = None
        factor = grad_loss if ctx.grad_scale == 1.0 else grad_loss / ctx.grad_scale
        # this call's own buffers, scaled in place: no second copy of the weight's gradient
        grad_hidden = None if grad_hidden is None else grad_hidden.mul_(factor)
        grad_weight = None if grad_weight is None else grad_weight.mul_(factor)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _add_weight_gradient(grad_weight: torch.Tensor, grad_z: torch.Tensor, hidden_rows: torch.Tensor) -> None:
    """grad_weight += grad_zᵀ · hidden_rows, with grad_weight in the softmax dtype (fp32 for bf16 inputs).

    Where the GEMM can add into an fp32 matrix from half-precision inputs (CUDA's addmm with ``out_dtype``), it
    does: its fp32 accumulator goes straight into grad_weight, and no [V, H] half-precision product is written
    and read back, ~2.8 GB of traffic a chunk of rows at Qwen's vocabulary. Elsewhere the product is rounded to
    the inputs' dtype, then added."""
    if grad_z.dtype != grad_weight.dtype and _gemm_adds_into_fp32(grad_z.device, grad_z.dtype):
        torch.addmm(grad_weight, grad_z.T, hidden_rows, out_dtype=grad_weight.dtype, out=grad_weight)
    else:
        grad_weight += (grad_z.T @ hidden_rows).to(grad_weight.dtype)


@functools.cache
def _gemm_adds_into_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch's addmm, on `device`, adds a product of `dtype` matrices into an fp32 matrix in place.
    CUDA builds from 2.8 have the ``out_dtype`` overload; some of them still require the added matrix in the
    inputs' dtype, so it is tried once on a 2 × 2 case."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    total = torch.ones(2, 2, device=device)
    try:
        torch.addmm(total, torch.ones(2, 3, device=device, dtype=dtype), torch.ones(3, 2, device=device, dtype=dtype),
                    out_dtype=torch.float32, out=total)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool((total == 4).all())


def _rows_gradient(token_loss, logp: torch.Tensor, rows: slice) -> torch.Tensor:
    """∂L/∂logp at `rows` for a token-separable L = token_loss(logp) whose other rows are not known yet: they
    are set to 0, which such a loss's gradient at `rows` does not read."""
    with torch.enable_grad():
        live = torch.zeros_like(logp)
        live[rows] = logp[rows]
        live.requires_grad_()
        return torch.autograd.grad(token_loss(live), live)[0][rows]


def _chunk_stats(logits, tokens, temperature: float, with_entropy: bool):
    """(logp, logsumexp, entropy or None) of a chunk's rows from its logits [n, V], in the softmax dtype."""
    z = logits.to(_softmax_dtype(logits.dtype)) / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, tokens[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logp, lse, None
    p = torch.exp(z - lse[:, None])
    # p = 0 at -inf logits: 0·(−inf) would be nan
    return logp, lse, lse - torch.where(p > 0, p * z, torch.zeros_like(z)).sum(-1)


def _chunk_grad_logits(logits, lse, tokens, grad_logp, temperature: float, one_hot_by_compare: bool = False):
    """∂L/∂z of a chunk, g · (onehot(a) − p) / τ, in the logits' dtype. Eager, the one-hot part is a scatter
    (n entries, not n × V); compiled, a comparison with the vocabulary's indices, which fuses with the rest.
    Both add g to the same product, so the values are the same."""
    g = grad_logp[:, None].to(lse.dtype)
    probs = torch.exp(logits.to(lse.dtype) / temperature - lse[:, None])
    scaled = -probs * g
    if one_hot_by_compare:
        chosen = torch.arange(logits.shape[-1], device=logits.device) == tokens[:, None]
        grad_z = torch.where(chosen, scaled + g, scaled)
    else:
        grad_z = scaled.scatter_add_(-1, tokens[:, None], g)
    return (grad_z / temperature).to(logits.dtype)


@functools.cache
def _chunk_functions(compile_backend: str | None):
    """(stats, grad_logits) of a chunk: eager, or compiled with `compile_backend` so that each is a few fused
    kernels reading the chunk's logits once or twice, not a dozen full-vocabulary passes over fp32 copies."""
    if compile_backend is None:
        return _chunk_stats, _chunk_grad_logits
    return (_rows_dynamic(torch.compile(_chunk_stats, backend=compile_backend)),
            _rows_dynamic(torch.compile(functools.partial(_chunk_grad_logits, one_hot_by_compare=True),
                                        backend=compile_backend)))


def _rows_dynamic(compiled):
    """`compiled` with the rows (dim 0) of its tensor arguments dynamic from the first call. Left to dynamo,
    the first graph is specialised to the full chunk's rows and the first remainder compiles it again (for
    the forward and the backward); the vocabulary stays static, so the kernels keep its size."""

    @functools.wraps(compiled)
    def run(*args):
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.dim():
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        return compiled(*args)

    return run


def head_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    compile_backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log π(tokens) under softmax(hidden · weightᵀ / τ), and optionally the entropy, never all logits at once.

        logp[..., t] = z_a − logsumexp_v z_v,   H[..., t] = −Σ_v p_v log p_v,   z = h_t Wᵀ / τ,  a = tokens[..., t]

    ``hidden`` ``[..., H]``, ``weight`` ``[V, H]`` (an LM head without bias), ``tokens``
    ``[...]``. Returns (logp, entropy or None), fp32 (fp64 for fp64 inputs), shaped like
    ``tokens``. logp is differentiable with respect to ``hidden`` and ``weight``; the
    entropy carries no gradient. ``compile_backend`` (e.g. "inductor") runs each chunk's softmax math
    through ``torch.compile``; the matmuls stay as they are.
    """
    _check(hidden, weight, temperature, chunk_size)
    if hidden.shape[:-1] != tokens.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and tokens {tuple(tokens.shape)} disagree on the leading dims")
    flat = hidden.reshape(-1, hidden.shape[-1])
    logp, entropy = _HeadSelectiveLogSoftmax.apply(flat, weight, tokens.reshape(-1).long(), float(temperature),
                                                   int(chunk_size), bool(with_entropy), compile_backend)
    return logp.view(tokens.shape), entropy.view(tokens.shape) if with_entropy else None


def head_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    token_loss: Callable[[torch.Tensor], torch.Tensor],
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    compile_backend: str | None = None,
    grad_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(L, logp, entropy or None) for L = token_loss(logp), logp = `head_token_logprobs(...)`: L's value, and
    its gradient with respect to ``hidden`` and ``weight`` taken in the forward (`_HeadTokenLoss`).
    ``grad_scale``: the loss scale the backward's incoming gradient carries (fp16's), by which the forward
    scales its half-precision gradients, so that they underflow no more than a recomputing backward's.

    ``token_loss`` maps log-probs shaped like ``tokens`` to a scalar, and must be token-separable: its
    gradient at a token reads that token's log-prob only (a sum of per-token terms with weights fixed
    beforehand, as every PPO-family loss and KL estimator here is). It is called once per chunk with the
    log-probs known so far, and once more on all of them. logp and entropy carry no gradient. With
    a separable loss the gradients equal those of ``token_loss(head_token_logprobs(...)[0])``.
    """
    _check(hidden, weight, temperature, chunk_size)
    if hidden.shape[:-1] != tokens.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and tokens {tuple(tokens.shape)} disagree on the leading dims")
    flat = hidden.reshape(-1, hidden.shape[-1])
    loss, logp, entropy = _HeadTokenLoss.apply(flat, weight, tokens.reshape(-1).long(),
                                               lambda x: token_loss(x.view(tokens.shape)), float(temperature),
                                               int(chunk_size), bool(with_entropy), compile_backend,
                                               float(grad_scale))
    return loss, logp.view(tokens.shape), entropy.view(tokens.shape) if with_entropy else None


@torch.no_grad()
def head_categorical_kl(
    hidden_p: torch.Tensor,
    weight_p: torch.Tensor,
    hidden_q: torch.Tensor,
    weight_q: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """KL(p ‖ q) at every position between two heads' distributions, no gradient.

        KL_t = max(0, Σ_v p_v (log p_v − log q_v)),   p = softmax(h^p_t W_pᵀ / τ),  q = softmax(h^q_t W_qᵀ / τ)

    Tokens with p_v = 0 contribute 0. ``hidden_*`` ``[..., H]``, ``weight_*`` ``[V, H]``;
    returns ``[...]`` in fp32 (fp64 for fp64 inputs).
    """
    _check(hidden_p, weight_p, temperature, chunk_size)
    _check(hidden_q, weight_q, temperature, chunk_size)
    if hidden_p.shape != hidden_q.shape or weight_p.shape[0] != weight_q.shape[0]:
        raise ValueError(f"the two distributions disagree: hidden {tuple(hidden_p.shape)} vs {tuple(hidden_q.shape)}, "
                         f"vocabulary {weight_p.shape[0]} vs {weight_q.shape[0]}")
    flat_p, flat_q = hidden_p.reshape(-1, hidden_p.shape[-1]), hidden_q.reshape(-1, hidden_q.shape[-1])
    dtype = _softmax_dtype(torch.promote_types(hidden_p.dtype, hidden_q.dtype))
    kl = torch.empty(flat_p.shape[0], dtype=dtype, device=hidden_p.device)
    for start in range(0, flat_p.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        log_p = torch.log_softmax((flat_p[rows] @ weight_p.T).to(dtype) / temperature, dim=-1)
        log_q = torch.log_softmax((flat_q[rows] @ weight_q.T).to(dtype) / temperature, dim=-1)
        p = log_p.exp()
        kl[rows] = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1).clamp_min(0.0)
    return kl.view(hidden_p.shape[:-1])
