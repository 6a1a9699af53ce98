"""Log-probs and logits of the response tokens, computed from the response columns only."""

from __future__ import annotations

import torch

from caspo.algo import token_logprobs
from caspo.batch import RolloutBatch


def response_logits(model: torch.nn.Module, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
    """[B, R, V] logits / temperature at the positions that predict each response token.

    The LM head runs on these R positions only, so a long prompt costs no
    [tokens × vocab] logits.
    """
    hidden = model.get_decoder()(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).last_hidden_state
    P, R = batch.prompt_width, batch.responses.shape[1]
    return model.get_output_embeddings()(hidden[:, P - 1:P + R - 1]) / temperature


def response_logprobs(model: torch.nn.Module, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
    """[B, R] log π(y_t | x, y_<t) under softmax(logits / temperature), via a chunked log-softmax."""
    return token_logprobs(response_logits(model, batch), batch.responses, temperature=temperature)
