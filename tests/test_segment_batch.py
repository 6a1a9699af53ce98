"""A batch of responses segmented at once (segment_responses) equals segment_response row by row."""

import json
import random
from functools import partial
from pathlib import Path

import pytest

from caspo.models.bpe import build_qwen_tokenizer
from caspo.models.tokenizer import batch_decoder, build_char_tokenizer
from caspo.segment import segment_response, segment_responses

MATH500 = Path(__file__).resolve().parents[1] / "caspo" / "data" / "benchmarks" / "math500.jsonl"
OPTIONS = [dict(splitter="latex"), dict(splitter="newline", max_steps=3),
           dict(splitter="latex", after_final_box="merge")]


@pytest.fixture(scope="module")
def qwen():
    return build_qwen_tokenizer()


def solutions(count: int) -> list[str]:
    rows = [json.loads(line) for _, line in zip(range(count), MATH500.open())]
    return [r["solution"] + "\nSo the answer is $\\boxed{" + r["answer"] + "}$." for r in rows]


def responses(tokenizer, seed: int = 0) -> list[list[int]]:
    """Solutions as a policy writes them (with Unicode), random ids (partial UTF-8 characters, special tokens
    that decode to nothing), one token, and nothing."""
    rng = random.Random(seed)
    texts = solutions(6) + ["Café ∑ x² = 4 😀 — naïve 数学\n$\\boxed{7}$ done."]
    rows = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    vocab = len(tokenizer)
    rows += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 300))] for _ in range(6)]
    rows[2] = rows[2][:40] + [tokenizer.eos_token_id] + rows[2][40:]  # a special token inside complete text
    return rows + [rows[0][:1], []]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("name", ["qwen", "char"])
def test_a_batch_equals_one_response_at_a_time(name, options, qwen):
    tokenizer = qwen if name == "qwen" else build_char_tokenizer()
    decode = partial(tokenizer.decode, skip_special_tokens=True)
    decode_many, concatenative = batch_decoder(tokenizer)
    assert concatenative  # byte-level BPE and the character tokenizer's Fuse
    rows = responses(tokenizer)
    expected = [segment_response(decode, ids, **options) for ids in rows]
    for flag in (concatenative, False):
        got = segment_responses(decode, decode_many, rows, flag, **options)
        assert [s.token_step_ids for s in got] == [s.token_step_ids for s in expected]
        assert [s.step_starts_chars for s in got] == [s.step_starts_chars for s in expected]
        assert [s.text for s in got] == [s.text for s in expected]
    assert sum(s.num_steps for s in expected) > len(rows)  # the rows have steps to get wrong


def test_only_tokens_that_split_a_character_are_decoded(qwen):
    """Complete tokens take their offsets from running lengths; a run of tokens that splits a character is
    decoded on its own, token by token."""
    calls = []

    def decode(ids):
        calls.append(len(ids))
        return qwen.decode(ids, skip_special_tokens=True)

    decode_many, concatenative = batch_decoder(qwen)
    clean = [qwen.encode(t) for t in solutions(4)]
    segment_responses(decode, decode_many, clean, concatenative)
    assert calls == []
    ids = qwen.encode("So $x = 4$, $\\sum$ is ∑ and 🜁 ꙮ 𓀀 too. " * 3 + solutions(1)[0])
    split = sum("\ufffd" in qwen.decode([t]) for t in ids)
    assert split > 0
    got = segment_responses(decode, decode_many, [ids], concatenative)
    assert 0 < max(calls) <= split and len(calls) < len(ids) / 2  # the split runs only, not every token
    assert got[0].token_step_ids == segment_response(decode, ids).token_step_ids


def test_batch_decoder_decodes_as_decode(qwen):
    rng = random.Random(1)
    for tokenizer in (qwen, build_char_tokenizer()):
        rows = [[rng.randrange(len(tokenizer)) for _ in range(50)] for _ in range(20)]
        decode_many, _ = batch_decoder(tokenizer)
        assert decode_many(rows) == [tokenizer.decode(r, skip_special_tokens=True) for r in rows]


def test_a_decoder_that_does_not_concatenate_is_not_assumed_to(qwen):
    """A tokenizer that cleans up spaces decodes through its batch_decode and is not concatenative; with such a
    decode (here one that drops spaces before punctuation) the batch still equals the row-by-row result."""

    class CleaningUp:
        clean_up_tokenization_spaces = True

        def batch_decode(self, batch, skip_special_tokens):
            return [self.decode(ids) for ids in batch]

        def decode(self, ids, skip_special_tokens=True):
            return qwen.decode(ids, skip_special_tokens=True).replace(" .", ".").replace(" ,", ",")

    tokenizer = CleaningUp()
    decode_many, concatenative = batch_decoder(tokenizer)
    assert not concatenative
    rows = [qwen.encode("a , b . c\n$x$ , y ."), qwen.encode(solutions(1)[0])]
    got = segment_responses(tokenizer.decode, decode_many, rows, concatenative, splitter="newline")
    assert [s.token_step_ids for s in got] == [segment_response(tokenizer.decode, r, "newline").token_step_ids
                                               for r in rows]
