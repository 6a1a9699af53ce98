"""Monte Carlo step values: dedup, budgets, length hits, shapes, seeds (hand-computed with a scripted engine)."""

import hashlib

import pytest
import torch

from caspo.rollout.base import Completion, SamplingParams
from caspo.train.monte_carlo import (
    Prefix,
    continuation_budget,
    continuation_seed,
    estimate_prefixes,
    mc_step_values,
    prefix_key,
    step_start_indices,
)

SAMPLING = SamplingParams(temperature=1.0, stop_token_ids=[1])
WIN, LOSE = 9, 8  # a continuation ending in WIN is correct


class ScriptedEngine:
    """Continuation k of a request is script(prompt_ids, k): (tokens, finish_reason); seeds are k."""

    def __init__(self, script=None):
        self.script = script or (lambda ids, k: ([WIN] if k % 2 == 0 else [LOSE], "stop"))
        self.requests = []

    def generate(self, requests, sampling, on_finish=None):
        self.requests += list(requests)
        out = []
        for r in requests:
            tokens, finish = self.script(r.prompt_ids, r.seed)
            out.append(Completion(tokens, [0.0] * len(tokens), finish, 0))
        if on_finish is not None:  # finished in reverse order, as a continuous batch may end them
            for i in reversed(range(len(out))):
                on_finish(i, out[i])
        return out


def decode(ids):
    return " ".join(map(str, ids))


def scorer(texts, labels, finished):
    return [1.0 if t.endswith(str(WIN)) else 0.0 for t in texts]


def run(engine, prompts, responses, starts, labels, k=4, budget=10):
    return mc_step_values(engine, prompts, responses, starts, labels, k=k, sampling=SAMPLING, max_new_tokens=budget,
                          seed_fn=lambda key, j: j, scorer=scorer, decode=decode)


def test_identical_prefixes_are_estimated_once():
    # prompt [50, 51] has two responses sharing step 0; prompt [60] repeats response A's tokens
    prompts = [[50, 51], [50, 51], [60]]
    responses = [[2, 3, 4, 5], [2, 3, 6], [2, 3, 4, 5]]
    starts = [[0, 2], [0, 2], [0, 2]]
    engine = ScriptedEngine()
    out = run(engine, prompts, responses, starts, ["a", "a", "b"], k=4)
    # distinct prefixes: ([50,51], ()), ([50,51], (2,3)), ([60], ()), ([60], (2,3)) -> 4 of 6
    assert out.unique_prefixes == 4
    assert out.mc_requests == len(engine.requests) == 4 * 4
    assert sorted({tuple(r.prompt_ids) for r in engine.requests}) == [(50, 51), (50, 51, 2, 3), (60,), (60, 2, 3)]
    # the response prefix is the stop strings' context: a stop string it began ends the continuation
    assert {(tuple(r.prompt_ids), r.stop_context) for r in engine.requests} == {
        ((50, 51), 0), ((50, 51, 2, 3), 2), ((60,), 0), ((60, 2, 3), 2)}
    assert out.mc_tokens == 16  # one token per scripted continuation
    # k = 0, 2 win and k = 1, 3 lose: every V is 2/4
    assert torch.equal(out.values, torch.full((3, 2), 0.5))


def test_values_follow_the_script_and_v_prompt_is_shared():
    # continuations of the bare prompt win for k < 3; after step 0 they win only for k = 0
    script = lambda ids, k: ([WIN] if k < (3 if len(ids) == 2 else 1) else [LOSE], "stop")  # noqa: E731
    out = run(ScriptedEngine(script), [[50, 51]] * 2, [[2, 3, 4], [2, 7, 4]], [[0, 2], [0, 1]], ["a", "a"], k=4)
    assert out.values.tolist() == [[0.75, 0.25], [0.75, 0.25]]
    assert out.unique_prefixes == 3  # V(prompt) once, then (2, 3) and (2,)


def test_budget_is_what_the_response_had_left_and_length_hits_score_zero():
    # every continuation "wins" by text, but odd k hit the budget
    script = lambda ids, k: ([WIN], "stop" if k % 2 == 0 else "length")  # noqa: E731
    engine = ScriptedEngine(script)
    seen = []

    def recording_scorer(texts, labels, finished):
        seen.extend(finished)
        return [1.0] * len(texts)  # a scorer that ignores `finished` must not leak through

    out = mc_step_values(engine, [[50]], [[2, 3, 4, 5, 6]], [[0, 3]], ["a"], k=4, sampling=SAMPLING,
                         max_new_tokens=12, seed_fn=lambda key, j: j, scorer=recording_scorer, decode=decode)
    assert sorted({r.max_new_tokens for r in engine.requests}) == [9, 12]  # 12 - 3 after step 0, 12 at the prompt
    assert seen == [True, False] * 4
    assert out.values.tolist() == [[0.5, 0.5]]


def test_under_a_context_a_continuation_takes_upstreams_budget():
    # upstream VinePPO: min(max_new_tokens, context - prompt - prefix); a late prefix may pass the response budget
    engine = ScriptedEngine()
    mc_step_values(engine, [[50, 51]], [[2, 3, 4, 5, 6, 7]], [[0, 2, 5]], ["a"], k=2, sampling=SAMPLING,
                   max_new_tokens=6, seed_fn=lambda key, j: j, scorer=scorer, decode=decode, context_tokens=11)
    budgets = {len(r.prompt_ids) - 2: r.max_new_tokens for r in engine.requests}  # by the prefix's length
    assert budgets == {0: 6, 2: 6, 5: 4}  # min(6, 11 - 2 - 0), min(6, 11 - 2 - 2), min(6, 11 - 2 - 5)
    # what the response had left instead: 6, 4 and 1
    assert continuation_budget(Prefix((50, 51), (2, 3), "a"), 6) == 4
    assert continuation_budget(Prefix((50, 51), (2, 3, 4, 5, 6), "a"), 6) == 1
    with pytest.raises(ValueError, match="leaves no room in a context of 7"):
        estimate_prefixes(ScriptedEngine(), [Prefix((50, 51), (2, 3, 4, 5, 6), "a")], k=1, sampling=SAMPLING,
                          max_new_tokens=6, seed_fn=lambda key, j: j, scorer=scorer, decode=decode, context_tokens=7)


def test_shape_mask_and_no_value_after_the_last_step():
    engine = ScriptedEngine()
    out = run(engine, [[50], [51], [52]], [[2, 3, 4, 5], [2], []], [[0, 1, 3], [0], []], ["a", "b", "c"], k=2)
    assert out.values.shape == out.step_mask.shape == (3, 3)
    assert out.step_mask.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert out.values[out.step_mask == 0].eq(0).all()
    # one prefix per step, never the full response: 3 + 1 prefixes of 2 continuations
    assert len(engine.requests) == 8
    assert max(len(r.prompt_ids) for r in engine.requests) == 1 + 3


def test_estimates_do_not_depend_on_the_rest_of_the_batch():
    # a seed-dependent script, with content-derived seeds as in training
    script = lambda ids, k: ([WIN] if k % 3 == 0 else [LOSE], "stop")  # noqa: E731
    seed_fn = lambda key, j: continuation_seed(7, 3, key, j)  # noqa: E731
    common = dict(k=6, sampling=SAMPLING, max_new_tokens=10, seed_fn=seed_fn, scorer=scorer, decode=decode)
    alone = mc_step_values(ScriptedEngine(script), [[50]], [[2, 3]], [[0, 1]], ["a"], **common)
    batch = mc_step_values(ScriptedEngine(script), [[40], [50]], [[5, 5], [2, 3]], [[0, 1], [0, 1]], ["b", "a"],
                           **common)
    assert torch.equal(alone.values[0], batch.values[1])


def test_continuation_seeds_are_stable_and_distinct():
    """A prefix's key is blake2b-16 of its "prompt|response" token ids, a continuation's seed blake2b-8 of
    "run/step/mc/key/k" shifted into int64: fixed in every process and version (never the salted hash())."""
    key = prefix_key([1, 2], [3])
    assert key == hashlib.blake2b(b"1,2|3", digest_size=16).hexdigest()
    assert prefix_key([], [7, 10]) == hashlib.blake2b(b"|7,10", digest_size=16).hexdigest()
    assert key == prefix_key((1, 2), (3,)) != prefix_key([1], [2, 3])  # the prompt/response cut is part of it
    for run_seed, step, k in [(0, 1, 2), (5, 0, 0), (2**40, 17, 3)]:
        digest = hashlib.blake2b(f"{run_seed}/{step}/mc/{key}/{k}".encode(), digest_size=8).digest()
        assert continuation_seed(run_seed, step, key, k) == int.from_bytes(digest, "little") >> 1
    seeds = {continuation_seed(r, s, key, k) for r in range(2) for s in range(2) for k in range(3)}
    assert len(seeds) == 12 and all(0 <= s < 2**63 for s in seeds)


def test_step_start_indices():
    assert step_start_indices([0, 0, 1, 1, 1, 2]) == [0, 2, 5]
    assert step_start_indices([]) == []
    with pytest.raises(ValueError, match="without gaps"):
        step_start_indices([0, 2])


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="first step must start at token 0"):
        run(ScriptedEngine(), [[50]], [[2, 3]], [[1]], ["a"])
    with pytest.raises(ValueError, match="increase and lie inside"):
        run(ScriptedEngine(), [[50]], [[2, 3]], [[0, 2]], ["a"])
    with pytest.raises(ValueError, match="two labels"):
        run(ScriptedEngine(), [[50], [50]], [[2], [2]], [[0], [0]], ["a", "b"])
    with pytest.raises(ValueError, match="leaves no room"):
        estimate_prefixes(ScriptedEngine(), [Prefix((50,), (2, 3), "a")], k=1, sampling=SAMPLING, max_new_tokens=2,
                          seed_fn=lambda key, j: j, scorer=scorer, decode=decode)


def test_check_z_scores_and_planted_line():
    from caspo.value.mc_check import planted_line, z_scores

    # V = 3/9, q = 5/16: pooled (3 + 5)/25 = 0.32, var = 0.32·0.68·(1/9 + 1/16)
    z = z_scores([3 / 9, 1.0], [5 / 16, 1.0], k=9, m=16)
    assert z[0] == pytest.approx((3 / 9 - 5 / 16) / (0.32 * 0.68 * (1 / 9 + 1 / 16)) ** 0.5)
    assert z[1] is None  # every outcome agrees: no z
    assert planted_line("9 * 2 = 18\n18 - 4 = 14\n\\boxed{14}") == "9 * 2 = 19"


def test_the_check_on_the_embedded_policy_is_calibrated_and_a_wrong_first_line_has_no_value():
    """`caspo value check-mc` at a small size: V(prompt) from K continuations against M independent samples, and
    the tiny-arith policy building on a planted wrong result."""
    from caspo.config import ConfigError, load_config
    from caspo.value.mc_check import run_check

    cfg = load_config("tests")
    report = run_check(cfg, prompts=16, k=4, m=8, planted=8)
    assert report["n_with_z"] + report["degenerate_prompts"] == 16 and report["n_with_z"] >= 4
    assert report["calibration_passed"] and abs(report["mean_z"]) < report["bound_3_over_sqrt_n"]
    assert 0 < report["mean_v_prompt"] < 1 and report["mc_tokens"] > 0
    # the planted responses' V(prompt) comes through mc_step_values with the seeds of estimate_prefixes: equal
    assert report["planted_v_prompt_matches"] and report["planted_mean_v_prompt"] > 0
    assert report["planted_mean_v_after_wrong_line"] == 0.0 and report["planted_frac_exactly_zero"] == 1.0
    with pytest.raises(ConfigError, match="17 prompts asked for, eval.heldout_size gives 16"):
        run_check(cfg, prompts=17)


# ---------------------------------------------------------------- scoring while generating
def test_scoring_while_generating_gives_the_same_values():
    script = lambda ids, k: ([WIN], "stop" if k % 3 else "length") if k % 2 == 0 else ([LOSE], "stop")  # noqa: E731
    args = ([[50], [51]], [[2, 3, 4], [2, 7]], [[0, 2], [0, 1]], ["a", "b"])
    common = dict(k=6, sampling=SAMPLING, max_new_tokens=10, seed_fn=lambda key, j: j, scorer=scorer, decode=decode)
    plain = mc_step_values(ScriptedEngine(script), *args, **common)
    overlapped = mc_step_values(ScriptedEngine(script), *args, **common, score_while_generating=True)
    assert torch.equal(plain.values, overlapped.values) and torch.equal(plain.step_mask, overlapped.step_mask)
    assert plain.values[0, 0] == pytest.approx(2 / 6)  # k = 2, 4 win; k = 0 hit the budget


class HalfwayEngine:
    """Reports the first half of its completions, then waits (up to 10 s) for the scorer to have been called."""

    def __init__(self, scored):
        self.scored, self.waited = scored, None

    def generate(self, requests, sampling, on_finish=None):
        out = [Completion([WIN], [0.0], "stop", 0) for _ in requests]
        half = len(out) // 2
        for i in range(half):
            on_finish(i, out[i])
        self.waited = self.scored.wait(timeout=10)
        for i in range(half, len(out)):
            on_finish(i, out[i])
        return out


def test_the_scorer_starts_before_the_engine_returns():
    import threading

    scored, calls = threading.Event(), []

    def recording_scorer(texts, labels, finished):
        calls.append(len(texts))
        scored.set()
        return [1.0] * len(texts)

    engine = HalfwayEngine(scored)
    est = estimate_prefixes(engine, [Prefix((50,), (), "a")], k=8, sampling=SAMPLING, max_new_tokens=4,
                            seed_fn=lambda key, j: j, scorer=recording_scorer, decode=decode,
                            score_while_generating=True)
    assert engine.waited  # the first half was scored while the engine still ran
    assert sum(calls) == 8 and len(calls) >= 2
    assert est.means == [1.0]


def test_a_scorer_error_or_an_unreported_continuation_reaches_the_caller():
    def broken(texts, labels, finished):
        raise ValueError("verifier broke")

    common = dict(k=2, sampling=SAMPLING, max_new_tokens=4, seed_fn=lambda key, j: j, decode=decode,
                  score_while_generating=True)
    with pytest.raises(ValueError, match="verifier broke"):
        estimate_prefixes(ScriptedEngine(), [Prefix((50,), (), "a")], scorer=broken, **common)

    class Silent(ScriptedEngine):
        def generate(self, requests, sampling, on_finish=None):
            return super().generate(requests, sampling)  # never reports

    with pytest.raises(RuntimeError, match="never handed to the scorer"):
        estimate_prefixes(Silent(), [Prefix((50,), (), "a")], scorer=scorer, **common)
