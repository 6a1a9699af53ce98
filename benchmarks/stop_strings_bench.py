"""The host's cost of stop strings per running sequence and step: the token filter against decoding the window.

Each of --rows MATH-500 reference solutions, in Qwen2.5's BPE tokens, is checked at every position as if
it arrived one token a step (the rho1b-math preset's stop string by default), once through `StopStrings`
and once decoding the last 32 tokens every step, as the engines did before it. Prints microseconds a check
(times rows is the host's cost of a decode step) and that both found the same stops.

    python benchmarks/stop_strings_bench.py [--stop "\\n\\n\\nProblem:" --stop "</answer>"]
"""

from __future__ import annotations

import argparse
import json
import time

from caspo.data.registry import SHIPPED
from caspo.models.bpe import build_qwen_tokenizer
from caspo.rollout.stop_strings import WINDOW, StopStrings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stop", action="append",
                        help="a stop string with Python's escapes, e.g. '\\n' (repeatable)")
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=200, help="positions checked per solution")
    args = parser.parse_args()
    strings = [s.encode().decode("unicode_escape") for s in (args.stop or ["\\n\\n\\nProblem:"])]
    tokenizer = build_qwen_tokenizer()
    lines = SHIPPED["math500"].path.read_text().splitlines()[:args.rows]
    solutions = [tokenizer.encode(json.loads(line)["solution"])[:args.tokens] for line in lines]

    def full(tokens: list[int]) -> bool:
        tail = tokenizer.decode(tokens[-WINDOW:])
        return any(tail.endswith(s) for s in strings)

    found, seconds, checks = {}, {}, sum(len(s) for s in solutions)
    for name in ("filter", "full"):
        stops = StopStrings(strings, tokenizer.decode)
        check = stops.ended if name == "filter" else full
        started = time.perf_counter()
        found[name] = [next((t for t in range(1, len(s) + 1) if check(s[:t])), None) for s in solutions]
        seconds[name] = time.perf_counter() - started
    print(f"stop strings {strings!r}, {len(solutions)} solutions, {checks:,} checks")
    for name in seconds:
        print(f"{name:>6}: {seconds[name] / checks * 1e6:.2f} µs a check")
    print(f"same stops: {found['filter'] == found['full']} ({sum(t is not None for t in found['full'])} stopped)")


if __name__ == "__main__":
    main()
