"""The update's minibatches: gradients do not depend on how one is split into micro-batches; Dr. GRPO's
normaliser; VinePPO's whitening minibatch by minibatch."""

import pytest
import torch

from caspo import algo
from caspo.algo import AGG_MODES
from caspo.config import ConfigError, load_config
from caspo.methods import get_method, resolve_method
from caspo.precision import LossScaler
from caspo.train import loop
from caspo.train import update as update_module
from caspo.train.advantages import compute_advantages, minibatch_advantages
from caspo.train.update import accumulate_gradients, actor_loss, update

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    cfg = load_config("tests", ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
                                f"train.output_dir={tmp_path_factory.mktemp('run')}", "method.kl_coef=0.1"])
    tr = loop.build_trainer(cfg)
    with tr.pool:
        batch = loop.generate(tr, tr.cursor.take(4))
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    batch.old_logprobs = loop.score(tr.policy, batch, cfg)
    batch.ref_logprobs = batch.old_logprobs - 0.05  # a non-trivial KL term
    batch.advantages = compute_advantages(batch, cfg, get_method(cfg.method.name))[0]
    assert len(set(batch.response_lengths.tolist())) > 1  # ragged, so the normaliser matters
    return tr, batch


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gradients_agree_across_micro_batch_splits(rollout, mode):
    tr, batch = rollout
    grads = {}
    # (rows, tokens): row chunks, and micro-batches packed by length under a token budget
    for micro in ((8, 0), (4, 0), (1, 0), (8, 60), (8, 1)):
        cfg = load_config("tests", ["train.minibatch_size=8", f"train.micro_batch_size={micro[0]}",
                                    f"train.micro_batch_tokens={micro[1]}", f"method.loss_agg={mode}",
                                    "method.kl_coef=0.1"])
        tr.policy.zero_grad(set_to_none=True)
        accumulate_gradients(tr.policy, batch, torch.arange(8), cfg, LossScaler("fp32"), batch.responses.shape[1],
                             actor_loss(tr.method, tr.method_state, batch.responses.shape[1]))
        grads[micro] = torch.cat([p.grad.flatten() for p in tr.policy.parameters()])
    assert grads[8, 0].abs().max() > 0
    for micro in ((4, 0), (1, 0), (8, 60), (8, 1)):
        assert torch.allclose(grads[micro], grads[8, 0], atol=1e-6, rtol=0), (mode, micro)


def grads_of(tr, batch, cfg, micro: int = 8) -> torch.Tensor:
    cfg.train.micro_batch_size = micro
    tr.policy.zero_grad(set_to_none=True)
    accumulate_gradients(tr.policy, batch, torch.arange(8), cfg, LossScaler("fp32"), batch.responses.shape[1],
                         actor_loss(tr.method, tr.method_state, batch.responses.shape[1]))
    return torch.cat([p.grad.flatten() for p in tr.policy.parameters()])


def test_the_kl_term_sums_each_response_under_seq_mean_token_sum(rollout):
    """method.kl_loss_agg=seq-mean-token-sum (upstream VinePPO's KL loss): coef · (1/B) Σ_i Σ_t k3, beside a
    token-mean policy loss; the gradient it adds is that term's, and it does not depend on the micro-batches."""
    tr, batch = rollout
    common = ["train.minibatch_size=8", "method.kl_coef=0.1", "method.loss_agg=token-mean"]
    token_mean = grads_of(tr, batch, load_config("tests", common))
    seq_cfg = load_config("tests", [*common, "method.kl_loss_agg=seq-mean-token-sum"])
    seq_sum = grads_of(tr, batch, seq_cfg)
    assert torch.allclose(grads_of(tr, batch, seq_cfg, micro=3), seq_sum, atol=1e-6, rtol=0)
    # the difference by hand: k3 = e^(ref − logp) − (ref − logp) − 1 over the response tokens
    from caspo.models.forward import hidden_logprobs, response_hidden

    tr.policy.zero_grad(set_to_none=True)
    logp, _ = hidden_logprobs(tr.policy, response_hidden(tr.policy, batch), batch.responses, 1.0)
    d = batch.ref_logprobs - logp
    mask = batch.response_mask.bool()
    k3 = torch.where(mask, d.exp() - d - 1, torch.zeros_like(d))
    rows, tokens = int(mask.any(-1).sum()), int(mask.sum())
    (0.1 * (k3.sum() / rows - k3.sum() / tokens)).backward()
    expected = torch.cat([p.grad.flatten() for p in tr.policy.parameters()])
    assert expected.abs().max() > 1e-4  # tokens > rows: the two normalisers differ
    assert torch.allclose(seq_sum - token_mean, expected, atol=1e-6, rtol=1e-4)


def test_no_grad_passes_take_their_own_micro_batches(rollout):
    """train.score_micro_batch_size / _tokens set the scoring forwards' micro-batches (0: the update's), and the
    log-probs do not depend on them."""
    tr, batch = rollout
    decoder = tr.policy.get_decoder()
    seen = []
    hook = decoder.register_forward_hook(lambda module, args, kwargs, out: seen.append(kwargs["input_ids"].shape[0]),
                                         with_kwargs=True)
    scores = {}
    try:
        for knobs in (("2", "0", "0", "0"), ("2", "0", "8", "0"), ("2", "0", "0", "40"), ("8", "40", "1", "0")):
            cfg = load_config("tests", ["train.minibatch_size=8", f"train.micro_batch_size={knobs[0]}",
                                        f"train.micro_batch_tokens={knobs[1]}",
                                        f"train.score_micro_batch_size={knobs[2]}",
                                        f"train.score_micro_batch_tokens={knobs[3]}"])
            seen.clear()
            scores[knobs] = loop.score(tr.policy, batch, cfg)
            scores[knobs, "rows"] = list(seen)
    finally:
        hook.remove()
    assert scores[("2", "0", "0", "0"), "rows"] == [2, 2, 2, 2]  # the update's micro-batches
    assert scores[("2", "0", "8", "0"), "rows"] == [8]  # its own rows
    assert scores[("8", "40", "1", "0"), "rows"] == [1] * 8  # its own rows; the update's token budget kept
    packed = [len(idx) for idx, _ in batch.micro_batches(2, max_tokens=40)]  # rows 2, its own token budget
    assert scores[("2", "0", "0", "40"), "rows"] == packed != [2, 2, 2, 2]
    mask = batch.response_mask.bool()
    for knobs in (("2", "0", "8", "0"), ("2", "0", "0", "40"), ("8", "40", "1", "0")):
        assert torch.allclose(scores[knobs][mask], scores["2", "0", "0", "0"][mask], atol=1e-5, rtol=0), knobs


def test_dr_grpo_normaliser_is_the_generation_budget(rollout, monkeypatch):
    """seq-mean-token-sum-norm divides by B'·rollout.max_new_tokens (Dr. GRPO's constant), not by the batch's
    longest response, which moves from step to step. Runs after the gradient tests: it steps the shared policy."""
    tr, batch = rollout
    cfg = load_config("tests", ["train.minibatch_size=8", "method.loss_agg=seq-mean-token-sum-norm",
                                "method.kl_coef=0.1"])
    assert batch.responses.shape[1] < cfg.rollout.max_new_tokens  # else the two lengths coincide
    lengths, counts_of = [], algo.Counts.of

    def recording(mask, norm_len=None):
        counts = counts_of(mask, norm_len)
        lengths.append(counts.norm_len)
        return counts

    monkeypatch.setattr(algo.Counts, "of", recording)
    update(tr.actor, batch, cfg, tr.method, tr.method_state, torch.Generator().manual_seed(0), LossScaler("fp32"))
    assert lengths and set(lengths) == {cfg.rollout.max_new_tokens}


def test_minibatch_advantages_whiten_and_clip_only_the_minibatchs_rows():
    adv = torch.tensor([[1.0, 2.0, 9.0], [3.0, 0.0, 0.0], [5.0, 7.0, 0.0], [4.0, 4.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rows = torch.tensor([2, 0, 1])
    out = minibatch_advantages(adv, mask, rows, k=0.0)
    # the rows' valid tokens 1, 2, 3, 5, 7: mean 3.6, unbiased variance 5.8
    expected = (torch.tensor([1.0, 2.0, 3.0, 5.0, 7.0]) - 3.6) / (5.8 + 1e-8) ** 0.5
    got = torch.cat([out[0, :2], out[1, :1], out[2, :2]])
    assert torch.allclose(got, expected, atol=1e-6)
    assert out[0, 2] == 0 and out[2, 2] == 0  # padding
    assert torch.equal(out[3], adv[3])  # a row outside the minibatch is untouched
    clipped = minibatch_advantages(adv, mask, rows, k=1.0)
    assert torch.allclose(clipped[2, 1], torch.tensor(1.0)) and clipped[2, 1] < out[2, 1]  # 7 → 1.418 σ → 1


def test_minibatch_scope_is_vineppos_alone():
    resolve_method(load_config("tests", ["method.name=vineppo", "method.step_adv_scope=minibatch"]))
    for name in ("caspo", "grpo"):
        cfg = load_config("tests", [f"method.name={name}", "method.step_adv_scope=minibatch",
                                    "method.caspo.value_model=/nonexistent"])
        with pytest.raises(ConfigError, match="step_adv_scope"):
            resolve_method(cfg)


@pytest.mark.parametrize("row, setting", [("vineppo", "step_adv_scope"), ("ppo_critic", "adv_whiten"),
                                          ("grpo", "adv_whiten")])
def test_the_update_reads_each_minibatchs_own_whitening(rollout, monkeypatch, row, setting):
    """Every optimizer step reads the advantages whitened over its own rows (each epoch anew), and the batch
    keeps its raw advantages after the update: VinePPO's step_adv_scope=minibatch, and adv_whiten=minibatch (its PPO
    baseline's). Runs after the gradient tests: it steps the shared policy."""
    tr, batch = rollout
    cfg = load_config("tests", ["train.minibatch_size=4", "train.epochs_per_rollout=2", "method.adv_clip=2"])
    setattr(cfg.method, setting, "minibatch")  # on this grpo batch's advantages
    raw = batch.advantages.clone()
    seen, accumulate = [], update_module.accumulate_gradients

    def recording(model, b, rows, *args, **kwargs):
        seen.append((rows.clone(), b.advantages.clone()))
        return accumulate(model, b, rows, *args, **kwargs)

    monkeypatch.setattr(update_module, "accumulate_gradients", recording)
    update(tr.actor, batch, cfg, get_method(row), tr.method_state, torch.Generator().manual_seed(0),
           LossScaler("fp32"))
    assert len(seen) == 4  # two epochs of two minibatches
    for rows, read in seen:
        assert torch.equal(read, minibatch_advantages(raw, batch.response_mask, rows, 2.0))
        assert not torch.equal(read[rows], raw[rows])
    assert {tuple(sorted(r.tolist())) for r, _ in seen[:2]} != {tuple(sorted(r.tolist())) for r, _ in seen[2:]}
    assert torch.equal(batch.advantages, raw)


def test_an_updates_extremes_are_over_all_its_tokens_not_a_mean_of_micro_batches():
    from caspo.train.update import UpdateStats

    stats = UpdateStats()
    stats.minibatches = 1
    stats.add([{"tokens": torch.tensor(3.0), "iw_min": 0.5, "iw_max": 2.0, "iw_mean": 1.0},
               {"tokens": torch.tensor(1.0), "iw_min": 0.3, "iw_max": 1.5, "iw_mean": 2.0},
               {"tokens": torch.tensor(0.0), "iw_min": 0.0, "iw_max": 0.0, "iw_mean": 0.0}])  # no tokens: no extreme
    out = stats.result()
    assert (out["iw_min"], out["iw_max"]) == (0.3, 2.0)
    assert out["iw_mean"] == pytest.approx((3 * 1.0 + 2.0) / 4)
