"""One policy on one benchmark: a greedy completion and K seeded samples per problem, scored by the
verifier, summarised by caspo.eval.metrics, overall and per subject and level where the benchmark has them."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace

from caspo.config import Config, RewardConfig
from caspo.data.registry import level_name
from caspo.eval.benchmarks import Suite
from caspo.eval.heldout import greedy_requests, sample_requests
from caspo.eval.metrics import sample_metrics
from caspo.reward import Unscored, extract_answer, has_box
from caspo.reward.prefilter import MAX_ANSWER_CHARS
from caspo.rollout.base import Request, SamplingParams

CHUNK = 1024  # requests per engine call, one progress step each

log = logging.getLogger(__name__)


def eval_samplers(cfg: Config, run_sampling: SamplingParams) -> tuple[SamplingParams, SamplingParams]:
    """(greedy, samples) from the run's sampler (its stop ids and strings): the samples at eval.temperature /
    eval.top_p, or the run's where those are null."""
    e = cfg.eval
    greedy = replace(run_sampling, temperature=0.0, top_p=1.0, top_k=0)
    sampled = replace(run_sampling, temperature=run_sampling.temperature if e.temperature is None else e.temperature,
                      top_p=run_sampling.top_p if e.top_p is None else e.top_p)
    return greedy, sampled


@dataclass
class Outputs:
    texts: list[str]
    rewards: list[float]
    finished: list[bool]
    tokens: int = 0  # generated tokens, the stop token included
    generate_s: float = 0.0  # inside engine.generate (scoring excluded)
    unscored: Unscored = field(default_factory=Unscored)  # completions the pool left without a verdict (reward 0)


def run_requests(engine, tokenizer, pool, requests: list[Request], labels: list[str], sampling: SamplingParams,
                 advance=lambda n: None) -> Outputs:
    """Generate and score in chunks of CHUNK requests, calling advance(n) after each."""
    out = Outputs([], [], [])
    for start in range(0, len(requests), CHUNK):
        t0 = time.perf_counter()
        completions = engine.generate(requests[start:start + CHUNK], sampling)
        out.generate_s += time.perf_counter() - t0
        out.tokens += sum(len(c.tokens) for c in completions)
        texts = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in completions]
        finished = [c.finish_reason == "stop" for c in completions]
        scored = pool.score(texts, labels[start:start + CHUNK], finished)
        out.rewards += scored.rewards
        out.unscored.add(scored)
        out.texts += texts
        out.finished += finished
        advance(len(completions))
    return out


def evaluate_suite(engine, tokenizer, pool, cfg: Config, suite: Suite, run_sampling: SamplingParams,
                   advance=lambda n: None) -> tuple[dict, list]:
    """(the benchmark's result, one record per problem). `advance(n)` is told of every n completions."""
    t0 = time.perf_counter()
    labels, K = [e.label for e in suite.examples], cfg.eval.samples
    n_tok = cfg.eval.max_new_tokens
    greedy_sp, sampled_sp = eval_samplers(cfg, run_sampling)
    greedy = run_requests(engine, tokenizer, pool, greedy_requests(suite.prompts, n_tok), labels, greedy_sp, advance)
    sampled = None
    if K:
        sampled = run_requests(engine, tokenizer, pool, sample_requests(suite.prompts, K, n_tok),
                               [x for x in labels for _ in range(K)], sampled_sp, advance)
    records = problem_records(suite, greedy, sampled, K, cfg.reward)
    longest = cfg.reward.max_answer_chars  # longer answers do not vote in maj@K: the verifier refuses them
    result = {"source": suite.source, "n": len(records), "metrics": metrics_of(records, K, longest),
              "data": suite.load}
    for key, fld in (("by_subject", suite.subject_field), ("by_level", suite.level_field)):
        if fld:
            result[key] = breakdown(records, key.removeprefix("by_"), K, longest)
    runs = [greedy] + ([sampled] if sampled is not None else [])
    result["scoring"] = unscored_counts(suite.name, runs)
    tokens, generate_s = sum(o.tokens for o in runs), sum(o.generate_s for o in runs)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    result["generation"] = {"tokens": tokens, "seconds": round(generate_s, 2),
                            "tokens_per_s": round(tokens / generate_s, 1) if generate_s > 0 else None}
    return result, records


def unscored_counts(name: str, runs: list[Outputs]) -> dict:
    """The completions the verifier left without a verdict (counted wrong), by cause; a warning if any."""
    unscored = Unscored()
    for run in runs:
        unscored.add(run.unscored)
    if unscored.total:
        log.warning("%s: %d of %d completions were not scored (%s) and count as wrong; raise reward.timeout_s or "
                    "reward.batch_budget_s", name, unscored.total, sum(len(run.rewards) for run in runs),
                    ", ".join(f"{n} {cause}" for cause, n in unscored.counts().items() if n and cause != "unscored"))
    return unscored.counts()


def answer_of(text: str, finished: bool, reward: RewardConfig) -> str | None:
    """The answer the verifier reads (reward.extractor, reward.fallback): maj@k votes on these."""
    return extract_answer(text, reward.extractor, reward.fallback) if finished else None


def problem_records(suite: Suite, greedy: Outputs, sampled: Outputs | None, K: int,
                    reward: RewardConfig) -> list[dict]:
    records = []
    for i, ex in enumerate(suite.examples):
        rec = {"id": ex.id, "label": ex.label, "greedy_reward": greedy.rewards[i],
               "greedy_answer": answer_of(greedy.texts[i], greedy.finished[i], reward),
               "greedy_finished": greedy.finished[i], "greedy_boxed": has_box(greedy.texts[i]),
               "greedy_text": greedy.texts[i]}
        if suite.subject_field:
            rec["subject"] = str(ex.meta.get(suite.subject_field, ""))
        if suite.level_field:
            rec["level"] = level_name(ex.meta.get(suite.level_field, ""))
        if sampled is not None:
            span = slice(i * K, (i + 1) * K)
            rec["rewards"] = sampled.rewards[span]
            rec["answers"] = [answer_of(t, f, reward) for t, f in zip(sampled.texts[span], sampled.finished[span])]
            rec["finished"] = sampled.finished[span]
            rec["boxed"] = [has_box(t) for t in sampled.texts[span]]
        records.append(rec)
    return records


def metrics_of(records: list[dict], K: int, max_answer_chars: int = MAX_ANSWER_CHARS) -> dict:
    n = len(records)
    out = {"greedy": sum(r["greedy_reward"] for r in records) / n,
           "greedy_boxed_rate": sum(r["greedy_boxed"] for r in records) / n,
           "greedy_truncated_rate": sum(not r["greedy_finished"] for r in records) / n}
    if K:
        out |= sample_metrics([r["rewards"] for r in records], [r["answers"] for r in records], max_answer_chars)
        out["sampled_boxed_rate"] = sum(sum(r["boxed"]) for r in records) / (n * K)
        out["sampled_truncated_rate"] = sum(K - sum(r["finished"]) for r in records) / (n * K)
    return out


def breakdown(records: list[dict], key: str, K: int, max_answer_chars: int = MAX_ANSWER_CHARS) -> dict:
    """The metrics of each value of records[key] (a subject or a level), in sorted order."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[r[key]].append(r)
    return {name: {"n": len(rs), **metrics_of(rs, K, max_answer_chars)} for name, rs in sorted(groups.items())}
