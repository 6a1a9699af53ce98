"""The policy phase alone, against transformers' own forward and backward on the same tokens: where its MFU goes.

A random-init Qwen2.5-1.5B-shaped policy (fp32 masters, bf16 autocast) and a synthetic batch shaped like a
rollout: --rows responses of --response-len tokens after prompts of random length (mean --prompt-len).
Four timings of one minibatch (all rows), each after a warm-up, on the same rows and micro-batches:

    update        caspo's policy update (train/update.py): GRPO's clipped loss with KL to a reference, the
                  head-chunked log-probs and entropy, gradient accumulation, clipping and the AdamW step
    update, logits recomputed
                  the same with the loss's gradient taken in the head's backward, which computes each chunk's
                  logits again, instead of in its forward (`caspo.train.update.GRADIENT_IN_FORWARD`)
    plain         transformers' forward with full logits, cross-entropy on the response tokens, backward
                  and the same AdamW step, on the same padded micro-batches
    plain packed  the same, on rows without padding (every prompt --prompt-len long): the padding's cost

MFU is 6 · parameters · (prompt + response tokens of the rows) / time, against --peak-tflops (the dense bf16
GEMM rate measured on H100/H200, ~790 TFLOP/s, which the targets are stated against), with its share of the
datasheet peak beside it (--datasheet-tflops, 989 on H100/H200 SXM); attention FLOPs are left out, and padding
counts as waste. --compile compiles every decoder block first
(train.compile=true; the warm-up pays the compilation). --profile prints the 15 CUDA kernels that took
the most time in one `update`, and the share of the phase they cover. --variants picks the timings to take;
--length-multiple 1, --duck-sizing and --strict-mix-order each undo one thing compiled blocks do by default
(forward lengths rounded up to a multiple of 8, sizes not unified, the norms' backward fused at any size),
to time what it costs: one process each, since dynamo keeps its graphs for the process.

    python benchmarks/update_bench.py --rows 64 --micro-batch 8 --out bench.jsonl --commit $COMMIT [--profile]
    # CPU smoke:
    python benchmarks/update_bench.py --device cpu --dtype float32 --hidden 64 --layers 2 --heads 4 --kv-heads 2 \\
        --intermediate 128 --vocab 1000 --rows 4 --micro-batch 2 --prompt-len 8 --response-len 16
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _common import (
    add_model_args,
    add_peak_args,
    append_result,
    build_model,
    environment,
    kernel_profile,
    mfu_reference,
    mfu_shares,
    print_table,
    timed,
)
from torch.fx.experimental import _config as shapes_config

from caspo.batch import RolloutBatch
from caspo.config import load_config
from caspo.methods import resolve_method
from caspo.models import forward as forward_module
from caspo.models.policy import MIX_ORDER_AT_ANY_SIZE, compile_blocks, enable_recompute
from caspo.precision import LossScaler, autocast
from caspo.rollout.base import Completion
from caspo.train import update as update_module
from caspo.train.method_state import MethodState
from caspo.train.optim import allocate_state, learner
from caspo.train.update import update


def synthetic_batch(args, device, packed: bool = False) -> RolloutBatch:
    """Rows of random tokens and full responses after prompts of length uniform in [prompt_len / 2,
    3 prompt_len / 2] (`packed`: every prompt prompt_len long, so no row is padded)."""
    g = torch.Generator().manual_seed(args.seed)
    low, high = (args.prompt_len,) * 2 if packed else (max(1, args.prompt_len // 2), max(2, 3 * args.prompt_len // 2))
    lengths = torch.randint(low, high + 1, (args.rows,), generator=g).tolist()
    prompts = [torch.randint(0, args.vocab, (n,), generator=g).tolist() for n in lengths]
    completions = [Completion(torch.randint(0, args.vocab, (args.response_len,), generator=g).tolist(),
                              [-3.0] * args.response_len, "length", 0) for _ in range(args.rows)]
    batch = RolloutBatch.from_completions(
        prompts, completions, group_ids=[i // 2 for i in range(args.rows)],
        example_ids=[str(i) for i in range(args.rows)], sample_seeds=list(range(args.rows)), texts=[""] * args.rows,
        pad_token_id=0).to(device)
    batch.rewards = (torch.rand(args.rows, generator=g) < 0.5).float().to(device)
    batch.advantages = torch.randn(args.rows, 1, generator=g).to(device) * batch.response_mask
    batch.ref_logprobs = torch.full_like(batch.response_mask, -3.0)
    batch.old_logprobs = batch.behaviour_logprobs.clone()
    return batch


def plain_step(model, optimizer, batch: RolloutBatch, args, precision: str) -> None:
    """transformers' forward with full logits, mean cross-entropy of the response tokens, backward, AdamW."""
    optimizer.zero_grad(set_to_none=True)
    for _, micro in batch.micro_batches(args.micro_batch):
        with autocast(precision, micro.input_ids.device):
            logits = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask,
                           position_ids=micro.position_ids).logits[:, micro.prompt_width - 1:-1]
            loss = F.cross_entropy(logits.float().flatten(0, 1), micro.responses.flatten(), reduction="none")
            loss = (loss * micro.response_mask.flatten()).sum() / batch.response_mask.sum()
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--rows", type=int, default=64, help="responses in the minibatch")
    parser.add_argument("--prompt-len", type=int, default=141, help="mean prompt tokens (trainer_smoke's: 141)")
    parser.add_argument("--response-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--micro-tokens", type=int, default=0, help="train.micro_batch_tokens for `update`")
    parser.add_argument("--checkpointing", action="store_true", help="train.activation_checkpointing=true")
    parser.add_argument("--compile", action="store_true", help="train.compile=true: torch.compile each block")
    parser.add_argument("--reps", type=int, default=2)
    add_peak_args(parser)
    parser.add_argument("--profile", action="store_true", help="the kernels of one update")
    parser.add_argument("--variants", default="update,update-recomputed,plain,plain-packed",
                        help="which timings to take (comma-separated)")
    # what the compiled blocks do by default, each undone for an A/B of its cost (a process each)
    parser.add_argument("--length-multiple", type=int, default=forward_module.FORWARD_LENGTH_MULTIPLE,
                        help="forward lengths rounded up to a multiple of this (1: the frame as it is)")
    parser.add_argument("--duck-sizing", action="store_true", help="let dynamo unify equal sizes")
    parser.add_argument("--strict-mix-order", action="store_true",
                        help="inductor's size test before fusing the norms' backward reductions")
    args = parser.parse_args()
    forward_module.FORWARD_LENGTH_MULTIPLE = args.length_multiple
    device = torch.device(args.device)
    precision = "bf16" if args.dtype == "bfloat16" else "fp32"

    model = build_model(args, dtype="float32").requires_grad_(True)
    if args.checkpointing:
        enable_recompute(model)
    if args.compile:
        compile_blocks(model, **({"options": {MIX_ORDER_AT_ANY_SIZE: False}} if args.strict_mix_order else {}))
        shapes_config.use_duck_shape = args.duck_sizing  # read at the first call, after compile_blocks set it
    parameters = sum(p.numel() for p in model.parameters())
    cfg = load_config("arith-tiny", [
        f"model.device={args.device}", "method.name=grpo", "method.kl_coef=0.001", f"train.precision={precision}",
        f"rollout.prompts_per_step={args.rows // 2}", "rollout.samples_per_prompt=2",  # groups of 2 rows
        f"train.minibatch_size={args.rows}",
        f"train.micro_batch_size={args.micro_batch}", f"train.micro_batch_tokens={args.micro_tokens}",
        f"train.activation_checkpointing={str(args.checkpointing).lower()}", "optim.lr=1e-7",
        f"train.compile={str(args.compile).lower()}", "rollout.backend=native"])
    method = resolve_method(cfg)
    actor = learner(model, cfg)
    allocate_state(actor.optimizer)
    batch = synthetic_batch(args, device)
    tokens = int(batch.attention_mask.sum())
    generator, scaler = torch.Generator().manual_seed(0), LossScaler(precision, cfg.train.loss_scale)

    def run_update(gradient_in_forward: bool = True):
        saved, update_module.GRADIENT_IN_FORWARD = update_module.GRADIENT_IN_FORWARD, gradient_in_forward
        try:
            update(actor, batch, cfg, method, MethodState(), generator, scaler)
        finally:
            update_module.GRADIENT_IN_FORWARD = saved

    packed = synthetic_batch(args, device, packed=True)
    rows = []
    variants = (("update", run_update, tokens),
                ("update, logits recomputed", lambda: run_update(False), tokens),
                ("plain", lambda: plain_step(model, actor.optimizer, batch, args, precision), tokens),
                ("plain packed", lambda: plain_step(model, actor.optimizer, packed, args, precision),
                 int(packed.attention_mask.sum())))
    chosen = args.variants.split(",")
    for (name, fn, counted), key in zip(variants, ("update", "update-recomputed", "plain", "plain-packed")):
        if key not in chosen:
            continue
        fn()  # warm-up: kernels chosen, optimizer state allocated
        _, seconds, peak = timed(args.device, lambda: [fn() for _ in range(args.reps)])
        seconds, peak = seconds / args.reps, peak / 2**30 if peak is not None else float("nan")
        mfu, datasheet = mfu_shares(6 * parameters * counted, seconds, args)
        rows.append({"name": name, "seconds": seconds, "tokens": counted, "mfu": mfu, "mfu_datasheet": datasheet,
                     "peak_gib": peak})
    print_table(["", "seconds", "tokens", f"MFU (of {args.peak_tflops:g} measured GEMM)",
                 f"of {args.datasheet_tflops:g} datasheet", "peak GiB"],
                [[r["name"], f"{r['seconds']:.2f}", f"{r['tokens']:,}", f"{r['mfu']:.0%}", f"{r['mfu_datasheet']:.0%}",
                  f"{r['peak_gib']:.1f}"] for r in rows])
    profile_rows = kernel_profile(run_update, device) if args.profile else []
    if profile_rows:
        print()
        print_table(["kernel (one update)", "calls", "ms", "share"], profile_rows)
    append_result(args.out, {"benchmark": "update_bench", **environment(args), "parameters": parameters,
                             "mfu_reference": mfu_reference(args),
                             "shape": {"rows": args.rows, "prompt_len": args.prompt_len,
                                       "response_len": args.response_len, "micro_batch": args.micro_batch,
                                       "micro_tokens": args.micro_tokens, "checkpointing": args.checkpointing,
                                       "compile": args.compile, "length_multiple": args.length_multiple,
                                       "duck_sizing": args.duck_sizing, "strict_mix_order": args.strict_mix_order},
                             "results": rows, "profile": profile_rows})


if __name__ == "__main__":
    main()
