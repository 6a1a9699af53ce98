"""The `transformers` rollout backend: any causal LM, a KV cache, counter-based sampling.

It holds its own copy of the policy's weights, so publishing new weights is a real
operation (and tests can catch one that fails). Requests are decoded in fixed-size
batches in request order; each row is left-padded and carries its own seed.
"""

from __future__ import annotations

import copy
import inspect
from typing import Sequence

import torch
from transformers import DynamicCache

from caspo.models.policy import cast_parameters, is_skeleton
from caspo.rollout.base import Completion, OnFinish, Request, SamplingParams, asleep_error
from caspo.rollout.publication import Publication, PublishedWeights
from caspo.rollout.sampling import sample_next
from caspo.rollout.stop_strings import StopStrings, stop_context


def cache_kwarg(model: torch.nn.Module) -> str:
    """The forward() keyword for the KV cache: `cache` in newer transformers, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFEngine(PublishedWeights):
    def __init__(self, model: torch.nn.Module, pad_token_id: int, max_batch: int = 0, decode=None,
                 dtype: torch.dtype | None = None, device: torch.device | None = None):
        skeleton = is_skeleton(model)  # a rank of a sharded run that reads no weights
        if skeleton and device is None:
            raise ValueError("an engine built from a model's skeleton (on the meta device) needs device=")
        if skeleton:  # built on `device` from the config (RoPE's buffers computed), filled by the first publication
            with torch.device(device):
                self.model = type(model)(copy.deepcopy(model.config)).eval().requires_grad_(False)
        else:
            self.model = copy.deepcopy(model).eval().requires_grad_(False)
        if dtype is not None:  # the engine computes in its own dtype; publications are cast to it
            cast_parameters(self.model, dtype)
        if device is not None:  # the model's own device by default
            self.model.to(device)
        self.pad_token_id = pad_token_id
        self.max_batch = max_batch
        self.decode = decode  # token ids -> text, needed only for stop strings
        self.version = 0
        self._cache_kw = cache_kwarg(self.model)
        self._publication: Publication | None = None
        self._asleep = False
        if skeleton:
            self.await_publication()

    # ------------------------------------------------------------ publication
    def _params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    # ------------------------------------------------------------ memory
    # The KV cache lives only inside a generate() call, so sleep/wake free and allocate nothing;
    # they keep the protocol's contract, so code written against it runs the same on both backends.
    @property
    def asleep(self) -> bool:
        return self._asleep

    def sleep(self, weights: bool = False) -> None:
        """Mark the engine asleep: generate() raises until wake(); with `weights`, free its weights too."""
        self._asleep = True
        if weights:
            self.release_weights()
            if next(self.model.parameters()).device.type == "cuda":
                torch.cuda.empty_cache()

    def wake(self) -> None:
        self.reallocate_weights()
        self._asleep = False

    # ------------------------------------------------------------ generation
    def generate(self, requests: Sequence[Request], sampling: SamplingParams, *,
                 on_finish: OnFinish | None = None) -> list[Completion]:
        if self._asleep:
            raise asleep_error("generate()")
        self.check_weights()
        if sampling.stop_strings and self.decode is None:
            raise ValueError("stop strings need a decode function: HFEngine(..., decode=tokenizer.decode)")
        size = self.max_batch or len(requests)
        out: list[Completion] = []
        for start in range(0, len(requests), size):
            out.extend(self._generate_batch(requests[start:start + size], sampling))
            if on_finish is not None:  # a batch's completions are final together
                for i in range(start, len(out)):
                    on_finish(i, out[i])
        return out

    @torch.no_grad()
    def _generate_batch(self, requests: Sequence[Request], sp: SamplingParams) -> list[Completion]:
        device = next(self.model.parameters()).device
        B = len(requests)
        lengths = [len(r.prompt_ids) for r in requests]
        width = max(lengths)
        ids = torch.full((B, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((B, width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - lengths[i]:] = torch.tensor(r.prompt_ids)
            mask[i, width - lengths[i]:] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64, device=device)
        budget = torch.tensor([r.max_new_tokens for r in requests], device=device)
        stop_ids = torch.tensor(sp.stop_token_ids or [-1], device=device)
        stop_strings = StopStrings(sp.stop_strings, self.decode) if sp.stop_strings else None

        cache = DynamicCache()
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1,
                            use_cache=True, **{self._cache_kw: cache}).logits[:, -1]
        next_pos = positions[:, -1] + 1
        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        finish = [""] * B
        active = torch.ones(B, dtype=torch.bool, device=device)
        for t in range(int(budget.max())):
            step_pos = torch.full((B,), t, dtype=torch.int64, device=device)
            tok, lp, _ = sample_next(logits, seeds, step_pos, sp.temperature, sp.top_k, sp.top_p)
            tok = torch.where(active, tok, torch.full_like(tok, self.pad_token_id))
            hit_stop = torch.isin(tok, stop_ids) & active
            tok_list, lp_list, stop_list = tok.tolist(), lp.tolist(), hit_stop.tolist()
            for i in range(B):
                if finish[i]:
                    continue
                tokens[i].append(tok_list[i])
                logps[i].append(lp_list[i])
                if stop_list[i] or (stop_strings is not None and
                                    stop_strings.ended(tokens[i], stop_context(requests[i]))):
                    finish[i] = "stop"
                elif len(tokens[i]) >= requests[i].max_new_tokens:
                    finish[i] = "length"
            active = torch.tensor([not f for f in finish], device=device)
            if not active.any():
                break
            mask = torch.cat([mask, active[:, None].long()], dim=1)
            logits = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                                use_cache=True, **{self._cache_kw: cache}).logits[:, -1]
            next_pos = next_pos + 1
        return [Completion(tokens[i], logps[i], finish[i] or "length", self.version) for i in range(B)]

