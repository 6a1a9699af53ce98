"""CASPO's value reads: in the run's compute precision, and with the trainer's reference scores in place of
a forward of φ's reference where they are the same quantity."""

import pytest
import torch
from value_checks import batch_of, online_values

from caspo.config import load_config
from caspo.train.scoring import score
from caspo.train.step_values import ValueSource, shares_reference

REWARDS = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
GROUPS = torch.tensor([7, 7, 7, 7, 3, 3, 5, 5])


def forward_log(*models) -> list:
    """One entry per forward of any of `models`: the autocast dtype it ran under (None: autocast off)."""
    seen = []
    for model in models:
        model.get_input_embeddings().register_forward_pre_hook(lambda module, args: seen.append(
            torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None))
    return seen


@pytest.mark.parametrize("precision, dtype", [("fp32", None), ("bf16", torch.bfloat16)])
def test_the_value_reads_and_the_online_step_run_in_the_runs_compute_precision(value_model_folder, precision, dtype):
    """φ and its reference forward under train.precision's autocast, as the policy's passes (fp32: none)."""
    state = online_values(value_model_folder, f"train.precision={precision}")
    seen = forward_log(state.model.policy, state.model.reference)
    batch = batch_of(REWARDS, GROUPS)
    values, mask, _ = state.read(batch, micro_batch_size=4)
    state.online_step(batch, micro_batch_size=4)  # no reference scores kept: its reference runs again
    assert len(seen) == 8 and set(seen) == {dtype}  # 2 micro-batches × (φ, reference) × (read, online step)
    assert values.dtype == torch.float32 and mask[:, :3].sum() == 24


def test_the_trainers_reference_scores_replace_phis_reference_forward(value_model_folder):
    """φ moved off its reference: the values read with the trainer's reference scores (a copy of the base
    policy at the rollout temperature 1) equal those read with φ's own reference, which then never runs."""
    state = online_values(value_model_folder)
    assert state.shares_reference
    with torch.no_grad():
        for p in state.model.policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    batch = batch_of(REWARDS, GROUPS)
    own, mask, _ = state.read(batch, micro_batch_size=3)
    batch.ref_logprobs = score(state.model.reference, batch, state.cfg)
    calls = forward_log(state.model.reference)
    shared, shared_mask, _ = state.read(batch, micro_batch_size=3, ref_logprobs=batch.ref_logprobs)
    assert calls == [] and own.abs().max() > 1e-3  # the values are not all zero
    torch.testing.assert_close(shared, own, rtol=0, atol=1e-6)
    assert torch.equal(shared_mask, mask)


def ragged_batch():
    """batch_of's rows cut to 9, 8 and 7 tokens in turn (the last step shorter or gone), so that micro-batches
    trim to different widths."""
    batch = batch_of(REWARDS, GROUPS)
    for i in range(batch.size):
        cut = 9 - i % 3
        batch.response_mask[i, cut:] = 0
        batch.attention_mask[i, batch.prompt_width + cut:] = 0
        batch.step_ids[i, cut:] = -1
    return batch


def test_the_online_step_reuses_the_reads_reference_scores(value_model_folder):
    """The value read keeps φ's reference scores; the online step given them takes the step it takes when it
    runs the reference again (same loss, same φ after it), and the reference does not run."""
    recompute, reuse = online_values(value_model_folder), online_values(value_model_folder)
    batch = ragged_batch()
    _, _, reference = reuse.read(batch, micro_batch_size=3)
    assert reference.shape == batch.responses.shape
    assert reuse.read(batch, micro_batch_size=3, keep_reference=False)[2] is None  # a frozen φ keeps none
    plain = recompute.online_step(batch, micro_batch_size=3)
    batch.value_ref_logprobs = reference
    calls = forward_log(reuse.model.reference)
    kept = reuse.online_step(batch, micro_batch_size=3)
    assert calls == [] and kept["value_bce"] == plain["value_bce"] and plain["value_grad_norm"] > 0
    for a, b in zip(recompute.model.policy.parameters(), reuse.model.policy.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("override, source_policy", [
    ("rollout.temperature=0.7", None),  # the trainer scores at T = 0.7, φ at 1
    ("method.caspo.allow_provenance_mismatch=true", None),  # φ's reference identity was not checked
    (None, "another/policy"),  # labelled by another policy (a refresh's checkpoint) than the base
])
def test_the_reference_is_shared_only_when_it_is_the_same_quantity(value_model_folder, override, source_policy):
    state = online_values(value_model_folder)
    base = ValueSource(str(value_model_folder), state.cfg.model.policy)
    assert shares_reference(state.cfg, base, state.model)
    cfg = load_config("tests", ["method.name=caspo", f"method.caspo.value_model={value_model_folder}",
                                *([override] if override else [])])
    assert not shares_reference(cfg, ValueSource(base.path, source_policy or cfg.model.policy), state.model)


def test_the_online_step_scales_its_loss_and_skips_non_finite_gradients(value_model_folder):
    """As the update's steps: the loss times the fp16 scale, gradients divided back (the same step as fp32's
    scale of 1), and a step whose gradients are not finite is skipped and counted, φ left as it was."""
    from caspo.precision import LossScaler

    batch = batch_of(REWARDS, GROUPS)
    plain, scaled = online_values(value_model_folder), online_values(value_model_folder)
    scaler = LossScaler("fp16", 128.0)
    raw = {"plain": [], "scaled": []}  # the largest gradient entry of each backward, before unscaling
    for name, state in (("plain", plain), ("scaled", scaled)):
        for p in state.model.policy.parameters():
            p.register_hook(lambda g, name=name: raw[name].append(float(g.abs().max())))
    want, got = plain.online_step(batch, micro_batch_size=4), scaled.online_step(batch, 4, scaler=scaler)
    assert max(raw["plain"]) > 0 and max(raw["scaled"]) == pytest.approx(128.0 * max(raw["plain"]), rel=1e-5)
    assert got["value_grad_norm"] == pytest.approx(want["value_grad_norm"], rel=1e-5) and scaler.skipped_steps == 0
    for a, b in zip(plain.model.policy.parameters(), scaled.model.policy.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    before = [p.detach().clone() for p in scaled.model.policy.parameters()]
    broken = batch_of(torch.full_like(REWARDS, float("nan")), GROUPS)  # a NaN outcome: NaN gradients
    out = scaled.online_step(broken, micro_batch_size=4, scaler=scaler)
    assert "value_grad_norm" not in out and scaler.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, scaled.model.policy.parameters()))


def test_activation_checkpointing_recomputes_phis_blocks_in_its_online_step(value_model_folder):
    """train.activation_checkpointing reaches φ as it reaches the policy and the critic: its step runs each block
    again in the backward (training mode, as the critic's step), and takes the same step."""
    batch = batch_of(REWARDS, GROUPS)
    plain, recomputed = online_values(value_model_folder), online_values(value_model_folder,
                                                                         "train.activation_checkpointing=true")
    runs = {}
    for name, state in (("plain", plain), ("recomputed", recomputed)):
        runs[name] = [0]
        for layer in state.model.policy.model.layers:
            layer.mlp.register_forward_pre_hook(lambda *_, n=runs[name]: n.__setitem__(0, n[0] + 1))
    want, got = plain.online_step(batch, micro_batch_size=4), recomputed.online_step(batch, micro_batch_size=4)
    assert runs["recomputed"][0] == 2 * runs["plain"][0] > 0 and not recomputed.model.policy.training
    assert got["value_bce"] == want["value_bce"] and got["value_grad_norm"] == pytest.approx(want["value_grad_norm"])
    for a, b in zip(plain.model.policy.parameters(), recomputed.model.policy.parameters()):
        assert torch.equal(a, b)
