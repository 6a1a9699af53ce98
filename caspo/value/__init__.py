"""Value estimation: Monte Carlo step values (VinePPO) and phase 1 of CASPO (labels, training, probes).

Only the light, dependency-free parts are imported here, so the trainer can use
``caspo.value.mc`` without loading phase-1 tooling; import ``caspo.value.collect``,
``.train``, ``.probe`` and ``.cli`` directly.
"""

from caspo.value.mc import (
    MCValues,
    Prefix,
    PrefixEstimates,
    continuation_seed,
    estimate_prefixes,
    mc_step_values,
    prefix_key,
    step_start_indices,
)
from caspo.value.metrics import rankdata, roc_auc, spearman, value_metrics

__all__ = [
    "MCValues",
    "Prefix",
    "PrefixEstimates",
    "continuation_seed",
    "estimate_prefixes",
    "mc_step_values",
    "prefix_key",
    "rankdata",
    "roc_auc",
    "spearman",
    "step_start_indices",
    "value_metrics",
]
