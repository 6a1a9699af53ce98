"""The critic trains with its own AdamW settings: lr, weight decay and gradient clip apart from the policy's."""

import pytest
import torch

from caspo.config import ConfigError, MethodConfig, load_config
from caspo.models.policy import load_policy, resolve_model_path
from caspo.precision import LossScaler
from caspo.train.critic import Critic
from caspo.train.optim import learner
from caspo.train.update import optimizer_step


def test_the_seed_critic_defaults():
    # the seed's PPO+critic recipe: critic_lr=1e-6, critic_weight_decay=0.0, critic_grad_clip=1.0
    m = MethodConfig()
    assert (m.critic_lr, m.critic_weight_decay, m.critic_grad_clip) == (1e-6, 0.0, 1.0)


@pytest.fixture(scope="module")
def cfg():
    return load_config("tests", ["method.name=ppo_critic", "optim.lr=3e-4", "optim.weight_decay=0.1",
                                 "optim.grad_clip=1.0", "method.critic_lr=2e-5", "method.critic_weight_decay=0.0",
                                 "method.critic_grad_clip=0.25"])


@pytest.fixture(scope="module")
def critic(cfg):
    return Critic(cfg, resolve_model_path(cfg.model.policy), torch.device("cpu")).learners["critic"]


def test_critic_and_policy_optimizers_are_configured_apart(cfg, critic):
    policy = learner(load_policy(cfg.model.policy), cfg)
    (critic_group,), (policy_group,) = critic.optimizer.param_groups, policy.optimizer.param_groups
    assert (critic_group["lr"], critic_group["weight_decay"], critic.grad_clip) == (2e-5, 0.0, 0.25)
    assert (policy_group["lr"], policy_group["weight_decay"], policy.grad_clip) == (3e-4, 0.1, 1.0)
    assert critic_group["betas"] == policy_group["betas"] == (0.9, 0.999)  # the rest is optim.*


def test_a_huge_critic_loss_is_clipped_at_the_critic_clip(critic):
    model = critic.model
    model.zero_grad(set_to_none=True)
    loss = 1e6 * model(input_ids=torch.tensor([[3, 4, 5, 6, 7]])).logits.sum()
    loss.backward()
    before = optimizer_step(critic, LossScaler("fp32"))
    after = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    assert before > 1e3  # the norm before clipping, as the run log reports it
    # clipped to the critic's 0.25, not the policy's 1.0 (clip_grad_norm_ scales by c / (norm + 1e-6))
    assert 0.25 * (1 - 1e-6) <= float(after) <= 0.25


def test_no_learner_holds_gradients_after_an_outer_step(tmp_path):
    """Gradients are freed once applied: the rollout and scoring phases of the next step have that memory."""
    from caspo.train import loop

    tr = loop.build_trainer(load_config("tests", [
        "method.name=ppo_critic", f"train.output_dir={tmp_path}", "train.minibatch_size=4",
        "train.micro_batch_size=2", "eval.before=false", "eval.after=false"]))
    with tr.pool:
        loop.outer_step(tr)
    critic = tr.method_state.learners["critic"]
    assert tr.step == 1 and critic.optimizer.state  # both optimizers stepped...
    for model in (tr.actor.model, critic.model):
        assert all(p.grad is None for p in model.parameters())  # ...and hold no gradient after


def learning_rates(cfg, updates: int) -> list[float]:
    """The policy learner's rate at each of its first `updates` optimizer steps."""
    sched = learner(torch.nn.Linear(2, 2), cfg).scheduler
    lrs = []
    for _ in range(updates):
        lrs.append(sched.get_last_lr()[0])
        sched.optimizer.step()
        sched.step()
    return lrs


def test_warmup_as_a_ratio_of_the_runs_updates_then_linear_decay():
    # tests preset: 8 responses a step, minibatch 4 (2 updates an epoch); 50 steps × 2 epochs = 200 updates
    cfg = load_config("tests", ["train.steps=50", "train.epochs_per_rollout=2", "optim.warmup_ratio=0.03",
                                "optim.schedule=linear", "optim.lr=1.0"])
    assert cfg.responses_per_step // cfg.train.minibatch_size == 2
    lrs = learning_rates(cfg, 200)
    # ceil(0.03 × 200) = 6 warmup updates at 1/6 ... 6/6, then linear decay over the other 194, to 0 at update 200
    assert lrs[:8] == pytest.approx([1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0, 1.0, 1 - 1 / 194])
    assert lrs[-1] == pytest.approx(1 / 194)
    with pytest.raises(ConfigError, match="optim.warmup_steps=5 and optim.warmup_ratio=0.03 both set the warmup"):
        load_config("tests", ["optim.warmup_steps=5", "optim.warmup_ratio=0.03"])


def test_a_log_shaped_warmup_is_deepspeeds_warmup_decay():
    """optim.warmup_shape=log: DeepSpeed WarmupDecayLR's default warmup, lr · log(k + 1) / log(W) at update k
    (0 at the first), then its linear decay (T − k) / (T − W): here W = 6, T = 200, by hand."""
    cfg = load_config("tests", ["train.steps=50", "train.epochs_per_rollout=2", "optim.warmup_steps=6",
                                "optim.warmup_shape=log", "optim.schedule=linear", "optim.lr=1.0"])
    lrs = learning_rates(cfg, 200)
    log6 = 1.791759469228055  # ln 6
    assert lrs[:8] == pytest.approx([0.0, 0.693147 / log6, 1.098612 / log6, 1.386294 / log6, 1.609438 / log6,
                                     1.0, 1.0, 193 / 194], rel=1e-6)
    assert lrs[-1] == pytest.approx(1 / 194)


def test_a_step_logs_the_learning_rate_its_updates_start_with(tmp_path):
    from caspo.train import loop

    tr = loop.build_trainer(load_config("tests", [f"train.output_dir={tmp_path}", "optim.warmup_steps=4",
                                                  "optim.lr=1e-3", "eval.before=false", "eval.after=false"]))
    with tr.pool:
        logged = [loop.outer_step(tr)[1]["lr"] for _ in range(2)]
    # two updates a step (8 responses, minibatch 4): step 1 starts at 1/4 of the lr, step 2 at 3/4
    assert logged == pytest.approx([1e-3 / 4, 3e-3 / 4])
