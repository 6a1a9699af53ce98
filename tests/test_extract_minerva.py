"""The `minerva` extractor takes time linear in the response (eval runs it in the main process, unbounded), and
reads the answers it read with its former, quadratic pattern."""

import re
import time

import pytest

from caspo.reward.extract import _FINAL, _closing_dollar, extract_answer, has_box, last_boxed, minerva_answer

_FORMER_HOPE = re.compile(r"\.?\s*I\s+hope\s+it\s+is\s+correct", re.IGNORECASE)


def former_minerva_answer(text: str) -> str | None:
    """minerva_answer as it was with the pattern `\\.?\\s*I\\s+hope...`, which rescans runs of spaces."""
    last = None
    for last in _FINAL.finditer(text):
        pass
    if last is None:
        return None
    rest = text[last.end():].lstrip()
    if rest.startswith("$"):
        fence = "$$" if rest.startswith("$$") else "$"
        end = _closing_dollar(rest, len(fence), fence)
        if end is None:
            return None
        answer = rest[len(fence):end]
    else:
        answer = rest.split("\n", 1)[0]
        hope = _FORMER_HOPE.search(answer)
        if hope:
            answer = answer[:hope.start()]
        answer = re.sub(r"\.\s*$", "", answer.strip())
    answer = answer.strip()
    if has_box(answer):
        return last_boxed(answer)
    return answer or None


NORMAL = [
    "Final Answer: The final answer is $42$. I hope it is correct.",
    "The final answer is 42. I hope it is correct.",
    "The final answer is 42 . I hope it is correct.",
    "The final answer is 42.. I hope it is correct.",
    "The final answer is 42.  . I hope it is correct.",
    "The final answer is 42.\tI  hope\tit is correct",
    "The final answer is 42.I hope it is correct.",
    "The final answer is 42 I hope it is correct. I hope it is correct.",
    "The final answer is x = 3.5. i HOPE IT IS CORRECT",
    "The final answer is Hi hope it is correct",  # "i hope" inside a word, as before
    "The final answer is 7.\u00a0I hope it is correct.",  # a no-break space
    "The final answer is: 3.5.\nMore text",
    "The final answer is 12 apples. I think",
    r"The final answer is \boxed{7}. I hope it is correct.",
    "The final answer is . I hope it is correct.",
    "The final answer is I hope it is correct.",
    "The final answer is $5$. Hmm, the final answer is 6. I hope it is correct.",
    "the final answer is 42.   ",
    "no phrase at all",
]


@pytest.mark.parametrize("text", NORMAL)
def test_the_same_answers_as_the_former_pattern(text):
    assert minerva_answer(text) == former_minerva_answer(text)


@pytest.mark.parametrize("text", [
    "The final answer is 4" + " " * 40_000 + "x",
    "The final answer is 4." + " " * 40_000 + "I hope",
    "The final answer is 4" + " \t" * 20_000,
    "The final answer is " + ". " * 20_000,
])
def test_runs_of_spaces_take_linear_time(text):
    start = time.perf_counter()
    extract_answer(text, "minerva")
    assert time.perf_counter() - start < 0.1  # the former pattern: 0.1 s at 5,000 spaces, 25 s at 40,000


def test_the_same_answers_on_random_endings():
    import random

    rng = random.Random(0)
    pieces = ["42", "x", ".", " ", "  ", "\t", "I", "i", " hope", "\n", "$", "Hi", "I hope it is correct",
              "i  HOPE it\tis correct", ". I hope it is correct"]
    for _ in range(3000):
        text = "The final answer is" + "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 14)))
        assert minerva_answer(text) == former_minerva_answer(text), repr(text)
