"""Procedural multi-step arithmetic word problems.

A problem is a short story: a person starts with some items, then 2-5 things happen to them
(find more, give some away, the pile doubles...), and the question asks how many are left.
The reference solution writes one computation per line and boxes the result:

    Mia has 14 marbles. She finds 6 more. She gives away 9. Then her marbles triple.
    How many marbles does Mia have now?

    14 + 6 = 20
    20 - 9 = 11
    11 * 3 = 33
    \\boxed{33}

Everything is ASCII and every number stays in [0, max_value], so a tiny character-level policy
can learn the task on a CPU. Each problem comes from its own RNG seeded by (seed, split, index),
so any index is reproducible without generating the others.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

SPLITS = ("train", "heldout")
# "any", or "last_op_" + operation names joined by "_" (e.g. "last_op_sub", "last_op_add_sub")
SKIP_LAST_WHEN = ("any", "last_op_add", "last_op_sub", "last_op_mul", "last_op_add_sub")
OP_NAMES = {"+": "add", "-": "sub", "*": "mul"}
MAX_DRAWS = 1000  # attempts to find a problem text outside the held-out set (or a new held-out text)

# (name, subject pronoun, possessive pronoun, object pronoun)
PEOPLE = [
    ("Mia", "She", "her", "her"), ("Ava", "She", "her", "her"), ("Zoe", "She", "her", "her"),
    ("Lily", "She", "her", "her"), ("Emma", "She", "her", "her"), ("Nora", "She", "her", "her"),
    ("Sam", "He", "his", "him"), ("Leo", "He", "his", "him"), ("Max", "He", "his", "him"),
    ("Ben", "He", "his", "him"), ("Omar", "He", "his", "him"), ("Tom", "He", "his", "him"),
]
# (singular, plural)
ITEMS = [
    ("marble", "marbles"), ("apple", "apples"), ("sticker", "stickers"), ("coin", "coins"),
    ("card", "cards"), ("book", "books"), ("pen", "pens"), ("shell", "shells"),
    ("stamp", "stamps"), ("cookie", "cookies"), ("toy car", "toy cars"), ("bead", "beads"),
]
# Placeholders: {S} subject pronoun, {P} possessive, {O} object, {n} operand, {items} plural item.
ADD_PHRASES = [
    "{S} finds {n} more.",
    "{S} buys {n} more.",
    "{S} gets {n} more.",
    "A friend gives {O} {n} more.",
    "Then {S_lower} wins {n} more.",
]
SUB_PHRASES = [
    "{S} gives away {n}.",
    "{S} loses {n}.",
    "{S} sells {n}.",
    "Then {S_lower} trades away {n}.",
    "{S} gives {n} to a friend.",
]
MUL_VERBS = {2: "double", 3: "triple", 4: "quadruple"}
MUL_TIMES = {2: "twice", 3: "three times", 4: "four times"}
MUL_PHRASES = [
    "Then {P} {items} {verb}.",
    "{S} {verb}s {P} {items}.",
    "Now {S_lower} has {times} as many.",
]
QUESTIONS = [
    "How many {items} does {name} have now?",
    "How many {items} does {name} have in the end?",
]


@dataclass(frozen=True)
class ArithSpec:
    """Difficulty knobs of the task, and the mixture knobs of its SFT targets."""

    min_ops: int = 2  # operations per problem, inclusive range
    max_ops: int = 5
    max_start: int = 50  # starting amount is drawn from [1, max_start]
    max_addend: int = 30  # added or removed amounts are drawn from [1, max_addend]
    mul_factors: tuple[int, ...] = (2, 3)  # multiply only by these
    max_value: int = 200  # every intermediate and final value stays in [0, max_value]
    skip_last_prob: float = 0.5  # chance an SFT target skips its last computation
    skip_last_when: str = "any"  # which problems may skip: "any" or "last_op_{add,sub,mul}"
    slip_prob: float = 0.0  # chance each line of an SFT target writes a result 1-3 too high, carried on

    def __post_init__(self):
        def check(ok: bool, knob: str, why: str):
            if not ok:
                raise ValueError(f"ArithSpec.{knob}={getattr(self, knob)!r}: {why}")

        check(isinstance(self.min_ops, int) and self.min_ops >= 1, "min_ops", "must be an int >= 1")
        check(isinstance(self.max_ops, int) and self.max_ops >= self.min_ops, "max_ops", "must be an int >= min_ops")
        check(isinstance(self.max_value, int) and self.max_value >= 2, "max_value", "must be an int >= 2")
        check(isinstance(self.max_start, int) and 1 <= self.max_start <= self.max_value,
              "max_start", "must be an int in [1, max_value]")
        check(isinstance(self.max_addend, int) and self.max_addend >= 1, "max_addend", "must be an int >= 1")
        object.__setattr__(self, "mul_factors", tuple(self.mul_factors))  # accept lists from configs
        check(all(isinstance(f, int) and not isinstance(f, bool) and f >= 2 for f in self.mul_factors),
              "mul_factors", "must be ints >= 2 (use () to disable multiplication)")
        check(0.0 <= self.skip_last_prob <= 1.0, "skip_last_prob", "must be in [0, 1]")
        check(0.0 <= self.slip_prob <= 1.0, "slip_prob", "must be in [0, 1]")
        ops = self.skip_last_when.removeprefix("last_op_").split("_")
        check(self.skip_last_when == "any" or (self.skip_last_when.startswith("last_op_")
                                               and set(ops) <= set(OP_NAMES.values())),
              "skip_last_when", f"must be 'any' or 'last_op_' + ops joined by '_', e.g. {SKIP_LAST_WHEN}")


class Step(NamedTuple):
    """One computation `a op b = result`, op in '+', '-', '*'."""

    a: int
    op: str
    b: int
    result: int

    def line(self) -> str:
        return f"{self.a} {self.op} {self.b} = {self.result}"


@dataclass(frozen=True)
class ArithProblem:
    """One word problem; `steps` are its computations in order and `answer` the last result."""

    index: int
    split: str
    question: str
    answer: int
    steps: tuple[Step, ...]

    @property
    def solution(self) -> str:
        """The full reference solution: one computation per line, then the boxed answer."""
        return solution_text(self.steps, self.answer)

    @property
    def last_op(self) -> str:
        return self.steps[-1].op


def solution_text(steps, boxed: int) -> str:
    return "".join(step.line() + "\n" for step in steps) + f"\\boxed{{{boxed}}}"


def slipped_steps(steps, rng: random.Random, prob: float) -> tuple[Step, ...]:
    """`steps` recomputed along the chain, each result raised by 1-3 with probability `prob`.

    Raising a value never makes a later +, - or * result negative, so every line stays a
    well-formed computation on the value the line before it wrote.
    """
    out, value = [], steps[0].a
    for step in steps:
        result = {"+": value + step.b, "-": value - step.b, "*": value * step.b}[step.op]
        if rng.random() < prob:
            result += rng.randint(1, 3)
        out.append(Step(value, step.op, step.b, result))
        value = result
    return tuple(out)


def derive_seed(*parts) -> int:
    """A stable 64-bit seed from any parts (hash() is salted per process, so not usable here)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _draw_step(rng: random.Random, spec: ArithSpec, value: int) -> Step:
    """Draw an operation on `value`, resampling any whose result would leave [0, max_value].

    Every operation changes the value (operands >= 1, factors >= 2, no multiplying 0), so a
    solution that stops one line early always boxes a wrong answer.
    """
    kinds = ["+", "-", "*"] if spec.mul_factors else ["+", "-"]
    while True:
        op = rng.choice(kinds)
        if op == "*":
            b = rng.choice(spec.mul_factors)
            result = value * b if value > 0 else -1
        else:
            b = rng.randint(1, spec.max_addend)
            result = value + b if op == "+" else value - b
        if 0 <= result <= spec.max_value:
            return Step(value, op, b, result)


def _sentence(rng: random.Random, step: Step, pron: dict) -> str:
    if step.op == "+":
        template = rng.choice(ADD_PHRASES)
    elif step.op == "-":
        template = rng.choice(SUB_PHRASES)
    else:
        # Spelled-out verbs exist only for small factors; others use "N times as many".
        template = rng.choice(MUL_PHRASES if step.b in MUL_VERBS else MUL_PHRASES[2:])
    return template.format(
        n=step.b, verb=MUL_VERBS.get(step.b, ""), times=MUL_TIMES.get(step.b, f"{step.b} times"), **pron
    )


def generate_problem(rng: random.Random, spec: ArithSpec, split: str, index: int) -> ArithProblem:
    name, subj, poss, obj = rng.choice(PEOPLE)
    singular, plural = rng.choice(ITEMS)
    pron = dict(S=subj, S_lower=subj.lower(), P=poss, O=obj, items=plural)

    value = rng.randint(1, spec.max_start)
    steps = []
    for _ in range(rng.randint(spec.min_ops, spec.max_ops)):
        steps.append(_draw_step(rng, spec, value))
        value = steps[-1].result

    start = steps[0].a
    sentences = [f"{name} has {start} {singular if start == 1 else plural}."]
    sentences += [_sentence(rng, step, pron) for step in steps]
    sentences.append(rng.choice(QUESTIONS).format(items=plural, name=name))
    return ArithProblem(index, split, " ".join(sentences), value, tuple(steps))


class ArithTask:
    """Train and held-out splits of arithmetic word problems, deterministic from `seed`.

    The held-out split is disjoint from train by question text: the held-out set is generated
    once, and a train draw whose text is in it is rejected and re-drawn from the next derived seed.
    """

    def __init__(self, spec: ArithSpec | None = None, seed: int = 0, *,
                 train_size: int = 50_000, heldout_pool_size: int = 1000):
        if train_size < 1 or heldout_pool_size < 1:
            raise ValueError(f"train_size and heldout_pool_size must be >= 1, got {train_size}, {heldout_pool_size}")
        self.spec = spec or ArithSpec()
        self.seed = seed
        self.train_size = train_size
        self.heldout_pool_size = heldout_pool_size

    def size(self, split: str) -> int:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        return self.train_size if split == "train" else self.heldout_pool_size

    @cached_property
    def heldout(self) -> list[ArithProblem]:
        """The held-out problems, distinct in text (a repeated text is re-drawn)."""
        problems, texts = [], set()
        for index in range(self.heldout_pool_size):
            for draw in range(MAX_DRAWS):
                rng = random.Random(derive_seed(self.seed, "heldout", index, draw))
                problem = generate_problem(rng, self.spec, "heldout", index)
                if problem.question not in texts:
                    break
            else:
                raise ValueError(f"could not draw {self.heldout_pool_size} distinct held-out problems; "
                                 "the spec allows too few texts: lower heldout_pool_size or widen the knobs")
            texts.add(problem.question)
            problems.append(problem)
        return problems

    @cached_property
    def heldout_texts(self) -> frozenset[str]:
        return frozenset(p.question for p in self.heldout)

    def problem(self, split: str, index: int) -> ArithProblem:
        if not 0 <= index < self.size(split):
            raise IndexError(f"{split} index {index} out of range [0, {self.size(split)})")
        if split == "heldout":
            return self.heldout[index]
        for draw in range(MAX_DRAWS):
            rng = random.Random(derive_seed(self.seed, "train", index, draw))
            problem = generate_problem(rng, self.spec, "train", index)
            if problem.question not in self.heldout_texts:
                return problem
        raise ValueError(f"train problem {index}: every draw collides with the held-out set; widen the knobs")

    def skip_qualifies(self, problem: ArithProblem) -> bool:
        """Whether this problem's SFT target may skip its last computation."""
        when = self.spec.skip_last_when
        return when == "any" or OP_NAMES[problem.last_op] in when.removeprefix("last_op_").split("_")

    def sft_solution(self, problem: ArithProblem, rng: random.Random) -> str:
        """The SFT target: the reference solution, (with prob. skip_last_prob) one line short,
        and (with prob. slip_prob per line) arithmetic slips.

        The short version omits the last computation and boxes the intermediate result. This
        plants a behavioural mistake in the SFT policy that lives at one step of an otherwise
        correct solution and that a final-answer reward can see. The rare arithmetic errors of a
        converged policy trained without slips barely move under RL; this failure does, so it
        gives credit assignment something real to find: the reward must be traced back to the
        single line where the answer was boxed too early.

        A slip writes a result 1-3 too high; the lines after it compute correctly from the
        wrong value, so one slip anywhere makes the boxed answer wrong. A policy trained on
        slips fails at any step, and a state's chance of success falls with every line still
        to write: the testbed for prefix values whose truth is not two-valued.
        """
        skip = rng.random() < self.spec.skip_last_prob  # always drawn, so the RNG stream is stable
        steps = problem.steps[:-1] if skip and self.skip_qualifies(problem) else problem.steps
        if self.spec.slip_prob > 0 and steps:  # no draws without slips: slip-free targets stay as they were
            steps = slipped_steps(steps, rng, self.spec.slip_prob)
        return solution_text(steps, steps[-1].result if steps else problem.steps[0].a)

    def sft_examples(self, n: int, seed: int) -> list[tuple[str, str]]:
        """(question, SFT target) for train problems 0..n-1; the skip and slip coins depend on `seed`."""
        if not 0 <= n <= self.train_size:
            raise ValueError(f"n={n} must be in [0, train_size={self.train_size}]")
        examples = []
        for i in range(n):
            problem = self.problem("train", i)
            rng = random.Random(derive_seed(seed, "sft", i))
            examples.append((problem.question, self.sft_solution(problem, rng)))
        return examples
