"""Real-shape trainer smoke: the whole outer step at the Qwen2.5-1.5B shape on one GPU.

A random-init Qwen2.5-1.5B-shaped policy (saved with the embedded character tokenizer), the
arithmetic prompts, 32 prompts × G = 8 samples of up to 1,024 new tokens from the native
engine with CUDA graphs, bf16 compute with fp32 master weights, and the synthetic reward
(`reward.synthetic`: the policy cannot see it, but advantages are non-zero). Two training
steps of each method; prints the per-phase timers, the peak memory and what stays allocated after each
step ("held": a rise step after step is memory held per step, which --memory-growth locates), the policy
phase's model FLOP utilisation (6 · parameters · tokens / t_pol against --peak-tflops, the dense bf16 GEMM rate
measured on H100/H200, ~790 TFLOP/s, which the targets are stated against; beside it the share of the datasheet
peak, --datasheet-tflops, 989 on H100/H200 SXM) and the post-publish parity (mean |behaviour − recomputed
log-prob| of the sampled tokens), the graphs torch.compile built in each step ("compiled": train.compile meeting
new shapes) and the allocator's retries, and appends one JSON line to --out. Memory knobs: --micro-tokens
(token-budget micro-batches), --checkpointing, --gpu-memory-fraction (the engine's KV share); --set passes any
other config override. --nproc N runs each method as N FSDP2 ranks (`caspo train --nproc N`, one device each):
the phases and the peak are rank 0's.

The step-level methods: --newline-rate / --eos-rate plant those next-token probabilities in the random
policy (benchmarks/_common.plant_rates), and --text-rate the tokenizer's visible characters so that lines
hold text: its responses then have line steps and end. Planted runs train at a learning rate that leaves
the rates in place (_common.planted_learning_rate; lr 1e-6 collapses them in one step). vineppo runs K
continuations per step boundary (scored by the verifier: the synthetic reward scores training batches
only) and caspo gets a prefix value model of the policy's shape (φ = the policy, every V 0). Their rows add
the value phase, the Monte Carlo tokens, vineppo's seconds generating and scoring them, the engine's prefill
rounds, the mean decode rows per step, the decode graphs captured (and their seconds), and the share of
continuation prefill that prefix sharing saved.
With several methods a last table gives each one's last step against grpo's and caspo's (the compilation
and graph capture of the first steps left out).

    python benchmarks/trainer_smoke.py --methods grpo,caspo,vineppo --prompts 64 --newline-rate 0.01 \
        --eos-rate 0.002 --out benchmarks/results.jsonl   # ~5 steps per response of ~440 tokens

    python benchmarks/trainer_smoke.py --out benchmarks/results.jsonl --commit $COMMIT
    # smoke test:
    python benchmarks/trainer_smoke.py --device cpu --dtype float32 --hidden 64 --layers 2 --heads 4 --kv-heads 2 \
        --intermediate 128 --vocab 1000 --prompts 2 --samples 2 --new-tokens 8 --micro-batch 2 --no-graphs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import (
    add_model_args,
    add_peak_args,
    append_result,
    build_model,
    environment,
    mfu_reference,
    mfu_shares,
    plant_rates,
    planted_learning_rate,
    print_table,
    save_value_model,
    text_rates,
)
from memory_growth import growth_tracked

from caspo.config import load_config
from caspo.data.build import load_task_data
from caspo.models.policy import resolve_model_path
from caspo.models.tokenizer import load_tokenizer, save_tokenizer
from caspo.train import loop
from caspo.train.loop import train

RATIO_BASES = ("grpo", "caspo")  # issue 18's ratios: ppo_critic and caspo against grpo, vineppo against caspo
PHASES = ("t_roll", "t_reward", "t_old", "t_ref", "t_value", "t_pol", "t_sync", "t_step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--methods", default="grpo,ppo_critic")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--micro-tokens", type=int, default=0, help="train.micro_batch_tokens (0 = rows)")
    parser.add_argument("--checkpointing", action="store_true", help="train.activation_checkpointing=true")
    add_peak_args(parser)
    parser.add_argument("--set", action="append", default=[], help="another config override, KEY=VALUE")
    parser.add_argument("--no-graphs", action="store_true", help="eager decode (CPU smoke tests)")
    parser.add_argument("--newline-rate", type=float, default=0.0, help="P(newline) planted at every position")
    parser.add_argument("--eos-rate", type=float, default=0.0, help="P(EOS) planted at every position")
    parser.add_argument("--text-rate", type=float, default=0.5,
                        help="with --newline-rate: P(a visible character of the tokenizer), so lines hold text")
    parser.add_argument("--vineppo-k", type=int, default=9, help="vineppo's continuations per step boundary")
    parser.add_argument("--profile", default="",
                        help="a folder: each method's last step runs under torch.profiler, and its kernels and "
                             "phases (wall time and GPU span) are written there as profile_<method>.txt")
    parser.add_argument("--memory-growth", default="",
                        help="a folder: what each outer step leaves allocated, by allocation site "
                             "(memory_growth.py), written there as memory_growth_<method>.txt")
    parser.add_argument("--nproc", type=int, default=1,
                        help="FSDP2 ranks on this host, one device each (`caspo train --nproc`); MFU over all of them")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="caspo-smoke-"))
    policy = work / "policy"
    model = build_model(args, dtype="float32")  # fp32 masters
    tokenizer = load_tokenizer(resolve_model_path("embedded:tiny-arith"))
    newline = tokenizer.convert_tokens_to_ids("\n")
    rates = text_rates(tokenizer, args.text_rate) if args.newline_rate else {}
    rates |= {token: rate for token, rate in ((newline, args.newline_rate), (tokenizer.eos_token_id, args.eos_rate))
              if rate}
    lr = 1e-6
    if rates:
        if args.logit_scale != 1.0:
            raise SystemExit("--logit-scale and the planted rates (--newline-rate, --eos-rate) both set the logits' "
                             "spread: give one")
        plant_rates(model, rates)
        lr = min(lr, planted_learning_rate(model))
    model.save_pretrained(policy)
    save_tokenizer(tokenizer, policy)
    parameters = sum(p.numel() for p in model.parameters())  # tied head counted once: its matmul
    del model

    last_steps = {}
    for method in args.methods.split(","):
        overrides = [
            f"model.policy={policy}", f"model.device={args.device}", "rollout.backend=native",
            f"rollout.cuda_graphs={str(not args.no_graphs).lower()}", f"rollout.prompts_per_step={args.prompts}",
            f"rollout.samples_per_prompt={args.samples}", f"rollout.max_new_tokens={args.new_tokens}",
            "train.precision=" + ("bf16" if args.dtype == "bfloat16" else "fp32"), "reward.synthetic=true",
            f"method.name={method}", f"train.steps={args.steps}", f"train.minibatch_size={args.prompts * args.samples}",
            f"train.micro_batch_size={args.micro_batch}", "eval.before=false", "eval.after=false",
            "train.save_every=0", "train.save_last=false", f"optim.lr={lr}", f"train.output_dir={work / method}",
            f"rollout.gpu_memory_fraction={args.gpu_memory_fraction}", f"train.micro_batch_tokens={args.micro_tokens}",
            f"train.activation_checkpointing={str(args.checkpointing).lower()}", *step_level(method, args),
            *args.set]
        cfg = load_config("arith-tiny", overrides)
        if method == "caspo":  # a value model labelled under this run's conditions
            save_value_model(cfg, policy, work / "value")
            overrides.append(f"method.caspo.value_model={work / 'value'}")
            cfg = load_config("arith-tiny", overrides)
        prompt_len = mean_prompt_tokens(cfg, tokenizer)
        if args.nproc > 1:  # FSDP2 ranks, one per device, started by the CLI; the metrics are rank 0's
            subprocess.run([sys.executable, "-m", "caspo.cli", "train", "arith-tiny", *overrides,
                            "--nproc", str(args.nproc)], check=True)
        elif args.profile:
            with profiled_last_step(args.steps, Path(args.profile) / f"profile_{method}.txt"):
                train(cfg)
        elif args.memory_growth:
            with growth_tracked(Path(args.memory_growth) / f"memory_growth_{method}.txt"):
                train(cfg)
        else:
            train(cfg)
        steps = [json.loads(line) for line in (work / method / "metrics.jsonl").read_text().splitlines()]
        steps = [s for s in steps if "t_step" in s]
        # each phase resets the CUDA peak counter: the run's peak is the largest step peak
        peak = max(s["mem_peak_gb"] for s in steps) * 2**30 if "mem_peak_gb" in steps[0] else None
        # One table and one JSON line per method, so a run stopped midway keeps what finished.
        for s in steps:  # forward + backward of every (prompt + response) token, attention FLOPs left out
            tokens = cfg.responses_per_step * (prompt_len + s["response_len_mean"]) * cfg.train.epochs_per_rollout
            s["policy_mfu"], s["policy_mfu_datasheet"] = mfu_shares(6 * parameters * tokens, s["t_pol"], args,
                                                                    args.nproc)
        print_table(["method", "step", *PHASES, "roll graphs", "resp len", "steps", "MC tokens", "MC gen s",
                     "MC score s", "MC rounds (forwards)", "MC prefill/wait/host s", "MC rows/step of decoded",
                     "MC grouped steps", "MC graphs", "MC shared", "|Δ logp|",
                     f"policy MFU (of {args.peak_tflops:g} measured GEMM)", f"of {args.datasheet_tflops:g} datasheet",
                     "peak GiB",
                     "reserved GiB", "held GiB", "compiled", "retries"],
                    [[method, s["step"], *(f"{s.get(p, 0):.1f}" for p in PHASES),
                      f"{s['roll_graph_captures']} in {s['t_roll_capture']:.1f} s"
                      if "roll_graph_captures" in s else "-",
                      f"{s['response_len_mean']:.0f}",
                      f"{s.get('steps_per_response', 0):.1f}", s.get("mc_tokens", "-"),
                      *(f"{s[k]:.1f}" if k in s else "-" for k in ("t_mc_generate", "t_mc_score")),
                      f"{s['mc_prefill_rounds']} ({s['mc_prefill_forwards']})" if "mc_prefill_forwards" in s else "-",
                      "/".join(f"{s[k]:.1f}" for k in ("t_mc_prefill", "t_mc_wait", "t_mc_host"))
                      if "t_mc_wait" in s else "-",
                      f"{s['mc_tokens'] / s['mc_decode_steps']:.0f} of {s['mc_decode_rows'] / s['mc_decode_steps']:.0f}"
                      if s.get("mc_decode_steps") else "-",
                      f"{s['mc_grouped_steps']} of {s['mc_decode_steps']}" if "mc_grouped_steps" in s else "-",
                      f"{s['mc_graph_captures']} in {s['t_mc_capture']:.1f} s" if "mc_graph_captures" in s else "-",
                      f"{s['mc_prefill_shared_frac']:.0%}" if "mc_prefill_shared_frac" in s else "-",
                      f"{s['behaviour_vs_old_logp_absdiff']:.2e}", f"{s['policy_mfu']:.0%}",
                      f"{s['policy_mfu_datasheet']:.0%}",
                      f"{s['mem_peak_gb']:.1f}" if peak else "-",
                      f"{s['mem_peak_reserved_gb']:.1f}" if "mem_peak_reserved_gb" in s else "-",
                      f"{s['mem_allocated_gb']:.2f}" if "mem_allocated_gb" in s else "-",
                      s.get("compiled_graphs", "-"),
                      s.get("mem_alloc_retries", "-")]
                     for s in steps])
        append_result(args.out, {"benchmark": "trainer_smoke", "method": method, **environment(args),
                                 "mfu_reference": mfu_reference(args),
                                 "shape": {"prompts": args.prompts, "samples": args.samples,
                                           "new_tokens": args.new_tokens, "prompt_tokens_mean": prompt_len},
                                 "knobs": {"nproc": args.nproc, "micro_tokens": args.micro_tokens,
                                           "checkpointing": args.checkpointing, "kv_share": args.gpu_memory_fraction,
                                           "micro_batch": args.micro_batch,
                                           "newline_rate": args.newline_rate, "eos_rate": args.eos_rate,
                                           "text_rate": args.text_rate if args.newline_rate else 0.0,
                                           "vineppo_k": args.vineppo_k, "lr": lr, "set": args.set},
                                 "steps": steps, "peak_bytes": peak})
        last_steps[method] = steps[-1]["t_step"]
    if len(last_steps) > 1:
        print_table(["method", "last step s", *(f"x {base}" for base in RATIO_BASES if base in last_steps)],
                    step_ratios(last_steps))
    shutil.rmtree(work / "policy", ignore_errors=True)


def step_ratios(last_steps: dict[str, float]) -> list[list[str]]:
    """Rows of (method, its last step's time, that time over each base method's that ran)."""
    bases = [b for b in RATIO_BASES if b in last_steps]
    return [[method, f"{t:.1f}", *(f"{t / last_steps[b]:.2f}" for b in bases)] for method, t in last_steps.items()]


@contextlib.contextmanager
def profiled_last_step(steps: int, out: Path):
    """Run the outer step numbered `steps` (the last) under torch.profiler and write its top kernels, and each
    phase's wall time and GPU span, to `out`."""
    from torch.profiler import ProfilerActivity, profile

    original, calls = loop.outer_step, []

    def outer_step(tr):
        calls.append(1)
        if len(calls) < steps:
            return original(tr)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tr.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            result = original(tr)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(profile_report(prof.key_averages(), "device" if tr.device.type == "cuda" else "cpu"))
        return result

    loop.outer_step = outer_step
    try:
        yield
    finally:
        loop.outer_step = original


def profile_report(averages, clock: str) -> str:
    """Each phase's wall seconds (its host range) and, on CUDA, the span of its range on the GPU, then the 40
    kernels or ops that took the most `clock` time ("device": the GPU's kernels, "cpu" on a CPU run)."""
    wall, span = {}, {}
    for event in averages:  # a phase is two events on CUDA: the host range and its annotation on the GPU
        if event.key in PHASES:
            wall[event.key] = max(wall.get(event.key, 0.0), event.cpu_time_total / 1e6)
            span[event.key] = max(span.get(event.key, 0.0), event.device_time_total / 1e6)
    lines = ["phase  wall s  GPU span s"] + [f"{k}  {wall[k]:.2f}  {span[k]:.2f}" for k in PHASES if k in wall]
    lines += ["", averages.table(sort_by=f"self_{clock}_time_total", row_limit=40, max_name_column_width=90)]
    return "\n".join(lines) + "\n"


def step_level(method: str, args) -> list[str]:
    """vineppo's continuations are scored by the verifier, not the synthetic reward (that scores batches)."""
    if method == "vineppo":
        return ["reward.synthetic=false", f"method.vineppo_k={args.vineppo_k}"]
    return []


def mean_prompt_tokens(cfg, tokenizer) -> float:
    prompts = load_task_data(cfg, tokenizer).train_prompts[:512]
    return sum(len(p) for p in prompts) / len(prompts)


if __name__ == "__main__":
    main()
