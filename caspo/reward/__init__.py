"""Final-answer reward for verifiable math (math-verify, run in worker processes); docs/reliability.md."""

from caspo.reward.extract import EXTRACTORS, FALLBACKS, extract_answer, has_box, last_boxed, last_number, minerva_answer
from caspo.reward.labels import normalize_text, text_label
from caspo.reward.pool import RewardPool, RewardResult, TallyingScorer, Unscored
from caspo.reward.prefilter import too_costly
from caspo.reward.verify import VERIFIER_VERSION, Verdict, check_label, judge, score

__all__ = [
    "EXTRACTORS",
    "FALLBACKS",
    "VERIFIER_VERSION",
    "RewardPool",
    "RewardResult",
    "TallyingScorer",
    "Unscored",
    "Verdict",
    "check_label",
    "extract_answer",
    "has_box",
    "judge",
    "last_boxed",
    "last_number",
    "minerva_answer",
    "normalize_text",
    "score",
    "text_label",
    "too_costly",
]
