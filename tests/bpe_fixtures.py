"""Tiny random Qwen2 and Llama checkpoints with Qwen2.5's BPE tokenizer, saved as folders as users have them.

- qwen: Qwen2 with tied embeddings, its tokenizer saved as `Qwen2Tokenizer` (so `AutoTokenizer` loads it as a
  hub download of Qwen2.5 loads), no BOS; generation_config.json lists two EOS ids, as Qwen2.5's chat models do.
- llama: Llama with untied embeddings and the same vocabulary; its tokenizer adds a BOS (`<|bos|>`, id 151665)
  to every encoding, as Llama tokenizers do.

Both have Qwen2.5's 151,936 embedding rows (the tokenizer's ids end at 151,665), hidden size 32, two layers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config

from caspo.models.bpe import build_qwen_tokenizer
from caspo.models.tokenizer import save_tokenizer

VOCAB = 151_936
ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645
EOS_IDS = [IM_END, ENDOFTEXT]  # generation_config.json of Qwen2.5's chat models
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096)


@dataclass(frozen=True)
class RealModels:
    qwen: Path
    llama: Path


def save_model(config, path: Path, eos_ids: list[int], seed: int) -> None:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos_ids,
                                               pad_token_id=ENDOFTEXT)
    model.save_pretrained(path)


def save_qwen(path: Path, cache_dir: Path | None = None) -> Path:
    tok = build_qwen_tokenizer(cache_dir=cache_dir)
    save_model(Qwen2Config(**SHAPE, tie_word_embeddings=True, bos_token_id=ENDOFTEXT, eos_token_id=ENDOFTEXT),
               path, EOS_IDS, seed=0)
    tok.save_pretrained(path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"  # as Qwen2.5's tokenizer_config.json says
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def save_llama(path: Path, cache_dir: Path | None = None) -> Path:
    tok = build_qwen_tokenizer(bos_token="<|bos|>", add_bos=True, cache_dir=cache_dir)
    save_model(LlamaConfig(**SHAPE, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                           eos_token_id=ENDOFTEXT), path, [ENDOFTEXT, IM_END], seed=1)
    save_tokenizer(tok, path)  # recorded as PreTrainedTokenizerFast: it loads back as itself, BOS included
    return path


def save_real_models(root: Path, cache_dir: Path | None = None) -> RealModels:
    return RealModels(qwen=save_qwen(root / "qwen", cache_dir), llama=save_llama(root / "llama", cache_dir))
