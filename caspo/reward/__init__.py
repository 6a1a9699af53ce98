"""Final-answer reward for verifiable math (math-verify, run in worker processes)."""

from caspo.reward.extract import extract_answer, last_boxed, last_number
from caspo.reward.pool import RewardPool, RewardResult
from caspo.reward.verify import VERIFIER_VERSION, check_label, score

__all__ = [
    "VERIFIER_VERSION",
    "RewardPool",
    "RewardResult",
    "check_label",
    "extract_answer",
    "last_boxed",
    "last_number",
    "score",
]
