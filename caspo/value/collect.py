"""Phase 1, part one: Monte Carlo labels of response prefixes from the current policy.

Per prompt: K base rollouts (optionally at `state_temperature`); keep mixed-outcome prompts
and, by `pairing`, all their rollouts or balanced pairs of a right and a wrong one; pick S
interior step boundaries per rollout; label each with p̂, the mean reward of J continuations.
The empty prefix is never labelled (V = 0 there). Seeds make shard i/n write exactly an
unsharded run's rows for prompts i, i+n, …; their `step` is COLLECT_STEP for phase 1 and
``refresh_seed_step(n)`` after RL step n. See docs/phase1_labels.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Optional

from caspo.config import Config, ConfigError
from caspo.data.build import load_task_data
from caspo.models.provenance import label_provenance
from caspo.reward.pool import RewardPool
from caspo.rollout.base import Request
from caspo.rollout.sampling import sample_seed
from caspo.runlog import console, progress_bar
from caspo.segment import SPLITTERS, splitter_name, step_splitter
from caspo.train.monte_carlo import Prefix, continuation_seed, estimate_prefixes, step_start_indices
from caspo.value.labels import LabelFileError, LabelRow, write_label_file
from caspo.value.rollout import rollout_setup

COLLECT_STEP = -1  # the `step` of phase-1 seeds: no outer RL step has run
# Which rollouts of a mixed-outcome prompt are labelled (the seed's phase-1 modes): "all" of them;
# "paper" (PAPER_PAIRING): one right and one wrong rollout, IPVRM's one pair per prompt;
# "paper_multi" (PAPER_PAIRING_MULTI): min(n_right, n_wrong) disjoint pairs, no rollout reused.
PAIRINGS = ("all", "paper", "paper_multi")


def refresh_seed_step(step: int) -> int:
    """The seed `step` of the collection after RL step ``step``: negative, so never an RL step's."""
    return COLLECT_STEP - step


@dataclass(frozen=True)
class CollectSpec:
    prompts: int  # training prompts considered: the first `prompts` of the split, over all shards
    k: int  # base rollouts per prompt
    j: int  # continuations per labelled prefix
    boundaries: int  # S: labelled step boundaries per rollout
    chunk: int = 32  # prompts per round of generation (the progress bar's unit)
    state_temperature: Optional[float] = None  # of the base rollouts only (None: the run's temperature)
    pairing: str = "all"  # one of PAIRINGS


RECIPES = {
    # a few minutes on 2 CPU cores with the embedded policy
    "cpu": CollectSpec(prompts=320, k=8, j=8, boundaries=3),
    # the 1.5B recipe: K=16 base rollouts, J=16 continuations, S=5 boundaries
    "gpu": CollectSpec(prompts=300, k=16, j=16, boundaries=5, chunk=64),
}


def choose_boundaries(step_starts: list[int], s: int) -> list[int]:
    """S of a rollout's interior step starts (all but the first), evenly spaced, first and last included.

    With n interior starts and n > S, pick indices round(i·(n−1)/(S−1)), i = 0 … S−1
    (S = 1 picks the middle one); with n ≤ S, all of them.
    """
    interior = step_starts[1:]
    n = len(interior)
    if s < 1:
        raise ConfigError(f"boundaries per rollout must be >= 1, got {s}")
    if n <= s:
        return list(interior)
    if s == 1:
        return [interior[(n - 1) // 2]]
    return [interior[round(i * (n - 1) / (s - 1))] for i in range(s)]


def paired_samples(outcomes: list[float], pairing: str) -> list[int]:
    """The samples of one mixed-outcome prompt that are labelled, in sample order.

    A sample is right when its reward is > 1/2. With n = min(n_right, n_wrong):
        all          every sample
        paper        the first right and the first wrong sample (one pair)
        paper_multi  the first n right and the first n wrong samples (n disjoint pairs)
    Samples are i.i.d., so the first ones are a uniform choice that needs no random draw.
    """
    if pairing not in PAIRINGS:
        raise ValueError(f"unknown pairing {pairing!r}; choose from {', '.join(PAIRINGS)}")
    if pairing == "all":
        return list(range(len(outcomes)))
    right = [s for s, r in enumerate(outcomes) if r > 0.5]
    wrong = [s for s, r in enumerate(outcomes) if r <= 0.5]
    n = 1 if pairing == "paper" else min(len(right), len(wrong))
    if not right or not wrong:
        raise ValueError(f"pairing {pairing!r} needs a right and a wrong sample, got rewards {outcomes}")
    return sorted(right[:n] + wrong[:n])


def parse_shard(text: str) -> tuple[int, int]:
    """'i/n' -> (i, n), 0 <= i < n."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ConfigError(f"shard must look like i/n (e.g. 0/4), got {text!r}") from None
    if not 0 <= i < n:
        raise ConfigError(f"shard {text}: need 0 <= i < n")
    return i, n


def collect(cfg: Config, spec: CollectSpec, out: str | Path, shard: tuple[int, int] = (0, 1),
            splitter: Optional[str] = None, seed_step: int = COLLECT_STEP, allow_empty: bool = True) -> dict:
    """Write the label file of one shard; returns its header. Responses split into steps as training splits
    them (method.step_splitter, max_steps, after_final_box); `splitter` overrides method.step_splitter.
    Without `allow_empty`, a collection that labels no prefix is a LabelFileError and writes nothing."""
    if splitter is not None:
        if splitter not in SPLITTERS:
            raise ConfigError(f"unknown splitter {splitter!r}; choose from {sorted(SPLITTERS)}")
        cfg = dataclasses.replace(cfg, method=dataclasses.replace(cfg.method, step_splitter=splitter))
    splitter = splitter_name(cfg)
    if cfg.reward.synthetic:
        raise ConfigError("reward.synthetic scores a training batch only; Monte Carlo labels use the verifier: "
                          "set reward.synthetic=false")
    if spec.pairing not in PAIRINGS:
        raise ValueError(f"unknown pairing {spec.pairing!r}; choose from {', '.join(PAIRINGS)}")
    if spec.state_temperature is not None and not spec.state_temperature > 0:
        raise ConfigError(f"state temperature must be > 0, got {spec.state_temperature}; leave it unset to sample "
                          "base rollouts like the run")
    setup = rollout_setup(cfg)
    data = load_task_data(cfg, setup.tokenizer)
    if spec.prompts > len(data.train):
        raise ConfigError(f"{spec.prompts} prompts asked for, the training split has {len(data.train)}")
    provenance = label_provenance(cfg, setup.tokenizer, setup.policy).to_dict()
    indices = list(range(shard[0], spec.prompts, shard[1]))
    rows: list[LabelRow] = []
    stats = {"prompts": len(indices), "base_rollouts": 0, "mixed_prompts": 0, "labelled_rollouts": 0,
             "base_tokens": 0, "mc_requests": 0, "mc_unique_prefixes": 0, "mc_tokens": 0}

    with RewardPool.from_config(cfg.reward) as pool, progress_bar() as progress:
        scorer = setup.scorer(pool)
        split = step_splitter(cfg, setup.decode)
        task = progress.add_task(f"collect {shard[0]}/{shard[1]}", total=len(indices), status="")
        for start in range(0, len(indices), spec.chunk):
            chunk = indices[start:start + spec.chunk]
            rollouts, rewards = base_rollouts(cfg, setup, data, chunk, spec.k, scorer, seed_step,
                                              spec.state_temperature)
            stats["base_rollouts"] += len(rollouts)
            stats["base_tokens"] += sum(len(t) for t in rollouts)
            pending = []  # (row fields, prefix) of every prefix to label in this chunk
            for n, i in enumerate(chunk):
                outcomes = rewards[n * spec.k:(n + 1) * spec.k]
                if not 0 < sum(outcomes) < spec.k:
                    continue
                stats["mixed_prompts"] += 1
                example, prompt = data.train[i], data.train_prompts[i]
                samples = paired_samples(outcomes, spec.pairing)
                stats["labelled_rollouts"] += len(samples)
                for s in samples:
                    tokens = rollouts[n * spec.k + s]
                    starts = step_start_indices(split(tokens))
                    for boundary in choose_boundaries(starts, spec.boundaries):
                        fields = dict(prompt_id=example.id, prompt_index=i, sample=s, prompt_tokens=list(prompt),
                                      response_tokens=list(tokens), boundary=boundary, step=starts.index(boundary),
                                      j=spec.j, base_reward=outcomes[s], label=example.label, provenance=provenance)
                        pending.append((fields, Prefix(tuple(prompt), tuple(tokens[:boundary]), example.label)))
            if pending:
                est = estimate_prefixes(setup.engine, [p for _, p in pending], k=spec.j, sampling=setup.sampling,
                                        max_new_tokens=cfg.rollout.max_new_tokens,
                                        seed_fn=partial(continuation_seed, cfg.train.seed, seed_step),
                                        scorer=scorer, decode=setup.decode,
                                        score_while_generating=pool.workers > 0)
                rows += [LabelRow(**fields, p_hat=p) for (fields, _), p in zip(pending, est.means)]
                stats["mc_requests"] += est.requests
                stats["mc_unique_prefixes"] += est.unique
                stats["mc_tokens"] += est.tokens
            progress.update(task, advance=len(chunk),
                            status=f"mixed {stats['mixed_prompts']}  rows {len(rows)}  mc tokens {stats['mc_tokens']}")

    stats.update(scorer.unscored.counts("mc_reward_"))  # rollouts and continuations scored 0 without a verdict
    header = {"shard": f"{shard[0]}/{shard[1]}", **asdict(spec), "splitter": splitter, "seed": cfg.train.seed,
              "seed_step": seed_step, "policy_source": cfg.model.policy, "provenance": provenance, "stats": stats}
    header.pop("chunk")
    if not rows and not allow_empty:
        raise LabelFileError(f"none of the {len(indices)} prompts had both a right and a wrong answer among its "
                             f"{spec.k} base rollouts, so no prefix was labelled; {out} not written: raise --prompts "
                             "or --k")
    write_label_file(out, header, rows)
    console.print(f"{len(rows)} labelled prefixes from {stats['mixed_prompts']} mixed-outcome prompts "
                  f"of {len(indices)} -> {out}")
    return header


def base_rollouts(cfg: Config, setup, data, chunk: list[int], k: int, scorer, seed_step: int = COLLECT_STEP,
                  temperature: Optional[float] = None) -> tuple[list[list[int]], list[float]]:
    """K rollouts of each prompt of ``chunk`` (prompt-major) and their rewards; seeds from (run seed, prompt, sample).

    ``temperature`` replaces the run's sampling temperature for these rollouts only."""
    sampling = setup.sampling if temperature is None else dataclasses.replace(setup.sampling, temperature=temperature)
    requests = [Request(data.train_prompts[i], sample_seed(cfg.train.seed, seed_step, i, s),
                        cfg.rollout.max_new_tokens) for i in chunk for s in range(k)]
    completions = setup.engine.generate(requests, sampling)
    labels = [data.train[i].label for i in chunk for _ in range(k)]
    rewards = scorer([setup.decode(c.tokens) for c in completions], labels,
                     [c.finish_reason == "stop" for c in completions])
    return [c.tokens for c in completions], rewards
