"""Stop strings: the token filter skips only steps on which the full check could not succeed."""

import random

import pytest

from caspo.models.bpe import build_qwen_tokenizer
from caspo.rollout.stop_strings import StopStrings


@pytest.fixture(scope="module")
def tokenizer():
    return build_qwen_tokenizer()


def first_stop(tokens, strings, decode):
    """The step at which the whole decoded text first contains a stop string (vLLM's rule), or None."""
    for t in range(1, len(tokens) + 1):
        if any(s in decode(tokens[:t]) for s in strings):
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


@pytest.mark.parametrize("text, stop", [("so 3.\n\n\nProblem:\nWhat", "\n\n\nProblem:"),
                                        ("<answer>3</answer>\nmore", "</answer>"),
                                        ("done \\end{document}\n\nmore", "\\end{document}")])
def test_a_stop_string_ending_inside_a_token_stops_there(tokenizer, text, stop):
    tokens = tokenizer.encode(text)
    t = first_stop(tokens, [stop], tokenizer.decode)
    assert not tokenizer.decode(tokens[:t]).endswith(stop)  # the token that completes it carries more text
    stops = StopStrings([stop], tokenizer.decode)
    assert next(u for u in range(1, len(tokens) + 1) if stops.ended(tokens[:u])) == t


def test_a_stop_string_longer_than_the_window_in_single_characters():
    def decode(ids):  # one character per token
        return "".join(chr(i) for i in ids)

    stop = "Problem " * 6  # 48 characters, 48 tokens
    tokens = [ord(c) for c in "x" * 10 + stop + "y"]
    stops = StopStrings([stop], decode)
    assert next(u for u in range(1, len(tokens) + 1) if stops.ended(tokens[:u])) == 10 + len(stop)
    # a stop string already in the text before the last token is not found again (it stopped the sequence then)
    assert not stops.ended(tokens)


def test_a_stop_string_begun_in_the_context_is_found(tokenizer):
    """A Monte Carlo continuation of a step boundary: the response prefix ends in a token holding "\n\n" (BPE
    merges ".\n\n"), and the continuation writes "\nProblem:". The check reads the prefix as context."""
    stop = "\n\n\nProblem:"
    prefix = tokenizer.encode("We get $x=2$.\n\n")
    assert tokenizer.decode(prefix[-1:]).endswith("\n\n")  # the newlines sit inside the prefix's last token
    continuation = tokenizer.encode("\nProblem: next one")
    stops = StopStrings([stop], tokenizer.decode)
    at = first_stop(prefix + continuation, [stop], tokenizer.decode) - len(prefix)
    assert next(t for t in range(1, len(continuation) + 1) if stops.ended(continuation[:t], prefix)) == at
    assert not any(stops.ended(continuation[:t]) for t in range(1, len(continuation) + 1))  # without the context
