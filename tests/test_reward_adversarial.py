"""The verifier against hostile responses, through the real RewardPool (docs/reliability.md, "Verifier").

tests/data/reward_adversarial.jsonl holds the patterns: hostile answer contents (code and shell
injection, TeX primitives, power towers, factorials, deep nesting, megabyte strings, Unicode digits,
control characters and lone surrogates), each scored boxed, in dollars, bare, and as the
replacement of a correct boxed answer; and whole hedged, replaced and disowned responses. Pass:
no code runs (a canary file stays absent), no call lasts past the timeout + 1 s, no worker's
resident set reaches its memory limit, every response that does not commit to the right answer
scores 0, and the pool scores a normal batch correctly afterwards.
"""

import dataclasses
import json
import time
from pathlib import Path

import pytest

from caspo.config.schema import RewardConfig
from caspo.reward import RewardPool

# pytest-timeout's default "signal" method shares SIGALRM with math-verify; use threads.
pytestmark = pytest.mark.timeout(120, method="thread")

CORPUS = Path(__file__).parent / "data" / "reward_adversarial.jsonl"
TIMEOUT_S = 2.0
MEMORY_MB = 1024
LABELS = ["42", r"\frac{1}{2}", r"\text{banana}", "x^2+1"]  # hostile answers equal none of them
NORMAL = [  # (response, label, reward): a healthy pool scores these right
    (r"so \boxed{42}.", "42", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\text{banana}}", r"\text{banana}", 1.0),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    (r"\boxed{41}", "42", 0.0),
]


def load_rows() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]


def hostile_answer(row: dict, canary: Path) -> str:
    if "answer" in row:
        return row["answer"].replace("{canary}", str(canary))
    return "".join(part if isinstance(part, str) else part[0] * part[1] for part in row["parts"])


def expand(rows: list[dict], canary: Path, extractor: str = "boxed") -> list[tuple[str, str, str, float | None]]:
    """(kind, response, label, expected reward or None for "any") for every pattern and wrapper."""
    cases = []
    for n, row in enumerate(rows):
        if "response" in row:
            if extractor == "boxed":
                cases.append((row["kind"], row["response"], "42", 0.0))
            continue
        answer, label = hostile_answer(row, canary), LABELS[n % len(LABELS)]
        # an answer that may read as 42 ("4\u200b2") is scored against 42, and only its disguises must score 0
        maybe = row.get("may_match", False)
        if maybe:
            label = "42"
        if extractor == "minerva":
            wrapped = {"minerva": f"Final Answer: The final answer is ${answer}$. I hope it is correct.",
                       "minerva-replaced": f"The final answer is $42$. No: the final answer is ${answer}$"}
        else:
            wrapped = {"boxed": f"Let me see. \\boxed{{{answer}}}", "dollars": f"The answer is ${answer}$.",
                       "bare": answer, "replaced": f"First \\boxed{{42}}. Wait, no: \\boxed{{{answer}}}"}
        for how, response in wrapped.items():
            committed = how in ("boxed", "replaced", "minerva", "minerva-replaced")
            cases.append((f"{row['kind']}/{how}", response, label, None if maybe and committed else 0.0))
    return cases


def run_corpus(pool: RewardPool, cases) -> tuple:
    _, responses, labels, _ = zip(*cases)
    start = time.perf_counter()
    result = pool.score(list(responses), list(labels), [True] * len(cases))
    return result, time.perf_counter() - start


def check_healthy(pool: RewardPool, normal) -> None:
    responses, labels, rewards = (list(x) for x in zip(*normal))
    healthy = pool.score(responses, labels, [True] * len(responses))
    assert healthy.rewards == rewards
    assert (healthy.timeouts, healthy.crashes, healthy.over_budget) == (0, 0, 0)


def check(result, cases, canary: Path) -> None:
    assert not canary.exists(), "model text was executed"
    wrong = [(kind, response[:80], reward) for (kind, response, _, expected), reward in zip(cases, result.rewards)
             if expected is not None and reward != expected]
    assert not wrong, f"{len(wrong)} hostile responses were rewarded: {wrong[:10]}"
    assert result.max_call_s <= TIMEOUT_S + 1.0, f"a call took {result.max_call_s:.2f} s"
    assert result.max_rss_mb < MEMORY_MB, f"a worker reached {result.max_rss_mb:.0f} MB"


def run_as_python(response: str, label: str, finished: bool = True, timeout_s: float | None = None) -> float:
    """An unsafe score function: it runs the response as Python code (reward 0 whatever it does)."""
    try:
        exec(response, {})
    except Exception:
        pass
    return 0.0


def test_the_canary_can_be_written(tmp_path):
    """The check is not vacuous: the corpus's injections, run as code in a worker of a pool with the same limits,
    create the canary where the tests look for it."""
    canary = tmp_path / "canary"
    injections = [response for kind, response, *_ in expand(load_rows(), canary) if kind == "injection/bare"]
    assert len(injections) >= 10
    with RewardPool(workers=2, timeout_s=TIMEOUT_S, score_fn=run_as_python, memory_mb=MEMORY_MB) as pool:
        result = pool.score(injections, ["42"] * len(injections), [True] * len(injections))
    assert result.rewards == [0.0] * len(injections) and (result.timeouts, result.crashes) == (0, 0)
    assert canary.exists(), "no injection of the corpus created the canary when run"


def test_hostile_responses_through_the_pool(tmp_path):
    canary = tmp_path / "canary"
    cases = expand(load_rows(), canary)
    assert len(cases) >= 200
    kinds = {kind.split("/")[0] for kind, *_ in cases}
    assert kinds >= {"injection", "tower", "factorial", "nesting", "megabyte", "unicode_digits", "control", "hedged",
                     "replaced", "disowned"}
    cfg = dataclasses.replace(RewardConfig(), workers=2, timeout_s=TIMEOUT_S, worker_memory_mb=MEMORY_MB)
    with RewardPool.from_config(cfg) as pool:
        result, elapsed = run_corpus(pool, cases)
        print(f"\nadversarial corpus: {len(cases)} responses in {elapsed:.1f} s; longest call "
              f"{result.max_call_s:.2f} s; peak worker RSS {result.max_rss_mb:.0f} MB; timeouts {result.timeouts}, "
              f"crashes {result.crashes}")
        check(result, cases, canary)
        check_healthy(pool, NORMAL)


def test_hostile_answers_through_the_minerva_extractor(tmp_path):
    canary = tmp_path / "canary"
    cases = expand(load_rows(), canary, extractor="minerva")
    cfg = dataclasses.replace(RewardConfig(), workers=2, timeout_s=TIMEOUT_S, worker_memory_mb=MEMORY_MB,
                              extractor="minerva")
    with RewardPool.from_config(cfg) as pool:
        result, elapsed = run_corpus(pool, cases)
        print(f"\nminerva corpus: {len(cases)} responses in {elapsed:.1f} s; longest call {result.max_call_s:.2f} s; "
              f"peak worker RSS {result.max_rss_mb:.0f} MB")
        check(result, cases, canary)
        check_healthy(pool, [("Final Answer: The final answer is $42$. I hope it is correct.", "42", 1.0),
                             ("The final answer is $\\frac{1}{2}$", "0.5", 1.0), (r"\boxed{42}", "42", 0.0)])
