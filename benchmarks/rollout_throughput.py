"""Rollout throughput: native eager, native with CUDA graphs, and the transformers engine.

A random-init Qwen2.5-1.5B-shaped model (tied embeddings), 256 prompts of 128 tokens, 512
new tokens each with EOS disabled, the full sampler (temperature, top-p, behaviour and
untruncated log-probs). Prints a table and appends one JSON line to --out. "prefill s" times the same prompts
with one new token each; "decode tokens/s" is the rest of the tokens over the rest of the time. A random model's
top-p 0.9 nucleus holds ~50,000 tokens per row, the sampler's worst case; --logit-scale 8 makes it
a few tokens, as a trained model's is. For the native engines, "wait ms/step" is the host blocked on a decode step's
tokens and "host ms/step" the host's own work (scheduling, launches, reading tokens), both per decode step of the
timed run: a wait near 0 means the host, not the device, sets the pace. --profile prints the 25 CUDA kernels
with the most device time in one more run of the last engine (graph replays included), and the share of the run
they cover.

    python benchmarks/rollout_throughput.py --out benchmarks/results.jsonl --commit $COMMIT
    python benchmarks/rollout_throughput.py --device cpu --dtype float32 --hidden 64 --layers 2 --heads 4 \
        --kv-heads 2 --intermediate 128 --vocab 1000 --prompts 8 --prompt-len 16 --new-tokens 16   # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
from functools import partial

import torch
from _common import (
    add_model_args,
    append_result,
    build_model,
    environment,
    kernel_profile,
    kv_sizing,
    print_table,
    random_prompts,
    timed,
)

import caspo.rollout.sampling as sampling_module
from caspo.rollout.base import Request, SamplingParams
from caspo.rollout.hf import HFEngine
from caspo.rollout.native import NativeEngine
from caspo.rollout.sampling import sample_seed

# native-graphs-sdpa: decode attention by masked SDPA; native-graphs-eager-sampler: the sampler's kernels
# launched one by one after the decode graph, instead of replayed as a graph of their own;
# native-graphs-eager-rope: eager RoPE and indexed K/V writes instead of the rope_store kernel (rope_kernel=False);
# native-graphs-prefix-attention: the G samples of a prompt read its K/V once a step (shared_prefix_attention)
ENGINES = ("native", "native-graphs", "hf", "native-graphs-sdpa", "native-graphs-eager-sampler",
           "native-graphs-eager-rope", "native-graphs-prefix-attention")


def make_engine(name: str, model, args, max_seq_len: int):
    if name == "hf":
        return HFEngine(model, pad_token_id=0)
    return NativeEngine(model, max_seq_len=max_seq_len, max_running=args.prompts,
                        cuda_graphs=name.startswith("native-graphs"),
                        decode_kernel=False if name.endswith("-sdpa") else None,
                        sampler_graphs=not name.endswith("-eager-sampler"),
                        rope_kernel=False if name.endswith("-eager-rope") else None,
                        shared_prefix_attention=name.endswith("-prefix-attention"),
                        **kv_sizing(args, max_seq_len, args.prompts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--samples", type=int, default=1,
                        help="samples per prompt (G): --prompts / G distinct prompts, each G times")
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-logprobs", type=int, default=0, help="top-K log-probs per position (native only)")
    parser.add_argument("--engines", default=",".join(ENGINES[:3]))
    parser.add_argument("--profile", action="store_true", help="the kernels of one more run of the last engine")
    parser.add_argument("--nucleus-top", type=int, default=sampling_module.NUCLEUS_TOP,
                        help="likeliest tokens tried before the nucleus search (0: every row searches)")
    parser.add_argument("--collect-after", type=int, default=sampling_module.NUCLEUS_COLLECT_AFTER,
                        help="nucleus passes before small intervals are gathered and sorted (99: never)")
    parser.add_argument("--screened-passes", type=int, default=sampling_module.NUCLEUS_SCREENED_PASSES,
                        help="nucleus passes decided on float32 sums where those surely decide (0: int64 sums alone)")
    args = parser.parse_args()
    if args.nucleus_top < 0:
        parser.error("--nucleus-top must be 0 or more")
    sampling_module.NUCLEUS_TOP = args.nucleus_top  # read by every nucleus_threshold call, the captured ones too
    sampling_module.NUCLEUS_COLLECT_AFTER = args.collect_after
    sampling_module.NUCLEUS_SCREENED_PASSES = args.screened_passes

    model = build_model(args)
    if args.samples < 1 or args.prompts % args.samples:
        parser.error(f"--samples must divide --prompts ({args.prompts}), got {args.samples}")
    distinct = random_prompts(args.prompts // args.samples, args.prompt_len, args.vocab, args.seed)
    prompts = [p for p in distinct for _ in range(args.samples)]
    requests = [Request(p, seed=sample_seed(args.seed, 0, i, 0), max_new_tokens=args.new_tokens)
                for i, p in enumerate(prompts)]
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, stop_token_ids=[])  # EOS disabled
    # The native engine captures its graphs and compiles its sampler on first use of each shape:
    # one untimed run of the whole workload. transformers has nothing to warm but its kernels.
    short = [Request(r.prompt_ids, r.seed, max_new_tokens=8) for r in requests[:2]]
    first_tokens = [Request(r.prompt_ids, r.seed, max_new_tokens=1) for r in requests]
    max_seq_len = args.prompt_len + args.new_tokens
    cuda = torch.device(args.device).type == "cuda"

    columns = ["engine", "tokens/s", "tokens", "seconds", "prefill s", "decode tokens/s", "wait ms/step",
               "host ms/step", "setup s", "warm-up s", "peak GiB"]
    rows, results = [], {}
    for name in args.engines.split(","):
        if name not in ENGINES:
            raise SystemExit(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
        if name.startswith("native-graphs") and not cuda:
            rows.append([name, "skipped: CUDA graphs need a CUDA device"] + [""] * (len(columns) - 2))
            continue
        engine, setup_s, _ = timed(args.device, partial(make_engine, name, model, args, max_seq_len))
        extra = {"top_logprobs": args.top_logprobs} if name != "hf" else {}
        _, warm_s, _ = timed(args.device, partial(engine.generate, short if name == "hf" else requests, sampling,
                                                  **extra))
        before = dataclasses.replace(engine.stats) if name != "hf" else None
        completions, seconds, peak = timed(args.device, partial(engine.generate, requests, sampling, **extra))
        host = host_split(before, engine.stats) if before is not None else {}
        tokens = sum(len(c.tokens) for c in completions)
        if tokens != args.prompts * args.new_tokens:
            raise SystemExit(f"{name}: {tokens} tokens generated, expected {args.prompts * args.new_tokens}")
        # The same prompts with one new token each: the prefill and its sampling, so the rest is the decode steps'.
        _, prefill_s, _ = timed(args.device, partial(engine.generate, first_tokens, sampling, **extra))
        decode_rate = (tokens - args.prompts) / (seconds - prefill_s) if seconds > prefill_s else float("nan")
        results[name] = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
                         "prefill_s": round(prefill_s, 3), "decode_tokens_per_s": round(decode_rate, 1),
                         "setup_s": round(setup_s, 2), "warm_up_s": round(warm_s, 2), "peak_bytes": peak, **host}
        rows.append([name, f"{tokens / seconds:,.0f}", tokens, f"{seconds:.2f}", f"{prefill_s:.2f}",
                     f"{decode_rate:,.0f}", host.get("wait_ms_per_step", "-"), host.get("host_ms_per_step", "-"),
                     f"{setup_s:.1f}", f"{warm_s:.1f}", f"{peak / 2**30:.1f}" if peak else "-"])
        if args.profile and name == args.engines.split(",")[-1]:
            profile_rows = kernel_profile(partial(engine.generate, requests, sampling, **extra),
                                          torch.device(args.device), top=25)
            results[name]["profile"] = profile_rows
        del engine, completions
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    print(f"{args.prompts} prompts ({args.samples} samples of each) x {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, "
          f"T={args.temperature} top-p={args.top_p}, logits x{args.logit_scale}, nucleus top {args.nucleus_top}, "
          f"gathered after {args.collect_after} passes, {args.screened_passes} screened, {args.dtype} on {args.device}")
    print_table(columns, rows)
    for name, result in results.items():
        if "profile" in result:
            print_table([f"kernel (one run of {name})", "calls", "ms", "share"], result["profile"])
    append_result(args.out, {"benchmark": "rollout_throughput", **environment(args),
                             "shape": {"prompts": args.prompts, "samples": args.samples,
                                       "prompt_len": args.prompt_len,
                                       "new_tokens": args.new_tokens, "temperature": args.temperature,
                                       "top_p": args.top_p, "top_logprobs": args.top_logprobs,
                                       "logit_scale": args.logit_scale, "nucleus_top": args.nucleus_top,
                                       "collect_after": args.collect_after,
                                       "screened_passes": args.screened_passes},
                             "engines": results})


def host_split(before, after) -> dict:
    """Per decode step of one generate call (EngineStats before and after it): the host's wait for tokens and
    its own work, admission rounds excluded."""
    during = after.since(before)
    steps = max(during.decode_steps, 1)
    wait = during.wait_s
    own = during.generate_s - during.prefill_s - wait
    return {"wait_ms_per_step": round(1e3 * wait / steps, 3), "host_ms_per_step": round(1e3 * own / steps, 3)}


if __name__ == "__main__":
    main()
