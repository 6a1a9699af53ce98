"""What the verifier costs on hostile and on random answers (docs/reliability.md, "Verifier").

Two parts, scored inline in this process (caspo.reward.verify.score, math-verify's alarms at
--timeout seconds), one call at a time:

    named     answers that cost seconds or hundreds of megabytes before the pre-filter existed,
              each timed and with the pre-filter's reason
    fuzz      for --seconds, random strings of LaTeX tokens (up to 300 characters) whose braces
              balance (a box holds them whole) and that the pre-filter lets through, boxed and
              scored against one of three labels: the slowest calls, so that what passes is cheap

    python benchmarks/reward_cost.py --seconds 120 --commit $COMMIT
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from datetime import datetime, timezone

from caspo.reward.extract import last_boxed
from caspo.reward.prefilter import hedged, too_costly
from caspo.reward.verify import VERIFIER_VERSION, score

NAMED = [r"2^{300000007}", r"(2^{100000})^{100000}", r"10^{10^{10}}", r"9^{9^{9}}", r"(10!)!",
         r"\binom{1000000}{500000}", r"\Gamma(10^{8})", r"(x+1)^{1000}", "{" * 12 + "1" + "}" * 12,
         "(" * 20 + "1" + ")" * 20, "x^2".join(["a"] * 250), "9" * 1_000_000]
TOKENS = ["x", "y", "2", "3", "10", "+", "-", r"\cdot", "^", "^{", "{", "}", "(", ")", "[", "]", r"\frac{",
          r"\sqrt{", "!", ",", "=", r"\pi", "e", r"\infty", r"\le", r"\{", r"\}", "|", "_", r"\binom{", r"\sin",
          r"\log", r"\%", r"\text{ cm}", "0.5", "99", r"\left(", r"\right)", " "]
LABELS = ["7", "x+1", r"\frac{1}{2}"]


def timed(answer: str, label: str, timeout: float) -> float:
    start = time.perf_counter()
    score(f"\\boxed{{{answer}}}", label, timeout_s=timeout)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="how long the fuzz part runs")
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default="")
    parser.add_argument("--out", default="", help="append one JSON line of results to this file")
    args = parser.parse_args()
    timed(r"\frac12", "0.5", args.timeout)  # imports, caches

    print(f"{'answer':42} {'seconds':>8}  refused because")
    for answer in NAMED:
        print(f"{answer[:40]!r:42} {timed(answer, '7', args.timeout):8.3f}  {too_costly(answer)}")

    rng, times, refused = random.Random(args.seed), [], 0
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        answer = "".join(rng.choice(TOKENS) for _ in range(rng.randint(5, 120)))[:300].strip()
        if last_boxed(f"\\boxed{{{answer}}}") != answer:
            continue  # unbalanced: the box would not hold it
        if too_costly(answer) or hedged(answer):
            refused += 1
            continue
        times.append((timed(answer, rng.choice(LABELS), args.timeout), answer))
    times.sort(reverse=True)
    print(f"\nfuzz: {len(times)} answers scored, {refused} refused by the pre-filter; slowest "
          f"{', '.join(f'{t:.2f}' for t, _ in times[:5])} s; median {times[len(times) // 2][0] * 1e3:.2f} ms")
    print(f"slowest: {times[0][1]!r}")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"bench": "reward_cost", "date": datetime.now(timezone.utc).isoformat(),
                                "commit": args.commit, "cpu": platform.processor() or platform.machine(),
                                "verifier": VERIFIER_VERSION, "fuzz_scored": len(times), "fuzz_refused": refused,
                                "slowest_s": [round(t, 3) for t, _ in times[:5]]}) + "\n")


if __name__ == "__main__":
    main()
