"""Real-shape trainer smoke: the whole outer step at the Qwen2.5-1.5B shape on one GPU.

A random-init Qwen2.5-1.5B-shaped policy (saved with the embedded character tokenizer), the
arithmetic prompts, 32 prompts × G = 8 samples of up to 1,024 new tokens from the native
engine with CUDA graphs, bf16 compute with fp32 master weights, and the synthetic reward
(`reward.synthetic`: the policy cannot see it, but advantages are non-zero). Two training
steps of each method; prints the per-phase timers, the peak memory and the post-publish
parity (mean |behaviour − recomputed log-prob| of the sampled tokens), and appends one JSON
line to --out.

    python benchmarks/trainer_smoke.py --out benchmarks/results.jsonl --commit $COMMIT
    # smoke test:
    python benchmarks/trainer_smoke.py --device cpu --dtype float32 --hidden 64 --layers 2 --heads 4 --kv-heads 2 \
        --intermediate 128 --vocab 1000 --prompts 2 --samples 2 --new-tokens 8 --micro-batch 2 --no-graphs
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from _common import add_model_args, append_result, build_model, environment, print_table

from caspo.config import load_config
from caspo.models.policy import resolve_model_path
from caspo.models.tokenizer import load_tokenizer, save_tokenizer
from caspo.train.loop import train

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
    parser.add_argument("--no-graphs", action="store_true", help="eager decode (CPU smoke tests)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="caspo-smoke-"))
    policy = work / "policy"
    model = build_model(argparse.Namespace(**{**vars(args), "dtype": "float32"}))  # fp32 masters
    model.save_pretrained(policy)
    save_tokenizer(load_tokenizer(resolve_model_path("embedded:tiny-arith")), policy)
    del model

    for method in args.methods.split(","):
        cfg = load_config("arith-tiny", [
            f"model.policy={policy}", f"model.device={args.device}", "rollout.backend=native",
            f"rollout.cuda_graphs={str(not args.no_graphs).lower()}", f"rollout.prompts_per_step={args.prompts}",
            f"rollout.samples_per_prompt={args.samples}", f"rollout.max_new_tokens={args.new_tokens}",
            "train.precision=" + ("bf16" if args.dtype == "bfloat16" else "fp32"), "reward.synthetic=true",
            f"method.name={method}", f"train.steps={args.steps}", f"train.minibatch_size={args.prompts * args.samples}",
            f"train.micro_batch_size={args.micro_batch}", "eval.before=false", "eval.after=false",
            "train.save_every=0", "optim.lr=1e-6", f"train.output_dir={work / method}"])
        if torch.device(args.device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(args.device)
        train(cfg)
        peak = torch.cuda.max_memory_allocated(args.device) if torch.device(args.device).type == "cuda" else None
        steps = [json.loads(line) for line in (work / method / "metrics.jsonl").read_text().splitlines()]
        steps = [s for s in steps if "t_step" in s]
        # One table and one JSON line per method, so a run stopped midway keeps what finished.
        print_table(["method", "step", *PHASES, "resp len", "|Δ logp|", "peak GiB"],
                    [[method, s["step"], *(f"{s.get(p, 0):.1f}" for p in PHASES), f"{s['response_len_mean']:.0f}",
                      f"{s['behaviour_vs_old_logp_absdiff']:.2e}", f"{peak / 2**30:.1f}" if peak else "-"]
                     for s in steps])
        append_result(args.out, {"benchmark": "trainer_smoke", "method": method, **environment(args),
                                 "shape": {"prompts": args.prompts, "samples": args.samples,
                                           "new_tokens": args.new_tokens},
                                 "steps": steps, "peak_bytes": peak})
        # The final checkpoint (fp32 masters and AdamW state, ~50 GB with a critic) is not needed
        # here; two methods' checkpoints filled a 64 GB disk.
        shutil.rmtree(work / method / "checkpoints", ignore_errors=True)
    shutil.rmtree(work / "policy", ignore_errors=True)


if __name__ == "__main__":
    main()
