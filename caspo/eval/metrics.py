"""Benchmark metrics over K samples per problem: pure functions of rewards and answers (docs/eval.md).

    avg@K   mean over problems of c/n, the fraction of a problem's n samples that are correct
    pass@k  mean over problems of 1 - C(n-c, k) / C(n, k): the chance that k samples drawn without
            replacement from the n contain a correct one (Chen et al. 2021), for every k <= n
    maj@K   fraction of problems whose majority answer (over the samples' extracted, normalised
            answers) is correct; ties go to the answer seen first in sample order
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from caspo.reward.prefilter import MAX_ANSWER_CHARS

_SPACING = re.compile(r"\\[,;:!> ]|\\(?:left|right|displaystyle|textstyle)(?![A-Za-z])|\s+")
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\{([^{}]*)\}")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DECIMAL = re.compile(r"^-?\d+\.\d+$")


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i): no large binomials."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(counts: Sequence[int], n: int, k: int) -> float:
    """pass@k averaged over problems, each with n samples of which counts[i] are correct."""
    return sum(pass_at_k(n, c, k) for c in counts) / len(counts)


def avg_at_k(rewards: Sequence[Sequence[float]]) -> float:
    """Mean over problems of the mean reward of that problem's samples."""
    return sum(sum(r) / len(r) for r in rewards) / len(rewards)


def normalize_answer(answer: str) -> str:
    """A string normal form for voting: no spacing or \\left/\\right, \\text{x} -> x, \\dfrac -> \\frac,
    no trailing period, no outer $ or braces, "1,000" -> "1000", "2.50" -> "2.5"."""
    text = answer.strip().rstrip(".").strip("$")
    text = _WRAPPERS.sub(r"\1", text)
    text = _SPACING.sub("", text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").rstrip(".")
    text = _without_outer_braces(text)
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    if _DECIMAL.match(text):
        text = text.rstrip("0").rstrip(".")
    return text


def _without_outer_braces(text: str) -> str:
    """`{{x}}` -> `x`: every pair of braces around the whole text taken off, in one pass (peeling them one
    at a time, checking the rest each time, is quadratic in their depth). `{a}{b}` keeps its braces.

    k pairs wrap the text when it opens with k `{` and closes with k `}`, its braces balance, and between
    those runs the depth never falls below k: so k is the least of the two runs and that lowest depth."""
    opening, closing = len(text) - len(text.lstrip("{")), len(text) - len(text.rstrip("}"))
    if not opening or not closing:
        return text
    depth, lowest = 0, opening
    for i, char in enumerate(text):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if opening <= i + 1 <= len(text) - closing:  # the depths between the runs
            lowest = min(lowest, depth)
    if depth != 0:
        return text
    pairs = max(0, min(opening, closing, lowest))
    return text[pairs:len(text) - pairs]


def majority_vote(answers: Sequence[str | None], max_answer_chars: int = MAX_ANSWER_CHARS) -> int | None:
    """Index of the first sample of the most common normalised answer; None where no sample has one.

    None entries (no answer, or a truncated sample) do not vote, nor do answers longer than
    `max_answer_chars` (reward.max_answer_chars: the verifier refuses them, and normalising them costs time).
    Ties go to the answer whose first sample comes first, so the vote is deterministic given the samples.
    """
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, answer in enumerate(answers):
        if answer is None or len(answer) > max_answer_chars:
            continue
        key = normalize_answer(answer)
        if not key:
            continue
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, i)
    if not counts:
        return None
    best = max(counts, key=lambda key: (counts[key], -first[key]))
    return first[best]


def sample_metrics(rewards: Sequence[Sequence[float]], answers: Sequence[Sequence[str | None]],
                   max_answer_chars: int = MAX_ANSWER_CHARS) -> dict:
    """avg@K, pass@k for every k <= K, and maj@K over problems with K samples each.

    rewards[i][s] is 1.0 when sample s of problem i is correct; answers[i][s] is its extracted answer
    (None when it has none or was truncated; answers longer than `max_answer_chars` do not vote either).
    The voted answer is judged by its first sample's reward.
    """
    if not rewards or len(rewards) != len(answers):
        raise ValueError(f"need as many problems of rewards as of answers (> 0), got {len(rewards)}, {len(answers)}")
    K = len(rewards[0])
    if any(len(r) != K for r in rewards) or any(len(a) != K for a in answers):
        raise ValueError(f"every problem needs the same number of samples ({K})")
    counts = [sum(1 for x in r if x > 0.5) for r in rewards]
    out = {f"avg@{K}": avg_at_k(rewards)}
    out |= {f"pass@{k}": mean_pass_at_k(counts, K, k) for k in range(1, K + 1)}
    votes = [majority_vote(a, max_answer_chars) for a in answers]
    out[f"maj@{K}"] = sum(r[v] > 0.5 for r, v in zip(rewards, votes) if v is not None) / len(rewards)
    return out
