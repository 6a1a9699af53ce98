"""Log-probs of the response tokens under a causal LM, computed from the response columns only."""

from __future__ import annotations

import torch

from caspo.algo import token_logprobs
from caspo.batch import RolloutBatch


def response_logprobs(model: torch.nn.Module, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
    """[B, R] log π(y_t | x, y_<t) with logits divided by the sampling temperature.

    The LM head runs on the R positions that score the response, not on the prompt,
    so a long prompt costs no [tokens × vocab] logits.
    """
    hidden = model.get_decoder()(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).last_hidden_state
    P, R = batch.prompt_width, batch.responses.shape[1]
    logits = model.get_output_embeddings()(hidden[:, P - 1:P + R - 1])
    return token_logprobs(logits, batch.responses, temperature=temperature)
