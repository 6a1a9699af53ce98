"""Log-probs of the response tokens, from the response columns only and without the full logits.

The decoder runs on the whole sequence; the LM head runs on the R positions that
predict response tokens, chunk by chunk (`caspo.algo.head_token_logprobs`), so
neither a long prompt nor a 150k vocabulary costs a ``[tokens × vocab]`` tensor.
"""

from __future__ import annotations

from typing import Callable

import torch

from caspo.algo import head_categorical_kl, head_token_logprobs, head_token_loss
from caspo.batch import RolloutBatch

LOGIT_CHUNK_TOKENS = 1024  # rows of logits alive at once: 1024 × 151,936 × 4 B = 622 MB in fp32
_HEAD_BACKEND = "_caspo_head_compile_backend"  # set on a model by `compile_head`


def compile_head(model: torch.nn.Module, backend: str = "inductor") -> None:
    """Run the softmax math of `model`'s chunked head (`hidden_logprobs`) through torch.compile with `backend`."""
    setattr(model, _HEAD_BACKEND, backend)


def head_compile_backend(model: torch.nn.Module) -> str | None:
    """The backend `compile_head` set on `model`, None if its head's math runs eagerly."""
    return getattr(model, _HEAD_BACKEND, None)


FORWARD_LENGTH_MULTIPLE = 8


def response_states(decoder: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
    """[B, R, H]: `decoder`'s last hidden states at the positions that predict each response token.

    The batch's rows are a left-padded prompt, then a right-padded response. Each row runs shifted left by its
    prompt's padding, so that its tokens fill columns 0, 1, ... and every pad comes after them. A causal
    forward without a mask then gives each real token the keys and the positions it has in the padded layout:
    no real token attends to a later column. Without a mask, PyTorch's SDPA may take its flash kernel, where a
    padding mask leaves it the memory-efficient one alone.

    The forward's length is the frame's rounded up to a multiple of FORWARD_LENGTH_MULTIPLE; the extra columns
    take the row's first tokens again and, like the pads, come after every real token. Compiled blocks guard on
    that alignment (inductor's, for the attention's per-head buffers), so lengths of both kinds would each
    build a graph, and a run would compile again mid-way whenever a micro-batch brought the other kind.
    """
    P, R, width = batch.prompt_width, batch.responses.shape[1], batch.input_ids.shape[1]
    length = -(-width // FORWARD_LENGTH_MULTIPLE) * FORWARD_LENGTH_MULTIPLE
    columns = torch.arange(length, device=batch.input_ids.device)
    prompt_lengths = batch.attention_mask[:, :P].sum(-1, keepdim=True)
    shifted = batch.input_ids.gather(1, (columns + P - prompt_lengths) % width)
    hidden = decoder(input_ids=shifted, use_cache=False).last_hidden_state
    predicting = prompt_lengths - 1 + columns[:R]  # the prompt's last token predicts the response's first
    return hidden.gather(1, predicting[..., None].expand(-1, -1, hidden.shape[-1]))


def response_hidden(model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
    """[B, R, H] last hidden states of a causal LM at the positions that predict each response token."""
    return response_states(model.get_decoder(), batch)


def head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The weight of `model`'s LM head (a bias-free nn.Linear, tied or not)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise TypeError(f"{type(model).__name__}'s output head is {head!r}; log-probs need a bias-free nn.Linear")
    return head.weight


def as_compute(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in the autocast dtype when autocast is on (what the head's matmul would run in)."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return tuple(t.to(dtype) for t in tensors)
    dtype = torch.promote_types(tensors[0].dtype, tensors[1].dtype)
    return tuple(t.to(dtype) for t in tensors)


def hidden_logprobs(model: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log π(tokens), entropy or None) from `hidden` [B, R, H] through `model`'s head, chunked."""
    hidden, weight = as_compute(hidden, head_weight(model))
    return head_token_logprobs(hidden, weight, tokens, temperature, LOGIT_CHUNK_TOKENS, with_entropy,
                               compile_backend=head_compile_backend(model))


def hidden_token_loss(model: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor,
                      token_loss: Callable[[torch.Tensor], torch.Tensor], temperature: float = 1.0,
                      with_entropy: bool = False, grad_scale: float = 1.0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(token_loss(logp), logp, entropy or None) through `model`'s head, chunked, the loss's gradient taken in the
    forward (`caspo.algo.head_token_loss`: token_loss must be token-separable; `grad_scale`: the loss scale)."""
    hidden, weight = as_compute(hidden, head_weight(model))
    return head_token_loss(hidden, weight, tokens, token_loss, temperature, LOGIT_CHUNK_TOKENS, with_entropy,
                           compile_backend=head_compile_backend(model), grad_scale=grad_scale)


def response_logprobs(model: torch.nn.Module, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
    """[B, R] log π(y_t | x, y_<t) under softmax(logits / temperature)."""
    return hidden_logprobs(model, response_hidden(model, batch), batch.responses, temperature)[0]


@torch.no_grad()
def hidden_kl(p_model: torch.nn.Module, p_hidden: torch.Tensor, q_model: torch.nn.Module, q_hidden: torch.Tensor,
              temperature: float = 1.0) -> torch.Tensor:
    """[B, R] KL(p ‖ q) over the whole vocabulary between two models' next-token distributions, chunked."""
    p_hidden, p_weight = as_compute(p_hidden, head_weight(p_model))
    q_hidden, q_weight = as_compute(q_hidden, head_weight(q_model))
    return head_categorical_kl(p_hidden, p_weight, q_hidden, q_weight, temperature, LOGIT_CHUNK_TOKENS)
