"""CASPO's prefix value model (IPVRM-style): a value read off a log-likelihood ratio.

    V(x, y_{<j}) = β · Σ_{i<j} log( π_φ(y_i | x, y_{<i}) / π_ref(y_i | x, y_{<i}) ),  β = 10

Ceiling: σ(V/β) ≤ 1 / (1 + π_ref(y_{<j} | x)) (``probability_ceiling``). Indexing:
``cumulative_values`` is inclusive (C[t] ends with token t), so the prefix of the first j
tokens has value C[j−1], and 0 for j = 0. ``load_prefix_value`` refuses a model whose label
provenance differs from the caller's. See docs/prefix_value.md.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from caspo.models.forward import response_logprobs
from caspo.models.provenance import Provenance, ProvenanceError, check_provenance, model_identity

FORMAT = "caspo-prefix-value/1"
CONFIG_FILE = "value_config.json"
DEFAULT_BETA = 10.0
TRANSFORMS = ("value", "prob", "logprob")

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- pure functions


def cumulative_values(log_ratios: torch.Tensor, response_mask: torch.Tensor, beta: float) -> torch.Tensor:
    """Value of the prefix ending with each token, ``[B, R]``:

        C[b, t] = β · Σ_{i ≤ t} m[b, i] · d[b, i],   d = log π_φ − log π_ref

    Padding (m = 0) adds nothing, whatever it holds.
    """
    terms = torch.where(response_mask.bool(), log_ratios, torch.zeros_like(log_ratios))
    return beta * terms.cumsum(-1)


def prefix_values(cumulative: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    """Values of the prefixes holding the first ``boundaries[b, n]`` response tokens, ``[B, N]``:

        V(y_{<j}) = C[j − 1]   (j ≥ 1),     V(y_{<0}) = 0

    ``boundaries`` are token counts in [0, R].
    """
    if boundaries.numel() and (int(boundaries.min()) < 0 or int(boundaries.max()) > cumulative.shape[1]):
        raise ValueError(f"boundaries must lie in [0, {cumulative.shape[1]}], got "
                         f"[{int(boundaries.min())}, {int(boundaries.max())}]")
    padded = F.pad(cumulative, (1, 0))  # padded[:, j] = C[j - 1], padded[:, 0] = 0
    return padded.gather(1, boundaries.long())


def step_values(cumulative: torch.Tensor, token_step_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Value of the state before each step, ``[B, S]``, and the step mask ``[B, S]``.

    ``token_step_ids`` ``[B, R]`` holds each token's step (−1 on padding), as from
    ``caspo.segment.pad_step_ids``. Step k starts at its first token s_k, so

        V(s_k) = V(y_{<s_k}) = C[s_k − 1],  V(s_0) = 0:

    the state before step k (= after step k − 1) includes every token of steps < k and
    none of step k. The value after the last step is terminal and not returned, as
    ``caspo.algo.step_td`` expects.
    """
    B, R = token_step_ids.shape
    counts = token_step_ids.max(-1).values.clamp(min=-1) + 1
    S = max(int(counts.max()), 1) if B else 1
    steps = torch.arange(S, device=token_step_ids.device)
    is_start = token_step_ids[:, :, None] == steps[None, None, :]  # [B, R, S]
    positions = torch.arange(R, device=token_step_ids.device)[None, :, None].expand(B, R, S)
    starts = torch.where(is_start, positions, torch.full_like(positions, R)).min(1).values  # [B, S]
    mask = steps[None, :] < counts[:, None]
    values = prefix_values(cumulative, torch.where(mask, starts, torch.zeros_like(starts)))
    return values * mask, mask.float()


def probability_ceiling(ref_prefix_logprobs: torch.Tensor) -> torch.Tensor:
    """The highest σ(V/β) any φ can give a prefix, from its log-probability under the reference:

        σ(V/β) ≤ σ(−log π_ref(y_{<j})) = 1 / (1 + π_ref(y_{<j}))

    (π_φ(y_{<j}) ≤ 1, so V ≤ −β log π_ref(y_{<j})). The empty prefix gets 1/2.
    """
    return torch.sigmoid(-ref_prefix_logprobs)


def transform_values(values: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    """The value scale CASPO's step TD uses:

        value:   V
        prob:    σ(V/β)          (the success probability the model was trained to predict)
        logprob: log σ(V/β)
    """
    if kind == "value":
        return values
    if kind == "prob":
        return torch.sigmoid(values / beta)
    if kind == "logprob":
        return F.logsigmoid(values / beta)
    raise ValueError(f"unknown value transform {kind!r}; choose from {TRANSFORMS}")


# ---------------------------------------------------------------- batches


@dataclass
class ResponseBatch:
    """Prompts left-padded to width P, responses right-padded to R (RolloutBatch's layout)."""

    input_ids: torch.Tensor  # [B, P+R]
    attention_mask: torch.Tensor  # [B, P+R]
    position_ids: torch.Tensor  # [B, P+R]
    prompt_width: int
    responses: torch.Tensor  # [B, R]
    response_mask: torch.Tensor  # [B, R] float 0/1

    def to(self, device) -> "ResponseBatch":
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device)
                                            for f in dataclasses.fields(self) if f.name != "prompt_width"})


def pack_responses(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                   pad_token_id: int) -> ResponseBatch:
    """Token lists to the batch layout the log-prob forward reads."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"need equally many prompts and responses, at least one; got {len(prompts)}, {len(responses)}")
    B, P, R = len(prompts), max(len(p) for p in prompts), max(1, max(len(r) for r in responses))
    ids = torch.full((B, P + R), pad_token_id, dtype=torch.long)
    attention = torch.zeros((B, P + R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p):P + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
        attention[i, P - len(p):P + len(r)] = 1
    response_mask = attention[:, P:].float()
    return ResponseBatch(ids, attention, (attention.cumsum(-1) - 1).clamp(min=0), P, ids[:, P:], response_mask)


# ---------------------------------------------------------------- the model


@dataclass
class PrefixValueModel:
    """φ (trained) and the frozen reference; batches are ResponseBatch or RolloutBatch.

    The reference is frozen in place (eval mode, no gradients), so pass a model that
    nothing else trains, never the live policy.
    """

    policy: torch.nn.Module
    reference: torch.nn.Module
    beta: float = DEFAULT_BETA
    provenance: Optional[Provenance] = None
    reference_source: str = ""  # where `reference` can be loaded from (a folder, hub id or embedded: spec)
    # how a function of φ or the reference is called: directly, or through an FSDP root (caspo.train.fsdp.call)
    call: Callable = field(default=lambda model, fn, *args: fn(model, *args), repr=False, compare=False)

    def __post_init__(self):
        self.reference.eval().requires_grad_(False)
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")

    @classmethod
    def from_reference(cls, reference: torch.nn.Module, beta: float = DEFAULT_BETA,
                       provenance: Optional[Provenance] = None, reference_source: str = "") -> "PrefixValueModel":
        """A fresh value model: φ starts as a copy of the reference, so every V starts at 0."""
        return cls(copy.deepcopy(reference).train().requires_grad_(True), reference, beta, provenance, reference_source)

    def log_ratios(self, batch, ref_logprobs: Optional[torch.Tensor] = None) -> torch.Tensor:
        """d[b, t] = log π_φ(y_t) − log π_ref(y_t) at temperature 1, ``[B, R]``, 0 on padding.

        ``ref_logprobs`` may be passed in to save the reference forward, but only when it
        is the same quantity: log-probs of these response tokens under this model's
        frozen reference, from temperature-1 logits. A trainer's reference scores qualify
        when its reference model is this reference and its rollout temperature is 1;
        scores at the sampling temperature of a T ≠ 1 run do not.
        """
        logp = self.call(self.policy, response_logprobs, batch, 1.0)
        if ref_logprobs is None:
            ref_logprobs = self.reference_logprobs(batch)
        elif ref_logprobs.shape != logp.shape:
            raise ValueError(f"ref_logprobs has shape {tuple(ref_logprobs.shape)}, the batch needs {tuple(logp.shape)}")
        diff = logp - ref_logprobs.to(logp.dtype)
        return torch.where(batch.response_mask.bool(), diff, torch.zeros_like(diff))

    @torch.no_grad()
    def reference_logprobs(self, batch) -> torch.Tensor:
        """log π_ref(y_t) of the response tokens at temperature 1, ``[B, R]``."""
        return self.call(self.reference, response_logprobs, batch, 1.0)

    def cumulative(self, batch, ref_logprobs: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``cumulative_values`` of the batch: C[b, t] is V of the prefix ending with token t."""
        return cumulative_values(self.log_ratios(batch, ref_logprobs), batch.response_mask, self.beta)

    def to(self, device) -> "PrefixValueModel":
        self.policy.to(device)
        self.reference.to(device)
        return self

    def save(self, path: str | Path, tokenizer=None, state_dict: Optional[dict] = None) -> Path:
        """φ as a save_pretrained folder (with the tokenizer, if given) plus value_config.json; `state_dict`:
        φ's whole tensors when φ itself is sharded."""
        from caspo.models.tokenizer import save_tokenizer

        config = self.config_text()  # before any file: a value model without its provenance is refused
        path = Path(path)
        self.policy.save_pretrained(path, safe_serialization=True, state_dict=state_dict)
        if tokenizer is not None:
            save_tokenizer(tokenizer, path)
        (path / CONFIG_FILE).write_text(config)
        return path

    def config_text(self, **notes) -> str:
        """value_config.json: the format, β, the reference's source and the provenance (and `notes`)."""
        if self.provenance is None or self.provenance.reference is None:
            raise ProvenanceError("a value model needs a provenance with its reference identity before it is saved")
        config = {"format": FORMAT, "beta": self.beta, "reference_source": self.reference_source,
                  "provenance": self.provenance.to_dict(), **notes}
        return json.dumps(config, indent=2) + "\n"


def read_value_config(path: str | Path) -> dict:
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: {path} is not a prefix value model folder")
    config = json.loads(file.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{file}: format {config.get('format')!r}, this code reads {FORMAT!r}")
    return config


def load_prefix_value(path: str | Path, expected_provenance: Optional[Provenance], allow_mismatch: bool = False,
                      reference: Optional[torch.nn.Module] = None,
                      device: str | torch.device = "cpu") -> PrefixValueModel:
    """Load a value model folder and check that it fits the caller's conditions.

    Every provenance field that differs from ``expected_provenance`` is listed in one
    ProvenanceError, unless ``allow_mismatch`` (then they are logged). Pass
    ``expected_provenance=None`` only to inspect a model. The reference is loaded from
    the recorded ``reference_source`` unless given; either way its weights must have the
    recorded identity, or the values would be log-ratios against another model.
    """
    from caspo.models.policy import is_skeleton, load_policy, resolve_model_path

    path = resolve_model_path(str(path))  # a folder, or embedded:NAME for one that ships
    config = read_value_config(path)
    provenance = Provenance.from_dict(config["provenance"])
    if expected_provenance is not None:
        # the reference is checked below against the weights actually loaded
        check_provenance(expected_provenance, provenance, f"prefix value model {path}", allow_mismatch,
                         ignore=("reference",))
    if reference is None:
        if not config["reference_source"]:
            raise ValueError(f"{path} records no reference_source; pass the reference model")
        reference = load_policy(config["reference_source"], device)
    # a skeleton (a sharded run's rank other than 0, `fsdp.read_device`) has no weights: rank 0 checks them
    identity = provenance.reference if is_skeleton(reference) else model_identity(reference)
    if identity != provenance.reference:
        raise ProvenanceError(f"the reference model has identity {identity}, but {path} was trained against "
                              f"{provenance.reference}; pass the reference it was trained with")
    policy = load_policy(str(path), device)
    return PrefixValueModel(policy, reference.to(device), config["beta"], provenance, config["reference_source"])
