"""The trainer's forward over rows shifted to column 0 (`response_states`): the padded forward's hidden states
at every response token, with attention handed to SDPA causal and without a mask."""

import pytest
import torch
from test_attention_backend import tiny
from test_compile import tiny_batch

from caspo.models.critic import critic_values
from caspo.models.forward import response_hidden, response_states
from caspo.models.looped import LoopedForCausalLM
from caspo.models.policy import tiny_looped_config


def padded_forward(decoder, batch):
    """The layout as it is: left-padded prompts, right-padded responses, a padding mask and positions."""
    hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                     position_ids=batch.position_ids, use_cache=False).last_hidden_state
    P, R = batch.prompt_width, batch.responses.shape[1]
    return hidden[:, P - 1:P + R - 1]


MODELS = {
    "qwen2": lambda: tiny().eval(),
    "looped": lambda: LoopedForCausalLM(tiny_looped_config(32, layout="ouro", depth=2, hidden=16, layers=2,
                                                           heads=2)).eval(),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_response_token_gets_the_padded_forwards_hidden_state(name):
    model = MODELS[name]()
    batch = tiny_batch()  # prompts of 5, 3 and 7 tokens, responses of 4, 6 and 2
    assert len(set(batch.attention_mask[:, :batch.prompt_width].sum(-1).tolist())) == 3
    got = response_hidden(model, batch)
    want = padded_forward(model.get_decoder(), batch)
    real = batch.response_mask.bool()
    assert got.shape == want.shape
    torch.testing.assert_close(got[real], want[real], atol=2e-6, rtol=1e-5)
    assert not torch.allclose(got[real][1:], got[real][:-1])  # distinct positions, not one row repeated


def test_gradients_reach_the_same_weights():
    """In float64: the shifted forward is longer (its length a multiple of 8), so float32 sums would differ by
    their order alone."""
    model = tiny().double()
    batch = tiny_batch()
    real = batch.response_mask.bool()
    grads = []
    for states in (response_hidden(model, batch), padded_forward(model.get_decoder(), batch)):
        model.zero_grad(set_to_none=True)
        states[real].square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-12, rtol=1e-10, msg=name)


def test_attention_is_causal_without_a_mask(monkeypatch):
    """What lets SDPA take its flash kernel on CUDA: no mask, is_causal, in every layer."""
    import transformers.integrations.sdpa_attention as sdpa

    calls, original = [], torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return original(*args, **kwargs)

    monkeypatch.setattr(sdpa.torch.nn.functional, "scaled_dot_product_attention", spy)
    model = tiny()
    response_hidden(model, tiny_batch())
    assert len(calls) == model.config.num_hidden_layers
    assert all(mask is None and causal for mask, causal in calls), calls
    calls.clear()
    padded_forward(model.get_decoder(), tiny_batch())  # the padded layout needs a mask
    assert all(mask is not None for mask, _ in calls)


def test_the_critic_reads_the_same_states():
    from transformers import AutoModelForTokenClassification

    config = tiny().config
    config.num_labels = 1
    torch.manual_seed(1)
    critic = AutoModelForTokenClassification.from_config(config, attn_implementation="sdpa").eval()
    batch = tiny_batch()
    real = batch.response_mask.bool()
    want = critic.score(padded_forward(critic.base_model, batch)).squeeze(-1)
    torch.testing.assert_close(critic_values(critic, batch)[real], want[real], atol=2e-6, rtol=1e-5)


def test_a_one_token_prompt_is_read_from_column_0():
    batch = tiny_batch().select([1], frame=(3, 6))
    batch.attention_mask[0, :2] = 0  # the prompt is now its last token alone
    batch.position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    model = tiny()
    got = response_states(model.get_decoder(), batch)
    torch.testing.assert_close(got, padded_forward(model.get_decoder(), batch), atol=2e-6, rtol=1e-5)


def test_the_forward_length_is_a_multiple_of_eight():
    """A frame of 13 columns runs as 16, one of 8 as 8: compiled blocks guard on that alignment (a graph per kind)."""
    model = tiny()
    lengths = []
    model.get_decoder().register_forward_pre_hook(lambda module, args, kwargs: lengths.append(
        kwargs["input_ids"].shape[1]), with_kwargs=True)
    batch = tiny_batch()  # 7 prompt columns + 6 response columns
    response_hidden(model, batch)
    response_hidden(model, batch.select(torch.arange(3), (7, 1)))  # a frame of 8: no extra column
    assert lengths == [16, 8]
