"""AdamW's state allocated before the engine: the run that follows is that of a fresh optimizer."""

import torch

from caspo.config import OptimConfig
from caspo.train.optim import allocate_state, build_optimizer


def steps(allocate: bool, n: int = 3):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = build_optimizer(model.parameters(), OptimConfig(lr=0.1, weight_decay=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    if allocate:
        allocate_state(optimizer)
        assert [torch.equal(p, q) for p, q in zip(model.parameters(), before)] == [True, True]  # nothing moved
        state = optimizer.state[model.weight]
        assert float(state["step"]) == 0 and state["exp_avg"].abs().sum() == 0 and state["exp_avg_sq"].shape == (3, 4)
        assert model.weight.grad is None  # the gradients are as they were
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(n):
        optimizer.zero_grad()
        model(x).square().sum().backward()
        optimizer.step()
    return model, optimizer


def test_allocated_state_gives_the_same_steps_bit_for_bit():
    fresh, fresh_opt = steps(allocate=False)
    allocated, allocated_opt = steps(allocate=True)
    for p, q in zip(fresh.parameters(), allocated.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(fresh.parameters(), allocated.parameters()):
        a, b = fresh_opt.state[p], allocated_opt.state[q]
        assert float(a["step"]) == float(b["step"]) == 3
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_sgd_is_left_alone():
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model.parameters(), OptimConfig(name="sgd", momentum=0.9))
    allocate_state(optimizer)
    assert not optimizer.state  # its momentum buffer starts as the first gradient, not as zeros
