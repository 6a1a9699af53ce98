"""Monte Carlo continuations with and without prefix sharing (the VinePPO value phase).

64 responses, each cut at 8 step boundaries (prefix lengths 128 + 64·j), K = 9 continuations
of up to 128 tokens from every prefix: 4608 requests whose prompts share long prefixes. Reports
the prompt tokens computed, the prefill rounds and the wall time of the native engine in each
of --modes, each timed after an untimed run of the same requests (the engine's graph captures and
sampler compilation fall there), and appends one JSON line to --out:

    shared       prefix sharing, the engine's default admission (once max_running // 8 slots, at most 64, are free)
    admit-N      prefix sharing, a prefill round once N slots are free (admit_batch=N; admit-1: whenever one frees)
    recompute-N  prefix sharing, a round's chained prompts computed in one wave when that recomputes at most
                 N positions (recompute_budget=N; recompute-0: copied link by link, one wave per link)
    prefix-attention  prefix sharing, and each prompt's K/V read once a decode step for all its continuations
                 (shared_prefix_attention=True; CUDA)
    unshared     every prompt computed

Modes combine with "+": `prefix-attention+admit-128` is shared-prefix attention with rounds of 128 admissions.

--eos-rate plants an end-of-sequence token in the random model (benchmarks/_common.plant_rates), so that
continuations end one or two a step, as a policy's do, rather than all at their budget.

    python benchmarks/mc_continuations.py --out benchmarks/results.jsonl --commit $COMMIT
    python benchmarks/mc_continuations.py --device cpu --dtype float32 --hidden 64 --layers 2 --heads 4 \
        --kv-heads 2 --intermediate 128 --vocab 1000 --prompts 4 --boundaries 3 --first-prefix 32 --stride 16 \
        --k 3 --new-tokens 8   # smoke test

--profile runs the first mode once more under torch.profiler and prints its 25 costliest kernels and the
device time of all of them, against the run's wall time; --host-profile, once more under cProfile.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import re
from functools import partial

import torch
from _common import (
    add_model_args,
    append_result,
    build_model,
    environment,
    kernel_profile,
    kv_sizing,
    plant_rates,
    print_table,
    random_prompts,
    timed,
)

from caspo.rollout.base import Request, SamplingParams
from caspo.rollout.native import NativeEngine
from caspo.rollout.sampling import sample_seed

MODES = ("shared", "admit-N", "recompute-N", "prefix-attention", "unshared")
EOS = 2  # the planted end-of-sequence token of --eos-rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--prompts", type=int, default=64, help="responses whose prefixes are continued")
    parser.add_argument("--boundaries", type=int, default=8, help="step boundaries per response")
    parser.add_argument("--first-prefix", type=int, default=128, help="length of the shortest prefix")
    parser.add_argument("--stride", type=int, default=64, help="tokens between successive boundaries")
    parser.add_argument("--k", type=int, default=9, help="continuations per prefix")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--eos-rate", type=float, default=0.0, help="P(EOS) planted at every position (0: none)")
    parser.add_argument("--profile", action="store_true", help="the kernels of one more run of the first mode")
    parser.add_argument("--host-profile", action="store_true",
                        help="the host's functions (cProfile) in one more run of the first mode")
    parser.add_argument("--modes", default="shared,admit-1,unshared", help=f"some of {', '.join(MODES)}")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := [m for mode in modes for m in mode.split("+") if m not in ("shared", "prefix-attention", "unshared")
                   and not re.fullmatch(r"admit-[1-9]\d*|recompute-\d+", m)]:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)} (N a positive integer), "
                         "joined with + to combine")

    model = build_model(args)
    if args.eos_rate:
        plant_rates(model, {EOS: args.eos_rate})
    longest = args.first_prefix + args.stride * (args.boundaries - 1)
    responses = random_prompts(args.prompts, longest, args.vocab, args.seed)
    requests = [Request(response[:args.first_prefix + args.stride * j],
                        seed=sample_seed(args.seed, 0, p * args.boundaries + j, k), max_new_tokens=args.new_tokens)
                for p, response in enumerate(responses) for j in range(args.boundaries) for k in range(args.k)]
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                              stop_token_ids=[EOS] if args.eos_rate else [])
    max_seq_len = longest + args.new_tokens
    cuda = torch.device(args.device).type == "cuda"

    rows, results, outputs = [], {}, {}
    for mode in modes:
        engine = NativeEngine(model, max_seq_len=max_seq_len, max_running=args.max_running,
                              cuda_graphs=args.cuda_graphs, **engine_options(mode),
                              **kv_sizing(args, max_seq_len, args.max_running))
        # The engine captures its decode graphs and compiles its sampler on first use of each shape: one untimed run
        # of the whole workload, so that the timed one meets none for the first time (as rollout_throughput does)
        _, warm_s, _ = timed(args.device, partial(engine.generate, requests, sampling))
        before = dataclasses.replace(engine.stats)
        completions, seconds, peak = timed(args.device, partial(engine.generate, requests, sampling))
        during = engine.stats.since(before)
        computed, shared, rounds = during.prefill_tokens, during.shared_tokens, during.prefill_rounds
        forwards, steps, grouped = during.prefill_forwards, during.decode_steps, during.grouped_steps
        captures, capture_s = during.graph_captures, during.capture_s
        split = {name: round(getattr(during, name), 3)
                 for name in ("prefill_s", "wait_s", "generate_s")}  # the engine's host time, in parts
        split["host_s"] = round(split.pop("generate_s") - split["prefill_s"] - split["wait_s"], 3)
        generated = sum(len(c.tokens) for c in completions)
        outputs[mode] = [c.tokens for c in completions]
        results[mode] = {"prefill_tokens": computed, "shared_tokens": shared, "prefill_rounds": rounds,
                         "prefill_forwards": forwards,
                         "admit_batch": engine.admit_batch, "decode_steps": steps, "grouped_steps": grouped,
                         "graph_captures": captures,
                         "capture_s": round(capture_s, 3), **split, "seconds": round(seconds, 3),
                         "warm_up_s": round(warm_s, 3),
                         "generated_tokens": generated, "peak_bytes": peak}
        if args.profile and mode == modes[0]:
            results[mode]["profile"] = kernel_profile(partial(engine.generate, requests, sampling),
                                                      torch.device(args.device), top=25)
        if args.host_profile and mode == modes[0]:
            host_profile(partial(engine.generate, requests, sampling))
        rows.append([mode, len(requests), f"{computed:,}", f"{shared:,}", f"{rounds:,}", f"{forwards:,}", f"{steps:,}",
                     f"{grouped:,}", f"{generated / max(steps, 1):.0f}", f"{captures} in {capture_s:.1f} s",
                     "/".join(f"{split[k]:.1f}" for k in ("prefill_s", "wait_s", "host_s")), f"{seconds:.2f}",
                     f"{generated / seconds:,.0f}", f"{warm_s:.2f}", f"{peak / 2**30:.1f}" if peak else "-"])
        del engine, completions
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    print(f"{args.prompts} responses x {args.boundaries} boundaries (prefixes {args.first_prefix}"
          f" + {args.stride}·j) x K={args.k} continuations of up to {args.new_tokens} tokens (EOS rate "
          f"{args.eos_rate}), {args.dtype} on {args.device}")
    print_table(["mode", "requests", "prefill computed", "prefill shared", "prefill rounds", "prefill forwards",
                 "decode steps", "grouped", "rows/step", "graphs captured", "prefill/wait/host s", "seconds",
                 "tokens/s", "warm-up s", "peak GiB"], rows)
    if args.profile:
        print_table([f"kernel (one more run of {modes[0]})", "calls", "ms", "share"], results[modes[0]]["profile"])
    comparison = {}
    for mode in modes[1:]:  # each against the first
        same = sum(a == b for a, b in zip(outputs[modes[0]], outputs[mode]))
        speedup = results[mode]["seconds"] / results[modes[0]]["seconds"]
        comparison[mode] = {"speedup_of_first": round(speedup, 3), "identical_completions": same}
        print(f"{modes[0]} against {mode}: wall time /{speedup:.2f}, identical completions {same}/{len(requests)} "
              "(differences come only from summation order)")
    append_result(args.out, {"benchmark": "mc_continuations", **environment(args),
                             "shape": {"prompts": args.prompts, "boundaries": args.boundaries,
                                       "first_prefix": args.first_prefix, "stride": args.stride, "k": args.k,
                                       "new_tokens": args.new_tokens, "max_running": args.max_running,
                                       "cuda_graphs": args.cuda_graphs, "eos_rate": args.eos_rate},
                             "modes": results, "against_first": comparison})


def engine_options(mode: str) -> dict:
    """NativeEngine's keyword arguments for a mode, or for several joined with "+"."""
    options = {}
    for part in mode.split("+"):
        if part == "unshared":
            options["prefix_sharing"] = False
        elif part == "prefix-attention":
            options["shared_prefix_attention"] = True
        elif part.startswith("admit-"):
            options["admit_batch"] = int(part.removeprefix("admit-"))
        elif part.startswith("recompute-"):
            options["recompute_budget"] = int(part.removeprefix("recompute-"))
    return options


def host_profile(fn, top: int = 40) -> None:
    """Print the host functions with the most cumulative time in one call of `fn` (time blocked on the device
    included, in whichever call waited)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(fn)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(top)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    main()
