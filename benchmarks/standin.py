"""A stand-in for the seed's policy: Qwen2.5-Math-1.5B's public config with random weights and Qwen2.5's BPE
tokenizer, saved as a Hugging Face folder as a download of the real model is; optionally a prefix value model
of the same shape (φ = the stand-in, so every V starts at 0) with the provenance of a preset's prompts.

With it the seed's own commands run unchanged at the seed's shape on a machine without the weights:

    python benchmarks/standin.py --out /tmp/standin --value-for qwen-math-dsr --value-out /tmp/standin-value
    caspo train qwen-math-dsr model.policy=/tmp/standin train.steps=2 ...
    caspo train qwen-math-dsr model.policy=/tmp/standin method.name=caspo method.caspo.value_model=/tmp/standin-value
    caspo eval /tmp/standin --benchmarks math500 --samples 4 --out /tmp/eval

A random policy almost never stops (EOS is one token of 151,936): its responses run to the full budget, the
worst case for memory and time. --layers / --hidden / --intermediate shrink it for a CPU smoke test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _common import save_value_model
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

from caspo.models.bpe import build_qwen_tokenizer

PUBLIC_CONFIG = Path(__file__).resolve().parents[1] / "tests" / "model_configs" / "Qwen2.5-Math-1.5B.json"
ENDOFTEXT = 151643  # Qwen2.5-Math-1.5B's generation_config.json: bos = eos = <|endoftext|>


def save_standin(out: Path, overrides: dict, seed: int = 0, device: str = "cpu") -> Path:
    """Random weights in bf16 (as the hub checkpoint is stored) and the BPE tokenizer as Qwen2Tokenizer;
    `device` is where the weights are drawn (a GPU draws 1.5 B of them in seconds)."""
    fields = json.loads(PUBLIC_CONFIG.read_text())
    fields.update({k: v for k, v in overrides.items() if v})
    config = Qwen2Config(**{k: v for k, v in fields.items() if k not in ("architectures", "transformers_version")})
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=ENDOFTEXT, eos_token_id=ENDOFTEXT,
                                               pad_token_id=ENDOFTEXT)
    model.save_pretrained(out)
    tokenizer = build_qwen_tokenizer()
    tokenizer.save_pretrained(out)
    tokenizer_config = out / "tokenizer_config.json"
    saved = json.loads(tokenizer_config.read_text())
    saved["tokenizer_class"] = "Qwen2Tokenizer"  # as the hub folder's tokenizer_config.json says
    tokenizer_config.write_text(json.dumps(saved, indent=2) + "\n")
    return out


def value_model_for(policy: Path, preset: str, out: Path, overrides: list[str] = (), device: str = "cpu") -> Path:
    """A prefix value model of the policy's shape for `preset`'s run (its prompts, verifier and splitter)."""
    from caspo.config import load_config

    cfg = load_config(preset, [f"model.policy={policy}", "model.device=cpu", *overrides])
    return save_value_model(cfg, policy, out, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--value-for", default="", help="also save a value model for this preset's prompts")
    parser.add_argument("--value-out", type=Path, default=None, help="where the value model goes")
    parser.add_argument("--set", action="append", default=[], help="a config override of the run the value "
                        "model is for (its provenance must match that run's), KEY=VALUE")
    parser.add_argument("--layers", type=int, default=0, help="num_hidden_layers (0: the public config's)")
    parser.add_argument("--hidden", type=int, default=0, help="hidden_size (0: the public config's)")
    parser.add_argument("--intermediate", type=int, default=0, help="intermediate_size (0: the public config's)")
    parser.add_argument("--heads", type=int, default=0, help="num_attention_heads (0: the public config's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the weights are made (cuda: faster)")
    args = parser.parse_args()
    policy = save_standin(args.out, {"num_hidden_layers": args.layers, "hidden_size": args.hidden,
                                     "intermediate_size": args.intermediate, "num_attention_heads": args.heads},
                          seed=args.seed, device=args.device)
    print(f"stand-in policy: {policy}")
    if args.value_for:
        if args.value_out is None:
            parser.error("--value-for needs --value-out")
        print(f"value model: {value_model_for(policy, args.value_for, args.value_out, args.set, args.device)}")


if __name__ == "__main__":
    main()
