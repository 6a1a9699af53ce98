"""Token offsets from cumulative decoding, token step ids, response segmentation, batching."""

import json
import random
import re
from bisect import bisect_right
from pathlib import Path

import pytest
import torch

from caspo.data.registry import SHIPPED
from caspo.segment import (
    char_offsets_from_tokens,
    final_box_end,
    latex_step_starts,
    pad_step_ids,
    segment_response,
    token_step_ids,
)

MATH_TEST = SHIPPED["math"].path  # the 5,000 MATH test problems, with their solutions
FIXTURE = Path(__file__).parent / "data" / "segment" / "upstream_splits.jsonl"
UNICODE_TEXT = "Café ∑ x² = 4 😀 — naïve 数学\n$\\boxed{7}$ done."


def math_solutions(n):
    """The first ``n`` MATH test solutions the package ships."""
    if not MATH_TEST.exists():
        pytest.skip(f"{MATH_TEST} not found")
    with MATH_TEST.open() as rows:
        return [json.loads(line)["solution"] for _, line in zip(range(n), rows)]


def piece_decoder(pieces):
    """Tokens are whole strings: decode joins them."""
    return lambda ids: "".join(pieces[i] for i in ids)


def byte_decode(ids):
    """Tokens are single bytes; a partial UTF-8 character decodes to U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


def cumulative_offsets(decode, ids):
    """Oracle: offset = longest prefix of the full text that decode(ids[:i]) agrees with."""
    full, ends, best = decode(ids), [], 0
    for i in range(1, len(ids) + 1):
        prefix = decode(ids[:i])
        n = 0
        while n < min(len(prefix), len(full)) and prefix[n] == full[n]:
            n += 1
        best = max(best, n)
        ends.append(best)
    return [0] + ends[:-1]


@pytest.fixture(scope="module")
def bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [UNICODE_TEXT] * 5 + math_solutions(300)
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


# ---------------------------------------------------------------- offsets


def test_char_level_offsets():
    text = "Let $x = 2$.\nThen $y = 4$."
    chars = sorted(set(text))
    ids = [chars.index(c) for c in text]
    assert char_offsets_from_tokens(piece_decoder(chars), ids) == list(range(len(text)))


def test_partial_utf8_tokens_share_the_character_offset():
    ids = list("aé b".encode())  # a, c3, a9, space, b
    # "a\ufffd" does not extend the visible text: the c3 byte gets the offset of "é"
    assert char_offsets_from_tokens(byte_decode, ids) == [0, 1, 1, 2, 3]
    ids = list("x😀y".encode())  # four bytes for the emoji
    assert char_offsets_from_tokens(byte_decode, ids) == [0, 1, 1, 1, 1, 2]


def test_empty_tokens_take_the_next_visible_offset():
    pieces = ["hi", "", " there", ""]  # e.g. skipped special tokens
    assert char_offsets_from_tokens(piece_decoder(pieces), [0, 1, 2, 3]) == [0, 2, 2, 8]
    assert char_offsets_from_tokens(piece_decoder(pieces), []) == []


def test_leading_space_stripped_at_decode_start():
    # SentencePiece-style: "▁" is a space, dropped at the start of a decode
    pieces = ["▁Let", "▁x", "▁=", "▁2", ".", "\n", "▁So", "▁x", "²"]
    decoded = []

    def decode(ids):
        decoded.append(len(ids))
        return "".join(pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")

    ids = [0, 1, 2, 3, 4, 5, 6, 7, 8] * 20
    assert char_offsets_from_tokens(decode, ids) == cumulative_offsets(decode, ids)
    decoded.clear()
    char_offsets_from_tokens(decode, ids)
    assert sum(decoded) < 6 * len(ids)  # windowed, not the quadratic fallback


def test_tokenizer_that_rewrites_earlier_text():
    # clean-up of " ," changes text already shown, so the exact path must take over
    pieces = ["a", " ", ",", "b"]

    def decode(ids):
        return "".join(pieces[i] for i in ids).replace(" ,", ",")

    ids = [0, 1, 2, 1, 3]  # "a , b" -> "a, b"
    assert char_offsets_from_tokens(decode, ids) == [0, 1, 1, 2, 3]


def test_random_byte_groupings_match_cumulative_decode():
    rng = random.Random(0)
    alphabet = "ab \n$é∑😀数"
    for _ in range(300):
        data = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))).encode()
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(0, len(data) - 1)))
        pieces = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]  # arbitrary byte tokens

        def decode(ids):
            return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

        ids = list(range(len(pieces)))
        assert char_offsets_from_tokens(decode, ids) == cumulative_offsets(decode, ids)


def test_bpe_offsets_match_cumulative_decode(bpe):
    texts = [UNICODE_TEXT, "数学 😀😀 é" * 3, *math_solutions(20)]
    for text in texts:
        ids = bpe.encode(text).ids
        decode = bpe.decode
        assert decode(ids) == text
        assert char_offsets_from_tokens(decode, ids) == cumulative_offsets(decode, ids)


def test_bpe_offsets_match_tokenizer_offsets_on_ascii(bpe):
    text = "Since $x^2 = 4$, we get $x = \\pm 2$.\nSo the answer is $\\boxed{2}$."
    enc = bpe.encode(text)
    assert char_offsets_from_tokens(bpe.decode, enc.ids) == [a for a, _ in enc.offsets]


def test_incremental_decoding_is_linear(bpe):
    ids = bpe.encode(UNICODE_TEXT * 40).ids
    decoded = []

    def decode(window):
        decoded.append(len(window))
        return bpe.decode(window)

    char_offsets_from_tokens(decode, ids)
    assert sum(decoded) < 6 * len(ids)  # a full cumulative decode would be about len(ids)**2 / 2


# ---------------------------------------------------------------- token steps


def test_token_step_ids_hand_case():
    offsets = [0, 3, 5, 9, 12]
    assert token_step_ids(offsets, [0, 5, 10], 5) == [0, 0, 1, 1, 2]
    assert token_step_ids(offsets, [0, 5, 10], 6) == [0, 0, 1, 1, 2, 2]  # undecoded EOS: last step
    assert token_step_ids(offsets, [0, 5, 10], 3) == [0, 0, 1]
    with pytest.raises(ValueError, match="tokens but no steps"):
        token_step_ids(offsets, [], 5)


LINES = ["We compute it.", "\nThe answer is $\\boxed{7}$", "\nThis trailing text is junk", "\nMore junk"]


def char_tokens(text):
    chars = sorted(set(text))
    return piece_decoder(chars), [chars.index(c) for c in text]


def expected_ids(lines):
    return [k for k, line in enumerate(lines) for _ in line]


def test_segment_response_newline():
    decode, ids = char_tokens("".join(LINES))
    out = segment_response(decode, ids, splitter="newline")
    assert out.text == "".join(LINES)
    assert out.step_starts_chars == [0, 14, 40, 67]
    assert out.num_steps == 4
    assert out.token_step_ids == expected_ids(LINES)


def test_max_steps_merges_the_tail_into_the_last_step():
    decode, ids = char_tokens("".join(LINES))
    out = segment_response(decode, ids, splitter="newline", max_steps=2)
    assert out.step_starts_chars == [0, 14] and out.num_steps == 2
    assert out.token_step_ids == expected_ids([LINES[0], "".join(LINES[1:])])


def test_after_final_box_merge():
    decode, ids = char_tokens("".join(LINES))
    out = segment_response(decode, ids, splitter="newline", after_final_box="merge")
    assert out.step_starts_chars == [0, 14]
    assert out.token_step_ids == expected_ids([LINES[0], "".join(LINES[1:])])
    keep = segment_response(decode, ids, splitter="newline", after_final_box="keep")
    assert keep.num_steps == 4


def test_final_box_end():
    assert final_box_end("so $\\boxed{\\frac{1}{2}}$ ok") == len("so $\\boxed{\\frac{1}{2}}")
    assert final_box_end("$\\boxed{1}$ then $\\boxed{2}$") == len("$\\boxed{1}$ then $\\boxed{2}")
    assert final_box_end("no box here") is None
    assert final_box_end("\\boxed{open") is None


def test_step_without_token_is_folded():
    # "\ny\nz" is one token, so the step starting at "\nz" owns no token
    decode = piece_decoder(["x", "\ny\nz"])
    out = segment_response(decode, [0, 1], splitter="newline")
    assert out.step_starts_chars == [0, 1]
    assert out.token_step_ids == [0, 1]
    assert out.num_steps == 2


def test_segment_response_edge_cases(bpe):
    assert segment_response(bpe.decode, []).num_steps == 0
    empty = segment_response(piece_decoder([""]), [0, 0])  # tokens but no text: one step
    assert empty.token_step_ids == [0, 0] and empty.num_steps == 1
    with pytest.raises(ValueError, match=r"unknown splitter 'sentences'; choose from \['latex', 'newline'\]"):
        segment_response(bpe.decode, [1], splitter="sentences")


def test_segment_response_latex_with_bpe(bpe):
    text = (
        "We find that $x = 19.$ Substituting gives the value $y = 7.$"
        "\nTherefore the answer is $\\boxed{7}$."
    )
    out = segment_response(bpe.decode, bpe.encode(text).ids, splitter="latex")
    assert out.text == text and out.step_starts_chars[0] == 0
    ids = out.token_step_ids
    assert ids[0] == 0 and ids[-1] == out.num_steps - 1
    assert all(b - a in (0, 1) for a, b in zip(ids, ids[1:]))  # contiguous, non-decreasing


def test_space_before_a_word_opens_the_step_with_its_token():
    # the language cut falls after " and", so the next step starts with the token " the"
    text = ("The first part of this sentence is long enough to stand alone and"
            " the second part of this sentence is also long enough by itself")
    words = re.findall(r" ?\S+", text)
    out = segment_response(piece_decoder(words), list(range(len(words))))
    k = words.index(" the")
    assert out.num_steps == 2 and out.step_starts_chars == [0, text.index(" the")]
    assert out.token_step_ids == [0] * k + [1] * (len(words) - k)


def test_token_steps_follow_upstream_token_rule(bpe):
    # upstream gives each token the step of the character at its tokenizer offset; caspo reads the offset off the
    # cumulative decode. The tokens of every step must be the same (a step no token starts in owns none)
    for row in map(json.loads, FIXTURE.open()):
        text = "".join(row["steps"])
        enc = bpe.encode(text)
        starts = latex_step_starts(text)
        upstream = [bisect_right(starts, a) - 1 for a, _ in enc.offsets]
        rank = {k: i for i, k in enumerate(sorted(set(upstream)))}
        out = segment_response(bpe.decode, enc.ids)
        assert out.token_step_ids == [rank[k] for k in upstream], row["id"]
        assert out.step_starts_chars == [starts[k] for k in sorted(rank)]


# ---------------------------------------------------------------- batching


def test_pad_step_ids():
    ids, counts = pad_step_ids([[0, 0, 1], [0], []])
    assert ids.dtype == torch.long and counts.dtype == torch.long
    assert ids.tolist() == [[0, 0, 1], [0, -1, -1], [-1, -1, -1]]
    assert counts.tolist() == [2, 1, 0]
    ids, _ = pad_step_ids([[0, 1]], seq_len=4)
    assert ids.tolist() == [[0, 1, -1, -1]]
    with pytest.raises(ValueError, match="a response has 3 tokens, more than seq_len=2"):
        pad_step_ids([[0, 1, 2]], seq_len=2)
