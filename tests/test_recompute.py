"""Activation checkpointing of every block, or of one block in n (train.activation_checkpointing_every)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from caspo.config import ConfigError, load_config
from caspo.models.policy import enable_recompute, recompute_if_asked, tiny_looped_config, tiny_qwen2_config


def four_blocks():
    torch.manual_seed(0)
    config = tiny_qwen2_config(100, hidden=32, layers=4, heads=4, kv_heads=2, intermediate=64, eos_token_id=1,
                               pad_token_id=0)
    return AutoModelForCausalLM.from_config(config).train()


def gradients_and_block_runs(model):
    """The parameters' gradients of one forward + backward, and how often each block's MLP was entered (inside the
    checkpointed forward: twice where the backward recomputes it; the recompute stops once it has what the backward
    needs, so an MLP's exit may not come again)."""
    runs = [0] * len(model.model.layers)
    for index, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda *_, index=index: runs.__setitem__(index, runs[index] + 1))
    tokens = torch.randint(2, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    model(tokens, labels=tokens).loss.backward()
    return [p.grad.clone() for p in model.parameters()], runs


@pytest.mark.parametrize("every, recomputed", [(1, [2, 2, 2, 2]), (2, [2, 1, 2, 1]), (3, [2, 1, 1, 2])])
def test_one_block_in_n_is_recomputed_and_the_gradients_do_not_change(every, recomputed):
    expected, plain_runs = gradients_and_block_runs(four_blocks())
    assert plain_runs == [1, 1, 1, 1]
    model = four_blocks()
    enable_recompute(model, every)
    got, runs = gradients_and_block_runs(model)
    assert runs == recomputed
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_the_setting_comes_from_the_train_config():
    model = four_blocks()
    recompute_if_asked(load_config("arith-tiny", ["train.activation_checkpointing=true",
                                                  "train.activation_checkpointing_every=2"]).train, model)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False, True, False]
    untouched = four_blocks()
    recompute_if_asked(load_config("arith-tiny").train, untouched)
    assert not any(layer.gradient_checkpointing for layer in untouched.model.layers)


def test_every_needs_checkpointing_on_and_a_causal_lm_with_layers():
    with pytest.raises(ConfigError, match="set that to true, or this to 1"):
        load_config("arith-tiny", ["train.activation_checkpointing_every=2"])
    with pytest.raises(ConfigError, match="activation_checkpointing_every"):
        load_config("arith-tiny", ["train.activation_checkpointing=true", "train.activation_checkpointing_every=0"])
    looped = AutoModelForCausalLM.from_config(tiny_looped_config(100, layout="ouro", depth=2, hidden=32,
                                                                 intermediate=64))
    with pytest.raises(ConfigError, match="set it to 1"):
        enable_recompute(looped, 2)
