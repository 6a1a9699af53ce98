import json

import pytest
from transformers import AutoTokenizer, Qwen2Config

from caspo.models.policy import resolve_model_path
from caspo.models.tokenizer import build_char_tokenizer, load_tokenizer, save_tokenizer

TEXT = "Mia has 14 marbles. She finds 6 more.\nSolution:\n14 + 6 = 20\n\\boxed{20}"


def test_char_tokenizer_round_trip(tmp_path):
    tok = build_char_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) == len(TEXT)  # one token per character
    assert tok.decode(ids) == TEXT
    save_tokenizer(tok, tmp_path)
    Qwen2Config(vocab_size=len(tok)).save_pretrained(tmp_path)  # the trap: a Qwen2 config beside it
    again = load_tokenizer(tmp_path)
    assert again.encode(TEXT, add_special_tokens=False) == ids
    assert again.decode(ids) == TEXT
    assert (again.pad_token_id, again.eos_token_id, again.bos_token_id) == (0, 1, 2)


def test_a_tokenizer_that_drops_spaces_is_refused(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)  # without recording the class
    Qwen2Config(vocab_size=len(tok)).save_pretrained(tmp_path)
    auto = AutoTokenizer.from_pretrained(str(tmp_path))  # picks Qwen2's class, which drops the space
    assert auto.decode(auto.encode("a b", add_special_tokens=False)) != "a b"
    with pytest.raises(ValueError, match="does not round-trip"):
        load_tokenizer(tmp_path)


def test_shipped_tokenizer_round_trips():
    path = resolve_model_path("embedded:tiny-arith")
    assert json.loads(open(f"{path}/tokenizer_config.json").read())["tokenizer_class"] == "PreTrainedTokenizerFast"
    tok = load_tokenizer(path)
    assert tok.decode(tok.encode(TEXT, add_special_tokens=False)) == TEXT
