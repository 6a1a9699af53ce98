"""Sampler micro-benchmark: the top-p threshold by sorting (before) against the sort-free search (now).

One decode step's logits, [256 × 151,936] float32 by default, random with std 1 (nearly flat,
as a random-init model's: the 0.9 nucleus holds about half the vocabulary) and std 8 (peaked),
at temperature 0.6. Timed with CUDA events after a warm-up, each figure the mean of --reps:

    sort threshold            the previous nucleus_threshold (sort, softmax, cumsum)
    search                    nucleus_threshold for each --pivots, called and replayed from a CUDA graph, its
                              passes two Triton kernels each; and the whole sampler with it, from a graph
    search, gathered after c  the search replayed from a graph, small intervals finished by a sort after c
                              passes, for each --collect-after (99: never)
    search, c passes screened the search replayed from a graph, its first c passes decided on float32 sums
                              where those surely decide, for each --screened (0: int64 sums alone)
    sample_next old / new     the whole sampler after the logits at top-p 0.9 and 1.0: the cut by
                              sorting and the Gumbel pick compiled / the cut by the search and
                              the fused Triton pick; called, and replayed from a CUDA graph

--profile also prints, for each std, the kernels of 20 eager calls of the whole top-p sampler
(`sample_next`), with their device time: where a search's time goes, kernel by kernel.

Also prints how often the kept sets of the old and new thresholds differ, and how many of those
rows have their boundary within float32 rounding of top_p (a float64 sort decides). Appends one
JSON line to --out.

    python benchmarks/sampler_bench.py --out benchmarks/results.jsonl --commit $COMMIT
"""

from __future__ import annotations

import argparse
import functools
import platform
from datetime import datetime, timezone

import torch
from _common import append_result, kernel_profile, print_table

from caspo.rollout import sampling as sampling_module
from caspo.rollout.sampling import NUCLEUS_PIVOTS, gumbel_pick, nucleus_threshold, sample_next


def sorted_threshold(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The previous nucleus_threshold: sort every row, softmax, cumsum."""
    ordered = logits.sort(dim=-1, descending=True).values
    probs = torch.softmax(ordered, dim=-1)
    in_nucleus = (probs.cumsum(-1) - probs) < top_p
    return ordered.gather(-1, in_nucleus.sum(-1, keepdim=True) - 1)


@functools.cache
def compiled_pick():
    return torch.compile(gumbel_pick)


def old_sample_next(logits, seeds, positions, temperature: float, top_p: float):
    """The previous sample_next on CUDA (top_k = 0): the cut eager by sorting, the Gumbel pick compiled."""
    scaled = logits.float() / temperature
    threshold = scaled.new_full((scaled.shape[0], 1), float("-inf"))
    if top_p < 1.0:
        threshold = sorted_threshold(scaled, top_p)
    for tensor in (scaled, threshold, seeds, positions):
        torch._dynamo.mark_dynamic(tensor, 0)
    return compiled_pick()(scaled, threshold, seeds, positions)


def cuda_ms(fn, warmup: int, reps: int) -> float:
    """Mean milliseconds of fn() over reps, after warmup calls (compilation happens there)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def graphed(fn, warmup: int):
    """fn captured in a CUDA graph (after warm-up on a side stream): a function that replays it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _repeat(times: int, fn, *args, **kwargs) -> None:
    for _ in range(times):
        fn(*args, **kwargs)


def agreement(scaled: torch.Tensor, top_p: float) -> dict:
    """Rows whose kept sets differ between the sort and the search, and those of them near the boundary."""
    old = scaled >= sorted_threshold(scaled, top_p)
    new = scaled >= nucleus_threshold(scaled, top_p)
    exact = scaled >= sorted_threshold(scaled.double(), top_p).float()  # float64 sort: rounding ~1e-16
    x = scaled.double()
    p = torch.softmax(x, -1)
    threshold = sorted_threshold(x, top_p)
    margin = torch.minimum(top_p - (p * (x > threshold)).sum(-1), (p * (x >= threshold)).sum(-1) - top_p)
    differ = (old != new).any(-1)
    return {"rows": scaled.shape[0], "differ": int(differ.sum()),
            "differ_near_boundary_1e-5": int((differ & (margin < 1e-5)).sum()),
            "new_vs_float64_sort_differ": int((new != exact).any(-1).sum()),
            "old_vs_float64_sort_differ": int((old != exact).any(-1).sum()),
            "kept_mean": round(float(new.sum(-1).float().mean()), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--stds", default="1,8", help="standard deviations of the random logits")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--pivots", default=f"7,{NUCLEUS_PIVOTS},31", help="pivots per pass of the search to time")
    parser.add_argument("--collect-after", default=f"{sampling_module.NUCLEUS_COLLECT_AFTER},99",
                        help="passes before small intervals are gathered and sorted, to time (99: never)")
    parser.add_argument("--screened", default=f"{sampling_module.NUCLEUS_SCREENED_PASSES},0",
                        help="passes decided on float32 sums where those surely decide, to time (0: none)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="the kernels of 20 calls of the top-p sampler")
    parser.add_argument("--commit", default="", help="the code's commit, recorded with the figures")
    parser.add_argument("--out", default="", help="append one JSON line of results to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit("sampler_bench times CUDA kernels: it needs a CUDA device")

    timings, agreements, rows = {}, {}, []
    pivots = [int(m) for m in args.pivots.split(",")]
    for std in (float(s) for s in args.stds.split(",")):
        generator = torch.Generator(device=device).manual_seed(args.seed)
        logits = torch.randn(args.batch, args.vocab, device=device, generator=generator) * std
        seeds = torch.arange(args.batch, device=device) * 7919 + 17
        positions = torch.arange(args.batch, device=device) % 11
        scaled = logits / args.temperature
        top_p = args.top_p
        case = {}

        def measure(name, fn, capture=False):
            try:  # a failure (a capture that breaks, say) is printed and recorded; the rest still runs
                case[name] = round(cuda_ms(graphed(fn, args.warmup) if capture else fn, args.warmup, args.reps), 4)
            except RuntimeError as error:
                print(f"{name}: {type(error).__name__}: {str(error)[:300]}")
                case[name] = None

        measure("sort threshold", lambda: sorted_threshold(scaled, top_p))
        for m in pivots:
            measure(f"search (m={m})", functools.partial(nucleus_threshold, scaled, top_p, m))
            measure(f"search (m={m}), CUDA graph", functools.partial(nucleus_threshold, scaled, top_p, m),
                    capture=True)
        default = sampling_module.NUCLEUS_COLLECT_AFTER
        for c in (int(c) for c in args.collect_after.split(",")):
            sampling_module.NUCLEUS_COLLECT_AFTER = c  # read by nucleus_threshold at the call (here: the capture)
            measure(f"search, gathered after {c}, CUDA graph",
                    functools.partial(nucleus_threshold, scaled, top_p), capture=True)
        sampling_module.NUCLEUS_COLLECT_AFTER = default
        default = sampling_module.NUCLEUS_SCREENED_PASSES
        for c in (int(c) for c in args.screened.split(",")):
            sampling_module.NUCLEUS_SCREENED_PASSES = c  # read at the call, as above
            measure(f"search, {c} passes screened, CUDA graph",
                    functools.partial(nucleus_threshold, scaled, top_p), capture=True)
        sampling_module.NUCLEUS_SCREENED_PASSES = default
        for p in (top_p, 1.0):
            for label, sampler in (("old", old_sample_next), ("new", sample_next)):
                step = functools.partial(sampler, logits, seeds, positions, args.temperature, top_p=p)
                measure(f"sample_next {label}, top-p {p}", step)
                measure(f"sample_next {label}, CUDA graph, top-p {p}", step, capture=True)
        timings[f"std {std:g}"] = case
        if args.profile:
            calls = functools.partial(_repeat, 20, sample_next, logits, seeds, positions, args.temperature, top_p=top_p)
            print_table([f"kernel (20 samplers, std {std:g}, top-p {top_p})", "calls", "ms", "share"],
                        kernel_profile(calls, device, top=25))
            print()
        agreements[f"std {std:g}"] = agreement(scaled, top_p)

    names = list(next(iter(timings.values())))
    for name in names:
        rows.append([name] + ["-" if case[name] is None else f"{case[name]:.3f}" for case in timings.values()])
    print(f"[{args.batch} x {args.vocab}] float32 logits, T={args.temperature}, top-p={args.top_p}, "
          f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; ms per call, mean of {args.reps}")
    print_table(["ms"] + [f"logit {key}" for key in timings], rows)
    print()
    print_table(["kept sets at top-p " + str(args.top_p)] + list(agreements),
                [[key] + [agreements[case][key] for case in agreements] for key in next(iter(agreements.values()))])
    append_result(args.out, {
        "benchmark": "sampler_bench", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": str(device), "card": torch.cuda.get_device_name(device), "host": platform.node(),
        "torch": torch.__version__, "commit": args.commit,
        "shape": {"batch": args.batch, "vocab": args.vocab, "temperature": args.temperature, "top_p": args.top_p},
        "ms": timings, "agreement": agreements})


if __name__ == "__main__":
    main()
