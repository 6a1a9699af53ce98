import copy

import pytest
import torch

from caspo.config import load_config
from caspo.methods import get_method
from caspo.precision import LossScaler, autocast
from caspo.train import loop
from caspo.train.advantages import compute_advantages
from caspo.train.update import accumulate_gradients, actor_loss, update

pytestmark = pytest.mark.timeout(120)


def adamw_step(model, lr, precision):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    x = torch.randn(16, 8, dtype=next(model.parameters()).dtype)
    with autocast(precision, torch.device("cpu")):
        loss = model(x).float().square().mean()
    loss.backward()
    opt.step()


def test_bf16_master_weights_keep_a_tiny_update_that_pure_bf16_loses():
    torch.manual_seed(0)
    base = torch.nn.Linear(8, 8)
    with torch.no_grad():
        base.weight.fill_(1.0)  # bf16 spacing at 1.0 is 2**-7; Adam's first step moves by lr = 1e-6
    master = copy.deepcopy(base)
    adamw_step(master, 1e-6, "bf16")  # fp32 parameters, bf16 compute
    moved = (master.weight - base.weight).detach().abs()
    assert moved.max().item() == pytest.approx(1e-6, rel=0.05)
    assert (moved > 0).all()

    pure = copy.deepcopy(base).to(torch.bfloat16)
    before = pure.weight.detach().clone()
    adamw_step(pure, 1e-6, "fp32")  # bf16 parameters: 1 - 1e-6 rounds back to 1
    assert torch.equal(pure.weight, before)


def first_batch(overrides, tmp_path):
    cfg = load_config("tests", [f"train.output_dir={tmp_path}", "method.kl_coef=0", *overrides])
    tr = loop.build_trainer(cfg)
    with tr.pool:
        batch = loop.generate(tr, tr.cursor.take(cfg.rollout.prompts_per_step))
        batch.rewards = loop.reward(tr, batch)
    batch.rewards = torch.tensor([1.0, 0.0] * (batch.size // 2))  # non-zero advantages whatever the policy did
    batch.old_logprobs = loop.score(tr.policy, batch, cfg)
    batch.advantages = compute_advantages(batch, cfg, get_method(cfg.method.name))[0]
    return tr, batch


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def test_fp16_with_loss_scale_matches_fp32(tmp_path):
    """fp16 gradients, scaled by 128 and unscaled, are the fp32 ones up to fp16's rounding: 1.9e-3 relative
    over all parameters on the tests preset (an fp16 ulp at 1 is 2**-10 ≈ 9.8e-4), at most 4.5e-3 for one.
    The bounds leave about 1.5x (2x for one parameter); a loss scale of 128 unscaled by 127 or 129 (a relative
    error of 6e-3 to 1e-2), or one parameter's gradient unscaled twice, breaks them."""
    tr32, batch = first_batch([], tmp_path / "a")
    tr16, _ = first_batch(["train.precision=fp16"], tmp_path / "b")
    grads = {}
    for tr in (tr32, tr16):
        tr.policy.zero_grad(set_to_none=True)
        accumulate_gradients(tr.policy, batch, torch.arange(batch.size), tr.cfg, tr.scaler, batch.responses.shape[1],
                             actor_loss(tr.method, tr.method_state, batch.responses.shape[1]))
        assert tr.scaler.unscale_and_check(tr.policy.parameters())
        grads[tr.cfg.train.precision] = {name: p.grad.clone() for name, p in tr.policy.named_parameters()}
        assert all(p.grad.dtype == torch.float32 for p in tr.policy.parameters())  # fp32 accumulation
    g32, g16 = grads["fp32"], grads["fp16"]
    assert all(g.norm() > 0 for g in g32.values())
    overall = relative_error(torch.cat([g.flatten() for g in g16.values()]),
                             torch.cat([g.flatten() for g in g32.values()]))
    assert overall < 3e-3
    per_parameter = {name: relative_error(g16[name], g32[name]) for name in g32}
    worst = max(per_parameter, key=per_parameter.get)
    assert per_parameter[worst] < 1e-2, worst  # a small tensor mis-scaled hardly moves the overall error
    assert tr16.scaler.skipped_steps == 0


def test_fp16_overflow_step_is_skipped_and_counted(tmp_path):
    tr, batch = first_batch(["train.precision=fp16", "train.loss_scale=1e38"], tmp_path)
    before = copy.deepcopy(tr.policy.state_dict())
    stats = update(tr.actor, batch, tr.cfg, tr.method, tr.method_state, torch.Generator().manual_seed(0), tr.scaler)
    assert stats["skipped_steps"] == tr.cfg.responses_per_step // tr.cfg.train.minibatch_size
    for name, value in tr.policy.state_dict().items():
        assert torch.equal(value, before[name])


def test_loss_scaler_is_identity_outside_fp16():
    scaler = LossScaler("bf16", 128.0)
    assert scaler.scale == 1.0
    assert LossScaler("fp16", 128.0).scale == 128.0


def test_unscale_divides_every_gradient_and_flags_any_non_finite_one():
    scaler = LossScaler("fp16", 4.0)
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    for p, g in zip(params, ([4.0, 8.0, -2.0], [1.0, 0.0, 2.0], [0.5, 0.25, 12.0])):
        p.grad = torch.tensor(g)
    assert scaler.unscale_and_check(params) and scaler.skipped_steps == 0
    assert params[0].grad.tolist() == [1.0, 2.0, -0.5] and params[2].grad.tolist() == [0.125, 0.0625, 3.0]
    params[1].grad[2] = float("inf")
    assert not scaler.unscale_and_check(params) and scaler.skipped_steps == 1


def test_a_sharded_gradient_is_checked_on_its_local_shard():
    """FSDP2's gradients are DTensors: each process checks its own shard (the ranks then agree on skipping)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        param = torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
        param.grad = distribute_tensor(torch.tensor([2.0, 4.0, 6.0, 8.0]), mesh, [Shard(0)])
        scaler = LossScaler("fp16", 2.0)
        assert scaler.unscale_and_check([param])
        assert param.grad.to_local().tolist() == [1.0, 2.0, 3.0, 4.0]
        param.grad.to_local()[1] = float("nan")
        assert not scaler.unscale_and_check([param]) and scaler.skipped_steps == 1
    finally:
        dist.destroy_process_group()
