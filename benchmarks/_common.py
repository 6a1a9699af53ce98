"""Shared pieces of the rollout benchmarks: the model shape flags, a random-init model, timing, result lines."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from caspo.models.policy import attention_without_cudnn

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# MFU's reference: the dense bf16 GEMM rate measured on the H100 and H200 cards these benchmarks run on, which
# issue 18's MFU target is stated against; below the datasheet's dense bf16 peak of H100/H200 SXM (no sparsity)
GEMM_TFLOPS = 790.0
DATASHEET_TFLOPS = 989.0
# shape flag -> the model config's field
SHAPE_FIELDS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
                "kv_heads": "num_key_value_heads", "intermediate": "intermediate_size", "vocab": "vocab_size"}


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the model shape (defaults: Qwen2.5-1.5B), device and dtype."""
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=8960)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="",
                        help="a trained policy (folder or embedded:NAME) instead of random init; "
                             "its shape replaces the shape flags")
    parser.add_argument("--logit-scale", type=float, default=1.0,
                        help="multiply a random model's logits (its final norm's weight): 8 makes its top-p 0.9 "
                             "nucleus a few tokens, as a trained model's is, where 1 leaves ~50,000")
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.3, help="KV cache share of the GPU (CUDA)")
    parser.add_argument("--commit", default="", help="the code's commit, recorded with the figures")
    parser.add_argument("--out", default="", help="append one JSON line of results to this file")


def policy_shape(config) -> dict:
    """The shape flags' values of a model config (kv_heads: the heads where it has none), and a looped model's
    depth (its loops over the layers)."""
    shape = {flag: getattr(config, field, None) for flag, field in SHAPE_FIELDS.items()}
    shape["kv_heads"] = shape["kv_heads"] or shape["heads"]
    return shape | ({"depth": config.depth} if hasattr(config, "depth") else {})


def build_model(args, dtype: str = "") -> torch.nn.Module:
    """`args.policy` loaded, or a random-init Qwen2 causal LM with tied embeddings, in `dtype` (default
    `args.dtype`) on `args.device`.

    With a policy, its shape replaces the shape flags in `args`: what `environment` records, and the vocabulary
    random prompts are drawn from.
    """
    dtype = DTYPES[dtype or args.dtype]
    scale = getattr(args, "logit_scale", 1.0)
    if args.policy and scale != 1.0:
        raise ValueError("--logit-scale reshapes a random model's logits; a trained policy keeps its own")
    if args.policy:
        from caspo.models.policy import load_policy, resolve_model_path

        model = load_policy(resolve_model_path(args.policy), torch.device(args.device)).to(dtype)
        vars(args).update(policy_shape(model.config))
        return model.eval().requires_grad_(False)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, tie_word_embeddings=True, rope_theta=1e6,
                         max_position_embeddings=32768)
    torch.manual_seed(args.seed)
    if torch.device(args.device).type == "cuda":  # attention as in the trainer's models (load_policy)
        attention_without_cudnn()
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        model.get_decoder().norm.weight.mul_(scale)  # logits = (g ⊙ normed h) · E: scaled by the same factor
    return model.eval().requires_grad_(False)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=generator).tolist()


def kv_sizing(args, max_seq_len: int, sequences: int) -> dict:
    """NativeEngine cache arguments: a GPU share on CUDA, exactly the sequences' tokens elsewhere."""
    if torch.device(args.device).type == "cuda":
        return {"gpu_memory_fraction": args.gpu_memory_fraction}
    return {"capacity_tokens": sequences * max_seq_len}


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: str, fn):
    """(result, seconds, peak device bytes or None) of fn()."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    seconds = time.perf_counter() - start
    return result, seconds, torch.cuda.max_memory_allocated(device) if cuda else None


def environment(args) -> dict:
    device = torch.device(args.device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": str(device), "card": card,
            "torch": torch.__version__, "commit": args.commit, "dtype": args.dtype, "policy": args.policy or None,
            "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "model": {flag: getattr(args, flag) for flag in (*SHAPE_FIELDS, "depth") if hasattr(args, flag)}}


def add_peak_args(parser: argparse.ArgumentParser) -> None:
    """The flags of what MFU is measured against."""
    parser.add_argument("--peak-tflops", type=float, default=GEMM_TFLOPS,
                        help="MFU's reference: the dense bf16 GEMM rate measured on H100/H200 (~790 TFLOP/s), which "
                             "the targets are stated against; not the datasheet peak")
    parser.add_argument("--datasheet-tflops", type=float, default=DATASHEET_TFLOPS,
                        help="the card's datasheet dense bf16 peak (H100/H200 SXM: 989 TFLOP/s); the share of it is "
                             "reported beside MFU")


def mfu_shares(flops: float, seconds: float, args, devices: int = 1) -> tuple[float, float]:
    """The FLOP rate of `flops` done in `seconds` on `devices` cards, as shares of the measured GEMM rate (MFU, as
    the targets state it) and of the datasheet peak."""
    rate = flops / max(seconds, 1e-9) / devices / 1e12
    return rate / args.peak_tflops, rate / args.datasheet_tflops


def mfu_reference(args) -> dict:
    """What a result's MFU figures are shares of, recorded with them."""
    return {"measured_gemm_tflops": args.peak_tflops, "datasheet_tflops": args.datasheet_tflops}


def add_graph_timing_args(parser: argparse.ArgumentParser, copies: int = 4) -> None:
    """The flags of a kernel timed as CUDA-graph replays (--copies, --calls, --replays) and of its result line."""
    parser.add_argument("--copies", type=int, default=copies, help="inputs or weights cycled through, to defeat L2")
    parser.add_argument("--calls", type=int, default=28, help="calls captured in one CUDA graph")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--commit", default="", help="the code's commit, recorded with the figures")
    parser.add_argument("--out", default="", help="append the results as JSON lines to this file")


def kernel_record(benchmark: str, commit: str) -> dict:
    """The fields every result line of a CUDA kernel benchmark starts with; exits where no CUDA device is seen."""
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark times CUDA kernels; run it on a CUDA device")
    return {"benchmark": benchmark, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "card": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit}


def append_result(path: str, record: dict) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def print_table(header: list[str], rows: list[list]) -> None:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def kernel_profile(fn, device, top: int = 15) -> list[list[str]]:
    """The `top` kernels with the most device time in one call of `fn`: name, calls, ms, share of the call; then
    all kernels together (their ms against the call's wall time is how busy the device was)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key) > 0]
    if device.type == "cuda":  # kernels only: operators would count their kernels twice
        events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(getattr(e, key) for e in events)
    largest = sorted(events, key=lambda e: -getattr(e, key))[:top]
    return [[e.key[:70], e.count, f"{getattr(e, key) / 1e3:.3f}", f"{getattr(e, key) / max(total, 1):.1%}"]
            for e in largest] + [["(all kernels)", sum(e.count for e in events), f"{total / 1e3:.3f}", "100.0%"]]


def plant_rates(model: torch.nn.Module, rates: dict[int, float]) -> None:
    """Make a random-init model with tied embeddings write token t with probability ~rates[t] at every position
    (newlines for step boundaries, EOS for ending), and otherwise as randomly as before.

    Every embedding row gets a shift s in column 0. Each random layer sees ≈ √d·e_0 after its RMSNorm and adds
    a near-constant vector of norm ~0.02²·d·√d, so s = 100·√(d·L) keeps column 0 dominant through L layers:
    after the final RMSNorm h ≈ g_0·√d·e_0, and logit_t ≈ g_0·√d·E[t, 0] plus near-equal noise. Setting the
    final norm's g_0 = 1 / (√d·s) makes that common logit 1 (bf16 logits of ~1,000 are spaced 8 apart, which
    would round the planted offsets away). A planted row gets s·(1 + log(p_t·V / (1 − Σp))): weight p_t
    against V near-equal rows sharing the rest."""
    embeddings = model.get_input_embeddings().weight
    if model.get_output_embeddings().weight.data_ptr() != embeddings.data_ptr():
        raise ValueError("plant_rates needs tied embeddings (the head reads the planted rows)")
    vocab, width = embeddings.shape
    shift = 100 * math.sqrt(width * model.config.num_hidden_layers)
    rest = 1 - sum(rates.values())
    with torch.no_grad():
        embeddings[:, 0] = shift
        model.get_decoder().norm.weight[0] = 1 / (math.sqrt(width) * shift)
        for token, p in rates.items():
            embeddings[token, 0] = shift * (1 + math.log(p * vocab / rest))


def planted_learning_rate(model: torch.nn.Module, change: float = 1e-3) -> float:
    """A learning rate under which the planted rates survive training: Adam moves every parameter by about lr a
    step, and the planted final-norm weight g_0 = 1 / (√d·s) is tiny (1.2e-6 at the 1.5B shape, where lr 1e-6
    would change the logits' scale by ~80% in one step and collapse the responses). This keeps Adam's step on
    g_0 at `change` of it; the compute of a step does not depend on the rate."""
    return change * float(model.get_decoder().norm.weight[0].abs())


def text_rates(tokenizer, total: float) -> dict[int, float]:
    """`total` probability shared by the tokenizer's visible single-character tokens, so that planted lines hold
    text: a random model over the 151,936-token Qwen vocabulary writes ids the small character tokenizer decodes
    to nothing, and lines of nothing are blank (no step boundary)."""
    special = set(tokenizer.all_special_ids)
    visible = [i for i in range(len(tokenizer)) if i not in special and tokenizer.decode([i]).strip()]
    if not visible:
        raise ValueError("the tokenizer has no visible tokens to plant")
    return {i: total / len(visible) for i in visible}


def save_value_model(cfg, policy: Path, out: Path, device: str = "cpu") -> Path:
    """A fresh prefix value model of the policy's shape (φ = the policy, every V 0) whose labels would come from
    the run `cfg` describes (its template, verifier settings and splitter), as `caspo value train` records them."""
    from caspo.models.policy import load_policy
    from caspo.models.prefix_value import PrefixValueModel
    from caspo.models.provenance import label_provenance, model_identity
    from caspo.models.tokenizer import load_tokenizer

    base = load_policy(str(policy), torch.device(device))
    tokenizer = load_tokenizer(str(policy))
    provenance = label_provenance(cfg, tokenizer, base).with_reference(model_identity(base))
    model = PrefixValueModel.from_reference(base, provenance=provenance, reference_source=str(policy))
    return model.save(out, tokenizer=tokenizer)
