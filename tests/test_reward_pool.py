"""RewardPool: order, agreement with inline scoring, speed, surviving hangs and crashes, and its
limits (memory, recycling, the batch budget)."""

import dataclasses
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from caspo.config.schema import RewardConfig
from caspo.reward import RewardPool, score
from caspo.reward import pool as pool_module
from caspo.reward.prefilter import MAX_ANSWER_CHARS
from caspo.reward.testing import ALLOCATE, CRASH, HANG, faulty_score

# pytest-timeout's default "signal" method shares SIGALRM with math-verify; use threads.
pytestmark = pytest.mark.timeout(60, method="thread")

REPO = Path(__file__).resolve().parents[1]

CASES = [  # (response, label, finished, expected reward)
    (r"\boxed{\frac{1}{2}}", "0.5", True, 1.0),
    (r"\boxed{3} no: \boxed{2}", "2", True, 1.0),
    (r"\boxed{3} no: \boxed{2}", "3", True, 0.0),
    ("The total is 1,450,000.", "1450000", True, 0.0),  # no box: no answer (no last-number fallback)
    (r"\boxed{\$18}", "18", True, 1.0),
    (r"\boxed{-7}", "7", True, 0.0),
    (r"\boxed{42}", "42", False, 0.0),
    ("no answer at all", "5", True, 0.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", True, 1.0),
]


@pytest.fixture(scope="module")
def pool():
    with RewardPool(workers=2, timeout_s=1.0, score_fn=faulty_score) as pool:
        yield pool


def batch(cases):
    responses, labels, finished, expected = zip(*cases)
    return list(responses), list(labels), list(finished), list(expected)


def test_results_in_input_order_and_equal_to_inline(pool):
    cases = CASES * 3
    responses, labels, finished, expected = batch(cases)
    result = pool.score(responses, labels, finished)
    assert result.rewards == expected
    assert result.rewards == [score(*case[:3]) for case in cases]
    assert (result.timeouts, result.crashes) == (0, 0)


def test_inline_pool_matches(pool):
    responses, labels, finished, expected = batch(CASES)
    assert RewardPool(workers=0).score(responses, labels, finished).rewards == expected


def test_256_integer_answers_are_fast(pool):
    responses = [f"... so the answer is \\boxed{{{i}}}." for i in range(256)]
    labels = [str(i if i % 2 else i + 1) for i in range(256)]
    pool.score(responses[:8], labels[:8], [True] * 8)  # warm up
    start = time.perf_counter()
    result = pool.score(responses, labels, [True] * 256)
    elapsed = time.perf_counter() - start
    assert result.rewards == [float(i % 2) for i in range(256)]
    assert elapsed < 0.5, f"256 answers took {elapsed:.3f} s"


def test_hang_times_out_counts_and_pool_recovers(pool):
    responses, labels, finished, expected = batch(CASES)
    start = time.perf_counter()
    result = pool.score([HANG] + responses, ["1"] + labels, [True] + finished)
    assert time.perf_counter() - start < 6  # 1 s limit + 1 s grace + a worker restart
    assert result.rewards == [0.0] + expected
    assert (result.timeouts, result.crashes) == (1, 0)

    again = pool.score(responses, labels, finished)
    assert again.rewards == expected and again.timeouts == 0


def test_two_hangs_at_once(pool):
    responses, labels, finished, expected = batch(CASES)
    result = pool.score([HANG, HANG] + responses, ["1", "1"] + labels, [True, True] + finished)
    assert result.rewards == [0.0, 0.0] + expected
    assert result.timeouts == 2


def test_crash_is_counted_and_pool_recovers(pool):
    responses, labels, finished, expected = batch(CASES)
    result = pool.score(responses + [CRASH], labels + ["1"], finished + [True])
    assert result.rewards == expected + [0.0]
    assert (result.timeouts, result.crashes) == (0, 1)
    assert pool.score(responses, labels, finished).rewards == expected


def test_bad_arguments():
    with pytest.raises(ValueError, match="lengths differ: 1 responses, 2 labels, 1 finished"):
        RewardPool(workers=0).score(["a"], ["1", "2"], [True])
    with pytest.raises(RuntimeError, match="RewardPool is not started: use it as a context manager"):
        RewardPool(workers=1).score(["a"], ["1"], [True])  # not started
    with pytest.raises(ValueError, match="need workers >= 0 and timeout_s > 0, got -1,"):
        RewardPool(workers=-1)
    with pytest.raises(TypeError, match="labels must be strings"):
        RewardPool(workers=0).score(["a"], [18], [True])


def test_workers_do_not_import_torch_even_if_the_main_script_does(tmp_path):
    # A spawn/forkserver child would re-import this main script, and torch with it.
    (tmp_path / "probe.py").write_text(textwrap.dedent("""
        import sys

        def torch_loaded(response, label, finished, timeout_s):
            return float("torch" in sys.modules)
    """))
    (tmp_path / "main.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path[1:1] = [{str(REPO)!r}]
        import torch
        import probe
        from caspo.reward import RewardPool

        with RewardPool(workers=1, score_fn=probe.torch_loaded) as pool:
            print(pool.score(["x"], ["1"], [True]).rewards)
    """))
    out = subprocess.run([sys.executable, str(tmp_path / "main.py")], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0.0]"


def test_config_defaults_agree_with_the_pool():
    cfg = RewardConfig()
    assert cfg.worker_memory_mb is None  # the pool's default limit, where the platform has one
    assert (cfg.recycle_after, cfg.recycle_rss_mb, cfg.batch_budget_s) == (
        pool_module.DEFAULT_RECYCLE_AFTER, pool_module.DEFAULT_RECYCLE_RSS_MB, pool_module.DEFAULT_BATCH_BUDGET_S)
    assert cfg.max_answer_chars == MAX_ANSWER_CHARS
    assert (cfg.extractor, cfg.fallback) == ("boxed", "none")
    built = RewardPool.from_config(cfg)
    assert (built.memory_mb, built.memory_required) == (pool_module.DEFAULT_WORKER_MEMORY_MB, False)
    old = RewardPool(cfg.workers, cfg.timeout_s)  # the old signature: the same limits
    assert (old.memory_mb, old.recycle_after, old.recycle_rss_mb, old.batch_budget_s) == \
        (built.memory_mb, built.recycle_after, built.recycle_rss_mb, built.batch_budget_s)


def test_from_config_binds_the_extraction_options():
    minerva = "Final Answer: The final answer is $\\frac{1}{2}$. I hope it is correct."
    cfg = dataclasses.replace(RewardConfig(), workers=1, extractor="minerva", fallback="last_number")
    with RewardPool.from_config(cfg) as pool:
        result = pool.score([minerva, "so it is 0.5", r"\boxed{0.5}"], ["0.5"] * 3, [True] * 3)
    assert result.rewards == [1.0, 1.0, 1.0]  # the box is read as text with a number in it
    with pytest.raises(ValueError, match="reward.extractor"):
        RewardPool.from_config(dataclasses.replace(RewardConfig(), extractor="last"))


def test_workers_are_recycled_after_n_calls():
    with RewardPool(workers=1, timeout_s=1.0, recycle_after=2) as pool:
        first = pool.worker_pids()
        result = pool.score([r"\boxed{1}"] * 5, ["1"] * 5, [True] * 5)
        assert result.rewards == [1.0] * 5 and result.recycled == 2
        assert pool.worker_pids() != first
        assert pool.score([r"\boxed{2}"], ["2"], [True]).rewards == [1.0]


def test_workers_are_recycled_above_the_rss_bound():
    with RewardPool(workers=1, timeout_s=1.0, recycle_rss_mb=1) as pool:  # every worker holds more than 1 MB
        result = pool.score([r"\boxed{1}", r"\boxed{2}"], ["1", "1"], [True, True])
    assert result.rewards == [1.0, 0.0] and result.recycled == 2
    assert 10 < result.max_rss_mb < 2048


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_memory_limit_is_in_force_and_survivable():
    with RewardPool(workers=1, timeout_s=2.0, score_fn=faulty_score, memory_mb=512) as pool:
        (pid,) = pool.worker_pids()
        limits = Path(f"/proc/{pid}/limits").read_text()
        assert any(line.startswith("Max address space") and str(512 * 2**20) in line for line in limits.splitlines())
        result = pool.score([ALLOCATE + "100", ALLOCATE + "1024", r"\boxed{3}"], ["1", "1", "3"], [True] * 3)
        assert result.rewards == [1.0, 0.0, 1.0]  # the allocation past the limit failed inside the call
        assert (result.crashes, result.timeouts) == (0, 0) and pool.worker_pids() == [pid]
        assert result.max_rss_mb < 512


def test_a_memory_limit_too_low_is_a_clear_error():
    with pytest.raises(RuntimeError, match="reward.worker_memory_mb=16 is below"):
        RewardPool(workers=1, memory_mb=16).start()


def test_batch_budget_zeroes_and_counts_unfinished_calls_and_the_pool_recovers():
    responses, labels, finished, expected = batch(CASES)
    with RewardPool(workers=1, timeout_s=5.0, score_fn=faulty_score, batch_budget_s=1.0) as pool:
        start = time.perf_counter()
        result = pool.score([HANG] + responses, ["1"] + labels, [True] + finished)
        assert time.perf_counter() - start < 2.0
        assert result.rewards == [0.0] * (1 + len(responses))
        assert (result.over_budget, result.timeouts) == (1 + len(responses), 0)
        again = pool.score(responses, labels, finished)  # its replacement starts within this batch's budget
        assert again.rewards == expected and again.over_budget == 0


def test_inline_pool_keeps_the_budget():
    result = RewardPool(workers=0, batch_budget_s=1e-9).score([r"\boxed{1}"] * 3, ["1"] * 3, [True] * 3)
    assert result.rewards == [0.0] * 3 and result.over_budget == 3


def test_a_scoring_thread_over_the_pool_survives_a_hang_and_a_crash(pool):
    from caspo.reward.scoring_thread import ScoringThread

    cases = [*CASES, (HANG, "1", True, 0.0), *CASES[:2], (CRASH, "1", True, 0.0), *CASES[2:]]
    responses, labels, finished, expected = batch(cases)
    scorer = lambda texts, labels, finished: pool.score(texts, labels, finished).rewards  # noqa: E731
    with ScoringThread(scorer, len(cases)) as thread:
        for i in reversed(range(len(cases))):  # handed over one at a time, out of order, off the main thread
            thread.put(i, responses[i], labels[i], finished[i])
        rewards = thread.rewards()
    assert rewards == expected
