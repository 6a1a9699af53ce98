"""The policy loss's gradient taken in the head's forward equals the one the head's backward gives."""

import copy
import dataclasses

import pytest
import torch

from caspo.algo import AGG_MODES
from caspo.config import load_config
from caspo.methods import METHODS, get_method
from caspo.models import forward
from caspo.precision import LossScaler
from caspo.train import loop, update
from caspo.train.policy_losses import PolicyLoss
from caspo.train.update import accumulate_gradients, actor_loss, head_gradient_in_forward

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    cfg = load_config("tests", ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
                                f"train.output_dir={tmp_path_factory.mktemp('run')}"])
    tr = loop.build_trainer(cfg)
    with tr.pool:
        batch = loop.generate(tr, tr.cursor.take(4))
    generator = torch.Generator().manual_seed(0)
    scored = loop.score(tr.policy, batch, cfg)
    # old and reference log-probs off the current ones, advantages of both signs: ratios away from 1, some clipped
    batch.old_logprobs = scored + 0.3 * torch.randn(scored.shape, generator=generator)
    batch.ref_logprobs = scored - 0.05
    batch.advantages = torch.randn(scored.shape, generator=generator) * batch.response_mask
    # a frozen old policy that differs from the policy, so the divergence gate blocks some tokens
    old = copy.deepcopy(tr.policy)
    with torch.no_grad():
        for p in old.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    state = type("FrozenOld", (), {"frozen_old_policy": lambda self: old})()
    return tr, batch, state


def gradients(tr, batch, state, method, overrides: list[str], in_forward: bool):
    """The policy's gradients and metrics of one minibatch, the head's chunks 5 positions each (so that each
    micro-batch has several, and the loss's gradient is taken with most of its log-probs still at 0)."""
    cfg = load_config("tests", ["train.minibatch_size=8", "train.micro_batch_size=4", "method.kl_coef=0.1",
                                *overrides])
    saved = update.GRADIENT_IN_FORWARD, forward.LOGIT_CHUNK_TOKENS
    update.GRADIENT_IN_FORWARD, forward.LOGIT_CHUNK_TOKENS = in_forward, 5
    try:
        assert head_gradient_in_forward(method, cfg) is in_forward
        tr.policy.zero_grad(set_to_none=True)
        batch.update_ratios = torch.zeros_like(batch.response_mask)
        written = ("old_logprobs", "update_ratios") if batch.old_is_current else ("update_ratios",)  # as `update`
        metrics = accumulate_gradients(tr.policy, batch, torch.arange(8), cfg,
                                       LossScaler(cfg.train.precision, cfg.train.loss_scale),
                                       batch.responses.shape[1], actor_loss(method, state, batch.responses.shape[1]),
                                       written)
    finally:
        update.GRADIENT_IN_FORWARD, forward.LOGIT_CHUNK_TOKENS = saved
    return [p.grad.clone() for p in tr.policy.parameters()], metrics


# each token-separable loss row, by a method that uses it
SEPARABLE = {method.loss: name for name, method in reversed(METHODS.items()) if method.loss.token_separable}


@pytest.mark.parametrize("name", sorted(SEPARABLE.values()))
def test_each_loss_row_has_the_same_gradient_both_ways(rollout, name):
    tr, batch, state = rollout
    method = get_method(name)
    overrides = ["method.gate_threshold=0.001"] if method.loss.full_vocab else []
    recomputed, metrics_backward = gradients(tr, batch, state, method, overrides, in_forward=False)
    taken, metrics_forward = gradients(tr, batch, state, method, overrides, in_forward=True)
    assert max(g.abs().max() for g in recomputed) > 0
    for a, b in zip(taken, recomputed):
        assert torch.equal(a, b), name
    for a, b in zip(metrics_forward, metrics_backward):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), (name, key)
    if method.loss.full_vocab:  # the gate blocked some tokens, and not all
        assert all(0 < float(m["blocked_frac"]) < 1 for m in metrics_forward)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_every_aggregation_and_the_skipped_old_pass(rollout, mode):
    """Each loss aggregation, and π_old taken from the update's own forward (written back into the batch)."""
    tr, batch, state = rollout
    saved = batch.old_logprobs, batch.old_is_current
    results = {}
    try:
        for in_forward in (False, True):
            batch.old_is_current = True
            batch.old_logprobs = torch.full_like(saved[0], float("nan"))  # what the forwards write replaces
            results[in_forward] = (gradients(tr, batch, state, get_method("grpo"), [f"method.loss_agg={mode}"],
                                             in_forward)[0], batch.old_logprobs.clone(), batch.update_ratios.clone())
    finally:
        batch.old_logprobs, batch.old_is_current = saved
    (taken, old_taken, ratios_taken), (recomputed, old_recomputed, ratios_recomputed) = results[True], results[False]
    assert all(torch.equal(a, b) for a, b in zip(taken, recomputed)), mode
    mask = batch.response_mask.bool()
    assert torch.equal(old_taken[mask], old_recomputed[mask]) and not old_taken[mask].isnan().any()  # all written
    assert torch.equal(ratios_taken, ratios_recomputed)


def test_every_loss_row_of_the_methods_is_covered():
    assert sorted(SEPARABLE.values()) == ["dppo", "dppo_kl", "dppo_tv", "flow_dppo", "grpo"]


def test_the_backward_recomputes_for_a_loss_not_token_separable():
    sequence_level = PolicyLoss(lambda x, m: (x.logp.sum(-1).exp().mean(), {}))  # reads every token of a row
    grpo = get_method("grpo")
    cfg = load_config("tests")
    assert head_gradient_in_forward(grpo, cfg)
    assert not head_gradient_in_forward(dataclasses.replace(grpo, loss=sequence_level), cfg)


def test_under_fp16_the_gradient_taken_in_the_forward_carries_the_loss_scale(rollout):
    tr, batch, state = rollout
    grpo = get_method("grpo")
    fp16 = ["train.precision=fp16", "train.loss_scale=1024"]  # a power of two: scaled products round alike
    recomputed, _ = gradients(tr, batch, state, grpo, fp16, in_forward=False)
    taken, _ = gradients(tr, batch, state, grpo, fp16, in_forward=True)
    assert max(g.abs().max() for g in recomputed) > 0
    assert all(torch.equal(a, b) for a, b in zip(taken, recomputed))


def cuda_head_case(monkeypatch):
    """The trainer's GPU path on the tiny policy: fp32 weights, the head's chunk math through inductor, chunks of
    5 positions (several a batch). Returns (model, batch, the clipped surrogate's token loss, its mask)."""
    from test_algo_head_logprobs import clipped_surrogate
    from test_compile import tiny_batch

    from caspo.models.forward import compile_head
    from caspo.models.policy import load_policy

    monkeypatch.setattr(forward, "LOGIT_CHUNK_TOKENS", 5)
    model = load_policy("embedded:tiny-arith", "cuda")
    compile_head(model)
    batch = tiny_batch().to("cuda")
    mask = batch.response_mask.bool()
    g = torch.Generator().manual_seed(0)
    advantages = torch.randn(mask.shape, generator=g).cuda()
    old = torch.randn(mask.shape, generator=g).cuda() * 0.2 - 2.0
    return model, batch, lambda logp: clipped_surrogate(logp, advantages, old, mask)


@pytest.mark.gpu
@pytest.mark.parametrize("precision,scale", [("bf16", 1.0), ("fp16", 1024.0)])
def test_on_cuda_under_autocast_with_the_compiled_head(monkeypatch, precision, scale):
    """Under bf16 (fp16 with its loss scale) autocast over fp32 weights, with inductor's head: the same
    gradients both ways."""
    from caspo.models.forward import hidden_logprobs, hidden_token_loss, response_hidden
    from caspo.precision import autocast

    model, batch, token_loss = cuda_head_case(monkeypatch)
    runs = []
    for in_forward in (False, True):
        model.zero_grad(set_to_none=True)
        with autocast(precision, torch.device("cuda")):
            hidden = response_hidden(model, batch)
            if in_forward:
                loss, logp, _ = hidden_token_loss(model, hidden, batch.responses, token_loss, 0.7, grad_scale=scale)
            else:
                logp = hidden_logprobs(model, hidden, batch.responses, 0.7)[0]
                loss = token_loss(logp)
        (scale * loss).backward()
        runs.append((loss.detach(), logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_b, logp_b, grads_b), (loss_f, logp_f, grads_f) = runs
    assert torch.equal(logp_f, logp_b) and torch.equal(loss_f, loss_b)  # the same forward
    assert max(g.abs().max() for g in grads_b.values()) > 0
    for name, grad in grads_b.items():  # the same products, from the forward's logits instead of recomputed ones
        torch.testing.assert_close(grads_f[name], grad, atol=1e-6 * scale, rtol=1.6e-2, msg=name)


@pytest.mark.gpu
def test_on_cuda_the_head_never_waits_for_the_device(monkeypatch):
    """Chunk after chunk, the head's forward with the loss's gradient and its backward launch work without
    synchronizing with the device: a wait would idle the card while the host builds each chunk's loss graph."""
    from caspo.models.forward import hidden_token_loss, response_hidden
    from caspo.precision import autocast

    model, batch, token_loss = cuda_head_case(monkeypatch)
    for check in (False, True):  # the first call compiles the chunk math and probes the GEMM once
        with autocast("bf16", torch.device("cuda")):
            hidden = response_hidden(model, batch).detach().requires_grad_()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if check else "default")
            try:
                loss, _, _ = hidden_token_loss(model, hidden, batch.responses, token_loss, 0.7, with_entropy=True)
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert hidden.grad.abs().max() > 0


@pytest.mark.parametrize("in_forward", [False, True])
def test_a_micro_batch_whose_mean_ratio_passes_ratio_skip_adds_nothing(rollout, in_forward):
    """Upstream VinePPO's ratio_threshold: the second micro-batch (rows 4-7), its π_old 3 nats below π (mean ratio
    about e³ = 20), is dropped at ratio_skip=10 and kept at 25: the gradient is then that of the first alone,
    which equals the whole minibatch's with the second's advantages at 0 (the loss still normalised by all 8)."""
    tr, batch, state = rollout
    saved = batch.old_logprobs, batch.advantages
    grpo, no_kl = get_method("grpo"), ["method.kl_coef=0.0"]
    try:
        batch.old_logprobs = loop.score(tr.policy, batch, tr.cfg).clone()
        batch.old_logprobs[4:8] -= 3.0
        skipped, metrics = gradients(tr, batch, state, grpo, [*no_kl, "method.ratio_skip=10"], in_forward)
        kept, kept_metrics = gradients(tr, batch, state, grpo, [*no_kl, "method.ratio_skip=25"], in_forward)
        batch.advantages = batch.advantages.clone()
        batch.advantages[4:8] = 0.0
        first_alone, _ = gradients(tr, batch, state, grpo, no_kl, in_forward)
    finally:
        batch.old_logprobs, batch.advantages = saved
    assert [m["ratio_skipped"] for m in metrics] == [0.0, 1.0]
    assert [m["ratio_skipped"] for m in kept_metrics] == [0.0, 0.0]
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(skipped, first_alone))
    assert max((a - b).abs().max() for a, b in zip(kept, skipped)) > 1e-4
