"""Character-level tokenizer for the embedded tiny policies.

One token per printable ASCII character plus newline, and four specials. It is a
`tokenizers` WordLevel model wrapped as a `PreTrainedTokenizerFast`, so it saves
and loads with `save_pretrained` / `from_pretrained` like any HF tokenizer.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Callable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from caspo.config import ConfigError
from caspo.models.hub import hub_errors

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
CHARSET = list(string.digits + string.ascii_letters + string.punctuation + " \n")


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARSET)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Every character is its own piece; spaces and newlines are kept, not stripped.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def save_tokenizer(tok, path: str | Path) -> None:
    """`save_pretrained`, recording a plain fast tokenizer as such so it loads back as itself."""
    tok.save_pretrained(str(path))
    if type(tok) is not PreTrainedTokenizerFast:  # a model-specific class records itself
        return
    cfg_path = Path(path) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def load_tokenizer(path: str | Path):
    """Load a tokenizer folder (or hub id) and refuse one that does not round-trip spaces. One without a pad
    token pads with its EOS.

    `AutoTokenizer` picks the class from the model type, so a character-level tokenizer
    saved beside a Qwen2 config comes back as Qwen2's tokenizer, which drops spaces. Our
    own folders record "PreTrainedTokenizerFast" and load as that; any tokenizer must
    round-trip a probe with spaces and newlines, or loading fails.
    """
    folder = Path(path)
    if folder.is_dir() and not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise ConfigError(f"{path} holds no tokenizer ({', '.join(TOKENIZER_FILES)}); save it beside the model "
                          "with tokenizer.save_pretrained(DIR), as model.save_pretrained alone does not")
    cfg_path = folder / "tokenizer_config.json"
    saved_class = json.loads(cfg_path.read_text()).get("tokenizer_class") if cfg_path.exists() else None
    with hub_errors(str(path)):
        if saved_class == "PreTrainedTokenizerFast":
            tok = PreTrainedTokenizerFast.from_pretrained(str(path))
        else:
            tok = AutoTokenizer.from_pretrained(str(path))
    probe = "Mia has 14 marbles.\n12 + 7 = 19"
    ids = tok.encode(probe, add_special_tokens=False)
    back = tok.decode(ids)
    if back != probe:
        raise ConfigError(f"tokenizer at {path} does not round-trip text ({probe!r} -> {back!r}); set "
                          "tokenizer_class in tokenizer_config.json to the class it was saved with")
    if tok.pad_token is None:  # Llama-family tokenizers ship none; masks come from lengths, so it only fills
        tok.pad_token = tok.eos_token
    return tok


def chat_turn_end_ids(tokenizer) -> list[int]:
    """The special token the chat template writes after an assistant's message ([<|im_end|>] for Qwen's,
    [<|eot_id|>] for Llama 3's), or [] without a chat template or where the message is followed by plain text.
    A completion of a chat prompt ends there, whether or not the model's generation config lists it: the
    config of a base model (Qwen2.5-Math-1.5B's) names only <|endoftext|>."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    marker = "TURN-END-PROBE"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}],
                                         tokenize=False)
    after = tokenizer.encode(text[text.rindex(marker) + len(marker):], add_special_tokens=False)
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return after[:1] if after and after[0] in special else []


def batch_decoder(tokenizer) -> tuple[Callable[[list[list[int]]], list[str]], bool]:
    """([tokenizer.decode(ids, skip_special_tokens=True) for ids in batch] in one call, whether that decode
    concatenates the tokens' own texts where each is complete text: segment_responses's arguments).

    A fast tokenizer that does not clean up spaces decodes with its Rust backend's decode_batch, which is what
    its decode calls row by row (on every core, without decode's per-call Python work); any other tokenizer
    with its own batch_decode. Byte-level BPE (Qwen2, Llama 3, GPT-2) and the character tokenizer's Fuse
    concatenate; other decoders (a SentencePiece Metaspace drops the first token's space) are not assumed to.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return (lambda batch: tokenizer.batch_decode(batch, skip_special_tokens=True)), False
    concatenative = type(backend.decoder).__name__ in ("ByteLevel", "Fuse")
    return (lambda batch: backend.decode_batch(batch, skip_special_tokens=True)), concatenative
