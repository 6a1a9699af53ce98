"""The batch that flows through one outer step, filled phase by phase.

Token layout (as in verl): prompts left-padded to a common width P, responses
right-padded to a common width R, so every response occupies columns P..P+R-1 and
the logits that score it are columns P-1..P+R-2. Per-token tensors of the training
signal (log-probs, advantages, masks) are `[B, R]` in the response frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Optional, Sequence

import torch

from caspo.rollout.base import Completion

SEQUENCE_FRAME = ("input_ids", "attention_mask", "position_ids")  # [B, P+R]
RESPONSE_FRAME = ("responses", "response_mask", "behaviour_logprobs", "old_logprobs", "ref_logprobs", "values",
                  "returns", "advantages", "step_ids", "update_ratios", "value_ref_logprobs")  # [B, R]


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [B, P+R]
    attention_mask: torch.Tensor  # [B, P+R]
    position_ids: torch.Tensor  # [B, P+R]
    prompt_width: int  # P
    responses: torch.Tensor  # [B, R]
    response_mask: torch.Tensor  # [B, R] float 0/1
    behaviour_logprobs: torch.Tensor  # [B, R] from the engine
    group_ids: torch.Tensor  # [B] prompt group of each sample
    finished: torch.Tensor  # [B] bool: stopped before the length limit
    # per-sample metadata
    example_ids: list[str]
    sample_seeds: list[int]
    policy_versions: list[int]
    finish_reasons: list[str]
    texts: list[str]
    prompt_ids: list[list[int]] = field(default_factory=list)  # each sample's prompt tokens, unpadded
    labels: list[str] = field(default_factory=list)  # each sample's reference answer
    # filled by later phases
    rewards: Optional[torch.Tensor] = None  # [B]
    old_logprobs: Optional[torch.Tensor] = None  # [B, R]
    # π_old is the policy being trained: the update's own forward fills old_logprobs (train.update.old_is_current)
    old_is_current: bool = False
    ref_logprobs: Optional[torch.Tensor] = None  # [B, R]
    values: Optional[torch.Tensor] = None  # [B, R] critic values before the update
    returns: Optional[torch.Tensor] = None  # [B, R] GAE returns
    advantages: Optional[torch.Tensor] = None  # [B, R]
    # π/π_old of each token at its last training forward (the ratio the loss clips), written by the update
    update_ratios: Optional[torch.Tensor] = None  # [B, R]
    true_rewards: Optional[torch.Tensor] = None  # [B] the verifier's rewards when a control replaced them
    # step-level methods: the step of each response token, and per-step tensors [B, S]
    step_ids: Optional[torch.Tensor] = None  # [B, R] step index of each response token, −1 on padding
    step_values: Optional[torch.Tensor] = None  # [B, S] values the step TD reads (V(s_k), or CASPO's T(V(s_k)))
    step_mask: Optional[torch.Tensor] = None  # [B, S]
    step_advantages: Optional[torch.Tensor] = None  # [B, S]
    # CASPO trained online: φ's frozen reference scores at T = 1 from the value read, for the online step
    value_ref_logprobs: Optional[torch.Tensor] = None  # [B, R]
    stats: dict = field(default_factory=dict)  # batch-level counts for the run log (not per sample)

    @property
    def size(self) -> int:
        return self.responses.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1).long()

    @classmethod
    def from_completions(cls, prompts: Sequence[list[int]], completions: Sequence[Completion], *,
                         group_ids: Sequence[int], example_ids: Sequence[str], sample_seeds: Sequence[int],
                         texts: Sequence[str], pad_token_id: int, labels: Sequence[str] = ()) -> "RolloutBatch":
        B = len(completions)
        P = max(len(p) for p in prompts)
        R = max(1, max(len(c.tokens) for c in completions))
        input_ids = torch.full((B, P + R), pad_token_id, dtype=torch.long)
        attention = torch.zeros((B, P + R), dtype=torch.long)
        responses = torch.full((B, R), pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((B, R))
        behaviour = torch.zeros((B, R))
        for i, (p, c) in enumerate(zip(prompts, completions)):
            n = len(c.tokens)
            input_ids[i, P - len(p):P] = torch.tensor(p)
            attention[i, P - len(p):P + n] = 1
            if n:
                input_ids[i, P:P + n] = torch.tensor(c.tokens)
                responses[i, :n] = torch.tensor(c.tokens)
                response_mask[i, :n] = 1
                behaviour[i, :n] = torch.tensor(c.logprobs)
        return cls(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
            prompt_width=P,
            responses=responses,
            response_mask=response_mask,
            behaviour_logprobs=behaviour,
            group_ids=torch.tensor(list(group_ids)),
            finished=torch.tensor([c.finish_reason == "stop" for c in completions]),
            example_ids=list(example_ids),
            sample_seeds=list(sample_seeds),
            policy_versions=[c.policy_version for c in completions],
            finish_reasons=[c.finish_reason for c in completions],
            texts=list(texts),
            prompt_ids=[list(p) for p in prompts],
            labels=list(labels),
        )

    def to(self, device: torch.device | str) -> "RolloutBatch":
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)

    def select(self, index: torch.Tensor | Sequence[int], frame: tuple[int, int] | None = None) -> "RolloutBatch":
        """Rows `index` of every per-sample field, in a frame trimmed to their longest prompt and response
        (`frame`: those two widths, when the caller knows them; else read from the device)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        if frame is None:
            frame = (int(self.attention_mask[idx, :self.prompt_width].sum(-1).max()),
                     int(self.response_mask[idx].sum(-1).max()))
        P, R = max(1, frame[0]), max(1, frame[1])
        columns = {**dict.fromkeys(SEQUENCE_FRAME, slice(self.prompt_width - P, self.prompt_width + R)),
                   **dict.fromkeys(RESPONSE_FRAME, slice(0, R))}
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value[idx]
                if f.name in columns:
                    value = value[:, columns[f.name]]
            elif isinstance(value, list) and value:
                value = [value[i] for i in idx.tolist()]
            elif isinstance(value, dict):
                value = dict(value)
            out[f.name] = value
        out["prompt_width"] = P
        return replace(self, **out)

    def micro_batches(self, size: int, rows: torch.Tensor | None = None, max_tokens: int = 0):
        """(row indices, the selected micro-batch) over `rows` (default: every row), as `plan_micro_batches`
        splits them."""
        rows = torch.arange(self.size) if rows is None else rows
        # the lengths read once: no host sync between micro-batches, so the next one is queued while one runs
        prompt_lengths = self.attention_mask[rows, :self.prompt_width].sum(-1).tolist()
        response_lengths = self.response_mask[rows].sum(-1).tolist()
        for chunk in plan_micro_batches(prompt_lengths, response_lengths, size, max_tokens):
            frame = int(max(prompt_lengths[i] for i in chunk)), int(max(response_lengths[i] for i in chunk))
            yield rows[chunk], self.select(rows[chunk], frame)


def plan_micro_batches(prompt_lengths: Sequence[int], response_lengths: Sequence[int], size: int,
                       max_tokens: int = 0) -> list[list[int]]:
    """The micro-batches of rows with these lengths, as lists of positions.

    max_tokens = 0: consecutive chunks of `size` rows. max_tokens > 0: the rows sorted by length, longest
    first, packed so that each micro-batch's padded frame (rows × (longest prompt + longest response))
    holds at most max_tokens, and at most `size` rows; a row longer than max_tokens goes alone.

    A last micro-batch of one row takes the last row of the one before it, where that one keeps two rows or
    more and both stay within the bounds: compiled blocks build a graph of their own for a single row
    (`caspo.models.policy.compile_blocks`), which a run would otherwise compile whenever a step's rows leave
    one over. The loss is normalised over the minibatch, so the split changes no gradient beyond rounding.
    """
    def frame(chunk: list[int]) -> int:
        return max(prompt_lengths[i] for i in chunk) + max(response_lengths[i] for i in chunk)

    count = len(prompt_lengths)
    if not max_tokens:
        chunks = [list(range(start, min(start + size, count))) for start in range(0, count, size)]
    else:
        order = sorted(range(count), key=lambda i: -(prompt_lengths[i] + response_lengths[i]))
        chunks, widest_prompt, widest_response = [], 0, 0
        for i in order:
            p, r = max(widest_prompt, prompt_lengths[i]), max(widest_response, response_lengths[i])
            if chunks and len(chunks[-1]) < size and (len(chunks[-1]) + 1) * (p + r) <= max_tokens:
                chunks[-1].append(i)
            else:
                chunks.append([i])
                p, r = prompt_lengths[i], response_lengths[i]
            widest_prompt, widest_response = p, r
    if len(chunks) > 1 and len(chunks[-1]) == 1 and len(chunks[-2]) > 2 and size > 1:
        last = [chunks[-2][-1], *chunks[-1]]
        if not max_tokens or 2 * frame(last) <= max_tokens:
            chunks[-2:] = [chunks[-2][:-1], last]
    return chunks
