"""Publication checks that every engine must pass (HF backend and native engine alike)."""

import copy

import pytest
import torch

from caspo.rollout.publication import PublicationError


def perturbed(model, scale=0.05):
    """A copy of `model` with every weight moved by N(0, scale²) noise."""
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * scale)
    return new


def check_failed_publications_keep_old_weights(engine, model, requests, sampling):
    """An incomplete, mis-shaped, unknown-tensor or non-finite publication raises and leaves the old weights
    serving."""
    before = engine.generate(requests, sampling)
    named = dict(perturbed(model).named_parameters())
    engine.begin(1)
    engine.load({k: v for k, v in list(named.items())[:-1]})  # the last tensor never arrives
    with pytest.raises(PublicationError, match="incomplete"):
        engine.commit()
    engine.begin(1)
    name = next(iter(named))
    with pytest.raises(PublicationError, match="shape"):
        engine.load({name: named[name][:-1]})
    with pytest.raises(PublicationError, match="unknown tensor"):
        engine.load({"not.a.weight": named[name]})
    poisoned = {k: v.detach().clone() for k, v in named.items()}
    last = list(poisoned)[-1]
    poisoned[last].view(-1)[3] = float("nan")  # one NaN in one tensor
    engine.begin(1)
    engine.load(poisoned)
    with pytest.raises(PublicationError, match=f"1 tensors hold NaN or Inf \\(first: {last}\\)"):
        engine.commit()
    assert engine.version == 0
    assert [c.tokens for c in engine.generate(requests, sampling)] == [c.tokens for c in before]
