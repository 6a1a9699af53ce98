"""RewardPool: order, agreement with inline scoring, speed, and surviving hangs and crashes."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from caspo.reward import RewardPool, score
from caspo.reward.testing import CRASH, HANG, faulty_score

# pytest-timeout's default "signal" method shares SIGALRM with math-verify; use threads.
pytestmark = pytest.mark.timeout(60, method="thread")

REPO = Path(__file__).resolve().parents[1]

CASES = [  # (response, label, finished, expected reward)
    (r"\boxed{\frac{1}{2}}", "0.5", True, 1.0),
    (r"\boxed{3} no: \boxed{2}", "2", True, 1.0),
    (r"\boxed{3} no: \boxed{2}", "3", True, 0.0),
    ("The total is 1,450,000.", "1450000", True, 1.0),
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
    with pytest.raises(ValueError):
        RewardPool(workers=0).score(["a"], ["1", "2"], [True])
    with pytest.raises(RuntimeError):
        RewardPool(workers=1).score(["a"], ["1"], [True])  # not started
    with pytest.raises(ValueError):
        RewardPool(workers=-1)
    with pytest.raises(TypeError):
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
