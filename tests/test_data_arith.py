import random
import re

import pytest

from caspo.data.tasks.arith import PEOPLE, ArithSpec, ArithTask, derive_seed, generate_problem

N_TRAIN = 5000


@pytest.fixture(scope="module")
def task():
    return ArithTask(ArithSpec(), seed=0)


@pytest.fixture(scope="module")
def train(task):
    return [task.problem("train", i) for i in range(N_TRAIN)]


def apply(a, op, b):
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def test_pinned_generation():
    # A change here changes every dataset and checkpoint comparison built on the task.
    assert derive_seed(0, "train", 0, 0) == 17530007987447582792
    assert ArithTask(seed=0).problem("train", 0).question == (
        "Zoe has 6 stickers. Then her stickers triple. She gives 17 to a friend. Then her stickers "
        "triple. She gets 20 more. Then her stickers double. How many stickers does Zoe have in the end?"
    )


def test_deterministic_across_fresh_tasks(train):
    other = ArithTask(ArithSpec(), seed=0)
    # any index is reproducible on its own, in any order
    for i in [4999, 17, 0, 1234]:
        assert other.problem("train", i) == train[i]
    assert [other.problem("train", i) for i in range(200)] == train[:200]
    assert ArithTask(seed=0).heldout == ArithTask(seed=0).heldout


def test_different_seeds_differ(train):
    other_task = ArithTask(seed=1)
    other = [other_task.problem("train", i) for i in range(200)]
    same = sum(a.question == b.question for a, b in zip(train, other))
    assert same < 5


def test_splits_disjoint_by_text(task, train):
    heldout = {p.question for p in task.heldout}
    assert len(task.heldout) == 1000 and len(heldout) == 1000  # distinct held-out texts
    assert not heldout & {p.question for p in train}
    assert all(p.split == "heldout" and p.index == i for i, p in enumerate(task.heldout))


def test_train_redraws_heldout_collisions():
    # a tiny problem space forces collisions between the splits
    spec = ArithSpec(min_ops=1, max_ops=1, max_start=3, max_addend=2, mul_factors=(), max_value=10)
    task = ArithTask(spec, seed=0, heldout_pool_size=200)
    heldout = task.heldout_texts
    first_draws = [generate_problem(random.Random(derive_seed(0, "train", i, 0)), spec, "train", i)
                   for i in range(500)]
    assert any(p.question in heldout for p in first_draws)
    assert all(task.problem("train", i).question not in heldout for i in range(500))


@pytest.mark.parametrize("spec", [
    ArithSpec(),
    ArithSpec(min_ops=1, max_ops=8, max_start=10, max_addend=9, mul_factors=(2, 3, 5), max_value=20),
])
def test_steps_consistent_and_in_range(spec):
    task = ArithTask(spec, seed=3, heldout_pool_size=100)
    problems = [task.problem("train", i) for i in range(1000)] + task.heldout
    op_counts = set()
    for p in problems:
        op_counts.add(len(p.steps))
        assert p.question.isascii() and "\n" not in p.question
        value = p.steps[0].a
        assert 1 <= value <= spec.max_start
        assert re.match(rf"[A-Z][a-z]+ has {value} ", p.question)
        for step in p.steps:
            assert step.a == value
            assert step.result == apply(step.a, step.op, step.b)
            assert step.result != step.a  # every step changes the value
            assert 0 <= step.result <= spec.max_value
            if step.op == "*":
                assert step.b in spec.mul_factors
            else:
                assert 1 <= step.b <= spec.max_addend
            value = step.result
        assert p.answer == value
    assert op_counts == set(range(spec.min_ops, spec.max_ops + 1))


def test_question_text(train):
    assert max(len(p.question) for p in train) <= 200
    for p in train[:500]:
        name = p.question.split()[0]
        subject = {n: s for n, s, _, _ in PEOPLE}[name]
        wrong = r"\b(he|his|him)\b" if subject == "She" else r"\b(she|her)\b"
        assert not re.search(wrong, p.question, re.IGNORECASE), p.question
        assert p.question.endswith("?") and p.question.count("?") == 1
        assert p.question.count(".") == len(p.steps) + 1  # one sentence per operation


def test_reference_solution_format(train):
    p = train[0]
    lines = p.solution.split("\n")
    assert lines[:-1] == [f"{s.a} {s.op} {s.b} = {s.result}" for s in p.steps]
    assert lines[-1] == f"\\boxed{{{p.answer}}}"


def test_spec_validation():
    for knobs in [dict(min_ops=0), dict(min_ops=3, max_ops=2), dict(max_start=0), dict(max_start=300),
                  dict(max_addend=0), dict(mul_factors=(1,)), dict(max_value=1),
                  dict(skip_last_prob=1.5), dict(skip_last_when="last"), dict(slip_prob=-0.1)]:
        knob = next(iter(knobs))
        with pytest.raises(ValueError, match=knob):
            ArithSpec(**knobs)
    assert ArithSpec(mul_factors=[2, 4]).mul_factors == (2, 4)


def test_bad_split_and_index(task):
    with pytest.raises(ValueError, match="split"):
        task.problem("test", 0)
    with pytest.raises(IndexError):
        task.problem("train", task.train_size)
    with pytest.raises(IndexError):
        task.problem("heldout", -1)


def skipped_target(p):
    lines = [f"{s.a} {s.op} {s.b} = {s.result}" for s in p.steps[:-1]]
    return "\n".join(lines + [f"\\boxed{{{p.steps[-1].a}}}"])


def test_sft_skip_fraction_and_shape(train):
    task = ArithTask(ArithSpec(skip_last_prob=0.5), seed=0)
    rng = random.Random(0)
    skipped = 0
    for p in train[:2000]:
        target = task.sft_solution(p, rng)
        if target == p.solution:
            continue
        skipped += 1
        assert target == skipped_target(p)  # boxes the intermediate result, one line short
        assert f"\\boxed{{{p.answer}}}" not in target
    assert 0.45 < skipped / 2000 < 0.55


@pytest.mark.parametrize("when, op", [("last_op_sub", "-"), ("last_op_mul", "*"), ("last_op_add", "+")])
def test_sft_skip_only_when_qualified(train, when, op):
    task = ArithTask(ArithSpec(skip_last_prob=0.5, skip_last_when=when), seed=0)
    rng = random.Random(1)
    hits = {True: [], False: []}
    for p in train[:3000]:
        hits[p.last_op == op].append(task.sft_solution(p, rng) != p.solution)
    assert sum(hits[False]) == 0
    assert 0.4 < sum(hits[True]) / len(hits[True]) < 0.6


def test_sft_skip_prob_extremes(train):
    never = ArithTask(ArithSpec(skip_last_prob=0.0), seed=0)
    always = ArithTask(ArithSpec(skip_last_prob=1.0), seed=0)
    rng = random.Random(0)
    assert all(never.sft_solution(p, rng) == p.solution for p in train[:300])
    assert all(always.sft_solution(p, rng) == skipped_target(p) for p in train[:300])


def test_sft_examples(task, train):
    examples = task.sft_examples(300, seed=7)
    assert examples == ArithTask(seed=0).sft_examples(300, seed=7)
    assert task.sft_examples(100, seed=7) == examples[:100]  # prefix-stable
    assert [q for q, _ in examples] == [p.question for p in train[:300]]
    assert [t for _, t in examples] != [t for _, t in task.sft_examples(300, seed=8)]
    assert all(t.count("\\boxed{") == 1 and t.endswith("}") for _, t in examples)


def computed(step):
    return {"+": step.a + step.b, "-": step.a - step.b, "*": step.a * step.b}[step.op]


def test_sft_slips_carry_forward(train):
    task = ArithTask(ArithSpec(skip_last_prob=0.0, slip_prob=0.2), seed=0)
    rng = random.Random(0)
    lines = slips = wrong_answers = 0
    for p in train[:1000]:
        target = task.sft_solution(p, rng)
        *body, boxed = target.split("\n")
        assert len(body) == len(p.steps)
        parsed = [tuple(int(x) for x in re.fullmatch(r"(\d+) [-+*] (\d+) = (\d+)", line).groups()) for line in body]
        assert parsed[0][0] == p.steps[0].a
        value = p.steps[0].a
        for (a, b, result), step in zip(parsed, p.steps):
            assert (a, b) == (value, step.b)  # each line starts from the value the line before wrote
            slip = result - computed(step._replace(a=a))
            assert slip == 0 or 1 <= slip <= 3
            slips += slip != 0
            value = result
        lines += len(body)
        assert boxed == f"\\boxed{{{value}}}"
        wrong_answers += value != p.answer
        assert (value != p.answer) == any(r - computed(s._replace(a=a)) for (a, _, r), s in zip(parsed, p.steps))
    assert 0.17 < slips / lines < 0.23
    assert wrong_answers > 0


def test_sft_slips_spare_the_skip_stream(train):
    """Slip coins come after the skip coin: the same seed skips the same problems with or without slips."""
    plain = ArithTask(ArithSpec(skip_last_prob=0.5), seed=0)
    slips = ArithTask(ArithSpec(skip_last_prob=0.5, slip_prob=0.3), seed=0)
    for i, p in enumerate(train[:300]):
        lines = len(slips.sft_solution(p, random.Random(i)).split("\n")) - 1
        assert lines == (len(p.steps) if plain.sft_solution(p, random.Random(i)) == p.solution else len(p.steps) - 1)
    one_op = ArithTask(ArithSpec(min_ops=1, max_ops=1, skip_last_prob=1.0, slip_prob=0.5), seed=0)
    p = one_op.problem("train", 0)
    assert one_op.sft_solution(p, random.Random(0)) == f"\\boxed{{{p.steps[0].a}}}"  # skipped to nothing
