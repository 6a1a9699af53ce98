"""The provenance of Monte Carlo labels, read off a run configuration.

Labels are success probabilities of one policy, under one prompt format, tokenizer,
sampler, response budget and verifier. The record travels with every label row and
into every value model trained on them, so a stale pairing fails loudly
(``caspo.models.prefix_value.check_provenance``).
"""

from __future__ import annotations

import hashlib
import json

import torch

from caspo.config import Config
from caspo.data.templates import TEMPLATES
from caspo.models.prefix_value import Provenance, model_identity
from caspo.reward import VERIFIER_VERSION


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the tokenizer's full serialization (vocabulary, merges, normalizer, specials)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__} has no backend_tokenizer to fingerprint; use a fast tokenizer")
    specials = json.dumps(tokenizer.special_tokens_map, sort_keys=True)
    return "t:" + hashlib.sha256((backend.to_str() + specials).encode()).hexdigest()[:16]


def prompt_format(cfg: Config, tokenizer) -> dict:
    """The provenance fields that fix how ``cfg`` turns a problem into prompt tokens."""
    return dict(prompt_template=TEMPLATES.get(cfg.data.template, cfg.data.template), add_bos=cfg.data.add_bos,
                tokenizer_hash=tokenizer_hash(tokenizer))


def label_provenance(cfg: Config, tokenizer, policy: torch.nn.Module) -> Provenance:
    """The conditions under which ``policy``'s rollouts for ``cfg`` define values."""
    r = cfg.rollout
    return Provenance(
        **prompt_format(cfg, tokenizer),
        verifier_version=VERIFIER_VERSION,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        stop_strings=tuple(r.stop),
        max_new_tokens=r.max_new_tokens,
        label_policy=model_identity(policy),
    )
