"""Phase 1 of CASPO: Monte Carlo step labels, prefix-value training, probes, and the periodic refresh.

The modules are imported directly (``caspo.value.collect``, ``.train``, ``.probe``, ``.refresh``,
``.cli``); the Monte Carlo estimator they share with VinePPO is ``caspo.train.monte_carlo``.
"""
