"""Provenance: the conditions under which values were defined, and the check that refuses stale ones.

Labels are success probabilities of one policy, under one prompt format, tokenizer,
sampler, response budget and verifier. The record travels with every label row and
into every value model trained on them, so a stale pairing fails loudly
(``check_provenance``) instead of loading and running silently wrong.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from caspo.config import Config
from caspo.data.templates import CHAT, TEMPLATES, prompt_bos
from caspo.reward import VERIFIER_VERSION

log = logging.getLogger(__name__)


class ProvenanceError(ValueError):
    """A value model or label set made under other conditions than the caller's."""


@dataclass(frozen=True)
class Provenance:
    """What defines the values a model was trained on; any change makes it stale."""

    prompt_template: str  # the template text, with its {query} placeholder
    add_bos: bool
    tokenizer_hash: str
    verifier_version: str  # caspo.reward.VERIFIER_VERSION, and the reward settings off their defaults
    temperature: float  # the sampler whose success probability the values estimate
    top_p: float
    top_k: int
    stop_strings: tuple[str, ...]
    max_new_tokens: int  # response budget: continuations that hit it score 0
    label_policy: str  # model_identity of the policy whose rollouts made the labels
    reference: Optional[str] = None  # model_identity of the value model's frozen reference; None for a label set

    def with_reference(self, reference: str) -> "Provenance":
        return dataclasses.replace(self, reference=reference)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["stop_strings"] = list(self.stop_strings)
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> "Provenance":
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(names - set(raw) - {"reference"})
        unknown = sorted(set(raw) - names)
        if missing or unknown:
            raise ProvenanceError(f"provenance record has missing fields {missing} and unknown fields {unknown}")
        return cls(**{**raw, "stop_strings": tuple(raw["stop_strings"])})


def provenance_mismatches(expected: Provenance, found: Provenance, ignore: Sequence[str] = ()) -> list[str]:
    """One line per field that differs: 'field: expected X, found Y'."""
    want, have = expected.to_dict(), found.to_dict()
    return [f"{name}: expected {want[name]!r}, found {have[name]!r}"
            for name in want if name not in ignore and want[name] != have[name]]


def check_provenance(expected: Provenance, found: Provenance, what: str, allow_mismatch: bool = False,
                     ignore: Sequence[str] = ()) -> None:
    """Raise ProvenanceError listing every differing field, or only log them when allowed."""
    lines = provenance_mismatches(expected, found, ignore)
    if not lines:
        return
    message = f"{what} was made under other conditions:\n  " + "\n  ".join(lines)
    if not allow_mismatch:
        raise ProvenanceError(message + "\nre-collect and retrain it, or pass allow_mismatch to use it anyway")
    log.warning("%s (used anyway: allow_mismatch)", message)


def model_identity(model: torch.nn.Module) -> str:
    """A fingerprint of a model's weights: sha256 over the name, shape, dtype and bytes of every parameter.

    The stored bytes, not sums of them: a float reduction depends on the device's summation
    order, and the same weights must have the same identity on any device. Weights rounded
    to another dtype are other weights.
    """
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
            h.update(p.detach().contiguous().cpu().view(torch.uint8).numpy())
    return "w:" + h.hexdigest()[:16]


# ---------------------------------------------------------------- read off a run configuration


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the tokenizer's full serialization (vocabulary, merges, normalizer, specials); a slow
    tokenizer, which has no serialization of its own, by its vocabulary and specials."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    specials = json.dumps(tokenizer.special_tokens_map, sort_keys=True)
    return "t:" + hashlib.sha256((body + specials).encode()).hexdigest()[:16]


def prompt_format(cfg: Config, tokenizer) -> dict:
    """The provenance fields that fix how ``cfg`` turns a problem into prompt tokens: the template text (the
    tokenizer's chat template for `chat`, which the tokenizer hash does not cover), BOS as resolved."""
    d = cfg.data
    template = tokenizer.chat_template if d.template == CHAT else TEMPLATES.get(d.template, d.template)
    return dict(prompt_template=template, add_bos=prompt_bos(d.add_bos, tokenizer, []),
                tokenizer_hash=tokenizer_hash(tokenizer))


def verifier_identity(cfg: Config) -> str:
    """The verifier's version and every reward setting that changes a verdict (those off their defaults
    appended, so values made under the defaults keep their record)."""
    rw, default = cfg.reward, type(cfg.reward)()
    changed = [f"{key}={getattr(rw, key)}" for key in ("extractor", "fallback", "max_answer_chars")
               if getattr(rw, key) != getattr(default, key)]
    return "/".join([VERIFIER_VERSION, *changed])


def label_provenance(cfg: Config, tokenizer, policy: torch.nn.Module) -> Provenance:
    """The conditions under which ``policy``'s rollouts for ``cfg`` define values."""
    r = cfg.rollout
    return Provenance(
        **prompt_format(cfg, tokenizer),
        verifier_version=verifier_identity(cfg),
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        stop_strings=tuple(r.stop),
        max_new_tokens=r.max_new_tokens,
        label_policy=model_identity(policy),
    )
