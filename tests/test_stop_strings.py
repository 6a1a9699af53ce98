"""Stop strings: the token filter skips only steps on which the full check could not succeed."""

import random

import pytest

from caspo.models.bpe import build_qwen_tokenizer
from caspo.rollout.stop_strings import WINDOW, StopStrings


@pytest.fixture(scope="module")
def tokenizer():
    return build_qwen_tokenizer()


def first_stop(tokens, strings, decode):
    """The step at which the full check (every step, no filter) first finds a stop string, or None."""
    for t in range(1, len(tokens) + 1):
        tail = decode(tokens[:t][-WINDOW:])
        if any(tail.endswith(s) for s in strings):
            return t
    return None


def streams(tokenizer, pieces, count, seed):
    """Token streams cut from texts that contain the stop strings among other text, in the real BPE encoding
    (so stop strings arrive merged with their neighbours, split across tokens, or as byte pieces)."""
    rng = random.Random(seed)
    filler = ["The answer is", " 42", ".\n", "\n\n", " so x = ", "é", "\\frac{1}{2}", " Problem", ":", "</", "ans",
              "wer>", "é", "日本", " ", "\n"]
    for _ in range(count):
        text = "".join(rng.choice(filler + pieces) for _ in range(rng.randint(5, 40)))
        yield tokenizer.encode(text)


@pytest.mark.parametrize("strings", [["\n\n\nProblem:"], ["</answer>", ")"], ["\\boxed{"],
                                     ["\n\n"], ["é"], ["Problem:", " "]])
def test_the_filter_finds_every_stop_the_full_check_finds(tokenizer, strings):
    decode = tokenizer.decode
    checked = 0
    for tokens in streams(tokenizer, strings, 300, seed=len(strings[0])):
        stops = StopStrings(strings, decode)
        found = next((t for t in range(1, len(tokens) + 1) if stops.ended(tokens[:t])), None)
        assert found == first_stop(tokens, strings, decode), (strings, tokens)
        checked += found is not None
    assert checked >= 30  # the streams do reach their stop strings


def test_steps_that_cannot_end_a_stop_string_decode_one_token_once(tokenizer):
    calls = []

    def decode(ids):
        calls.append(len(ids))
        return tokenizer.decode(ids)

    stops = StopStrings(["\n\n\nProblem:"], decode)
    tokens = tokenizer.encode("x = 1 + 2 = 3, and y = 1 + 2 = 3 again" * 3)
    assert not any(stops.ended(tokens[:t]) for t in range(1, len(tokens) + 1))
    assert all(n == 1 for n in calls) and len(calls) == len(set(tokens))  # no window decoded: no token has ':'
    assert StopStrings(["\n\n"], decode).every_step and StopStrings(["é"], decode).every_step
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(["ok", ""], decode)
