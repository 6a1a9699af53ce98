"""The prefix value model: cumulative log-ratios, the step-boundary indexing, transforms, save/load, provenance."""

import dataclasses
import json
import logging
import math

import pytest
import torch

from caspo.models.prefix_value import (
    PrefixValueModel,
    Provenance,
    ProvenanceError,
    cumulative_values,
    load_prefix_value,
    model_identity,
    pack_responses,
    prefix_values,
    step_values,
    transform_values,
)

PROVENANCE = Provenance(prompt_template="{query}\nSolution:\n", add_bos=False, tokenizer_hash="t:abc",
                        verifier_version="v1", temperature=1.0, top_p=1.0, top_k=0, stop_strings=(),
                        max_new_tokens=40, label_policy="w:pol")


def test_cumulative_values_are_inclusive_and_ignore_padding():
    d = torch.tensor([[1.0, 2.0, 4.0, 99.0], [0.5, -1.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    c = cumulative_values(d, mask, beta=10.0)
    assert c.tolist() == [[10.0, 30.0, 70.0, 70.0], [5.0, -5.0, -5.0, -5.0]]


def test_prefix_values_read_the_token_before_the_boundary():
    c = torch.tensor([[10.0, 30.0, 70.0]])
    # y_{<0} is the empty prefix; y_{<j} ends with token j - 1
    assert prefix_values(c, torch.tensor([[0, 1, 2, 3]])).tolist() == [[0.0, 10.0, 30.0, 70.0]]
    with pytest.raises(ValueError, match="boundaries must lie"):
        prefix_values(c, torch.tensor([[4]]))


def test_step_values_off_by_one():
    """Distinct powers of two make every misreading visible.

    Row 0: steps [0 0 | 1 1 1 | 2], d = 1, 2, 4, 8, 16, 32 (β = 1).
      V(s_0) = 0, V(s_1) = 1 + 2 = 3, V(s_2) = 1 + 2 + 4 + 8 + 16 = 31.
      One token early would give 1 and 15; one token late, 7 and 63.
    Row 1: steps [0 | 1 | 1], then padding: V = 0, 1.
    """
    d = torch.tensor([[1.0, 2.0, 4.0, 8.0, 16.0, 32.0], [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]])
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, -1, -1, -1]])
    c = cumulative_values(d, (ids >= 0).float(), beta=1.0)
    values, mask = step_values(c, ids)
    assert values.tolist() == [[0.0, 3.0, 31.0], [0.0, 1.0, 0.0]]
    assert mask.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def perturbed_value_model(tiny_model, beta=10.0):
    model = PrefixValueModel.from_reference(tiny_model, beta, PROVENANCE.with_reference(model_identity(tiny_model)))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.policy.eval()
    return model


def test_a_prefix_reads_the_same_value_as_scoring_it_alone(tiny_model):
    """V of y_{<j} read off the whole response equals β·Σ log-ratio of the prefix scored by itself."""
    model = perturbed_value_model(tiny_model)
    prompt, response = [5, 6, 7], [11, 12, 13, 14, 15, 16]
    with torch.no_grad():
        whole = model.cumulative(pack_responses([prompt, [9]], [response, [3, 4]], pad_token_id=0))
        for j in range(1, len(response) + 1):
            alone = model.cumulative(pack_responses([prompt], [response[:j]], pad_token_id=0))[0, j - 1]
            read = prefix_values(whole, torch.tensor([[j], [0]]))[0, 0]
            assert torch.allclose(read, alone, atol=1e-5), j
        assert not torch.allclose(whole[0, 2], whole[0, 3])  # neighbours differ, so the check above bites


def test_a_fresh_model_values_everything_at_zero(tiny_model):
    model = PrefixValueModel.from_reference(tiny_model)
    with torch.no_grad():
        c = model.cumulative(pack_responses([[5, 6]], [[7, 8, 9]], pad_token_id=0))
    assert torch.equal(c, torch.zeros_like(c))


def test_passed_reference_logprobs_replace_the_reference_forward(tiny_model):
    from caspo.models.forward import response_logprobs

    model = perturbed_value_model(tiny_model)
    batch = pack_responses([[5, 6], [7]], [[7, 8, 9], [4]], pad_token_id=0)
    with torch.no_grad():
        ref = response_logprobs(model.reference, batch, temperature=1.0)
        assert torch.allclose(model.log_ratios(batch, ref_logprobs=ref), model.log_ratios(batch))
        with pytest.raises(ValueError, match="ref_logprobs has shape"):
            model.log_ratios(batch, ref_logprobs=ref[:, :2])


def test_transforms():
    beta = 10.0
    v = torch.tensor([0.0, beta * math.log(3.0), -beta * math.log(3.0)])
    assert torch.equal(transform_values(v, "value", beta), v)
    assert torch.allclose(transform_values(v, "prob", beta), torch.tensor([0.5, 0.75, 0.25]))
    assert torch.allclose(transform_values(v, "logprob", beta), torch.log(torch.tensor([0.5, 0.75, 0.25])))
    with pytest.raises(ValueError, match="unknown value transform"):
        transform_values(v, "advantage", beta)


def test_save_load_round_trip(tiny_model, tmp_path):
    model = perturbed_value_model(tiny_model, beta=5.0)
    model.save(tmp_path / "v")
    config = json.loads((tmp_path / "v" / "value_config.json").read_text())
    assert config["beta"] == 5.0 and config["provenance"]["reference"] == model_identity(tiny_model)
    loaded = load_prefix_value(tmp_path / "v", model.provenance, reference=tiny_model)
    batch = pack_responses([[5, 6]], [[7, 8, 9]], pad_token_id=0)
    with torch.no_grad():
        assert torch.allclose(loaded.cumulative(batch), model.cumulative(batch))
    assert loaded.beta == 5.0 and loaded.provenance == model.provenance


def test_provenance_mismatch_lists_every_differing_field(tiny_model, tmp_path, caplog):
    model = perturbed_value_model(tiny_model)
    model.save(tmp_path / "v")
    expected = dataclasses.replace(model.provenance, verifier_version="v2", temperature=0.6)
    with pytest.raises(ProvenanceError) as err:
        load_prefix_value(tmp_path / "v", expected, reference=tiny_model)
    message = str(err.value)
    assert "verifier_version: expected 'v2', found 'v1'" in message
    assert "temperature: expected 0.6, found 1.0" in message
    assert "tokenizer_hash" not in message
    with caplog.at_level(logging.WARNING):
        load_prefix_value(tmp_path / "v", expected, allow_mismatch=True, reference=tiny_model)
    assert "verifier_version" in caplog.text


def test_a_different_reference_is_refused(tiny_model, tmp_path):
    model = perturbed_value_model(tiny_model)
    model.save(tmp_path / "v")
    with pytest.raises(ProvenanceError, match="trained against"):
        load_prefix_value(tmp_path / "v", model.provenance, reference=model.policy)


def test_saving_needs_a_reference_identity(tiny_model, tmp_path):
    with pytest.raises(ProvenanceError, match="reference identity"):
        PrefixValueModel.from_reference(tiny_model, provenance=PROVENANCE).save(tmp_path / "v")
