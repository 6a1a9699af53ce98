"""The critic: a copy of the policy's backbone with a scalar head, as an HF token classifier.

`AutoModelForTokenClassification` with one label is exactly "backbone + Linear(hidden, 1)"
and saves as an ordinary `save_pretrained` folder. The head starts at zero, so the
first advantages are the plain returns; dropout is off, so values are deterministic.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForTokenClassification

from caspo.batch import RolloutBatch
from caspo.models.forward import response_states
from caspo.models.looped import LoopedForValue
from caspo.models.looped_upstream import load_upstream, upstream_config
from caspo.models.policy import resolve_model_path


def load_critic(spec: str, device: str | torch.device = "cpu", init_head: bool = True) -> torch.nn.Module:
    """A critic from a policy checkpoint (new zero head) or from a saved critic (init_head=False); on the meta
    device, its skeleton."""
    path, skeleton = resolve_model_path(spec), torch.device(device).type == "meta"
    if upstream_config(path) is not None:  # an upstream Ouro / Nanbeige4.2 folder, converted on load
        critic = load_upstream(path, cls=LoopedForValue, weights=not skeleton)
    else:
        config = AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0
        config.hidden_dropout = 0.0
        if skeleton:  # no weights read: a rank of a sharded run other than the one that reads them
            with torch.device("meta"):
                return AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
        critic = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32)
    if skeleton:
        return critic
    if init_head:
        with torch.no_grad():
            critic.score.weight.zero_()
            if critic.score.bias is not None:
                critic.score.bias.zero_()
    return critic.to(device)


def critic_values(critic: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
    """[B, R] V(s_t): the value of the state from which response token t is generated."""
    return critic.score(response_states(critic.base_model, batch)).squeeze(-1).float()
