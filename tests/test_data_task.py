"""The run's examples (caspo.data.task, caspo.data.build): training prompts that are evaluation problems
counted, a held-out set that is the training source refused, the summary's counts after long prompts are
left out, and a step that asks for more prompts than there are."""

import json

import pytest
from test_data_loading import char_tokenizer

from caspo.config import load_config
from caspo.data import SHIPPED, DataError
from caspo.data.build import load_task_data
from caspo.data.overlap import problem_key
from caspo.data.task import load_examples, task_examples
from caspo.runlog import console

OLYMPIAD_1930 = "Find all triples $(a, b, c)$ of positive integers such that $a^{3}+b^{3}+c^{3}=(a b c)^{2}$."
DSR_SUB_708 = "Find all triples $(a, b, c)$ of positive integers such that $a^3 + b^3 + c^3 = (abc)^2$."
SUMS = [{"problem": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(6)]


@pytest.fixture
def printed(capsys, monkeypatch):
    """What the console prints (to stderr), one line per message however long."""
    monkeypatch.setattr(console, "width", 1000)
    return lambda: capsys.readouterr().err


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def shipped_problems(name, n):
    rows = [json.loads(line) for line in SHIPPED[name].path.read_text().split("\n")[:n]]
    return [{"problem": r["problem"], "answer": r["answer"]} for r in rows]


def test_the_problem_key_ignores_spacing_case_and_braces_but_not_signs():
    assert problem_key(DSR_SUB_708) == problem_key(OLYMPIAD_1930)
    assert problem_key("Compute $\\arccos (-1).$") != problem_key("Compute $\\arccos 1.$")


def test_training_prompts_that_are_benchmark_problems_are_counted_and_printed(tmp_path, printed):
    math500 = shipped_problems("math500", 3)
    respaced = {**math500[2], "problem": "  " + math500[2]["problem"].replace(" ", "  ").upper()}
    train = write_jsonl(tmp_path / "train.jsonl", [*SUMS, math500[0], math500[1], respaced,
                                                   {"problem": DSR_SUB_708, "answer": "(1, 2, 3)"}])
    cfg = load_config("tests", [f"data.source={train}", "data.eval_source=gsm8k", "eval.heldout_size=5",
                                "eval.benchmarks=[math500,olympiadbench,gsm8k,heldout]"])
    summary = task_examples(cfg).summary
    assert summary["benchmark_overlap"] == {"math500": 3, "olympiadbench": 1, "gsm8k": 0}
    out = printed()
    assert "data: benchmark math500 (eval.benchmarks) shares 3 problems with the training prompts" in out
    assert "benchmark olympiadbench (eval.benchmarks) shares 1 problem with" in out and "gsm8k (eval" not in out
    limited = load_config("tests", [f"data.source={train}", "data.eval_source=gsm8k", "eval.limit=2",
                                    "eval.benchmarks=[math500]"])
    assert task_examples(limited).summary["benchmark_overlap"] == {"math500": 2}  # the problems it evaluates


def test_a_file_benchmark_and_the_heldout_set_are_compared_by_the_same_key(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [*SUMS, {"problem": DSR_SUB_708, "answer": "(1, 2, 3)"}])
    held = write_jsonl(tmp_path / "held.jsonl", [{"problem": OLYMPIAD_1930, "answer": "(1, 2, 3)"}])
    bench = write_jsonl(tmp_path / "bench.jsonl", [{"problem": "WHAT is 3  plus 3 ?", "answer": "6"}])
    cfg = load_config("tests", [f"data.source={train}", f"data.eval_source={held}", f"eval.benchmarks=[{bench}]"])
    summary = task_examples(cfg).summary
    assert summary["overlap"] == 1 and summary["benchmark_overlap"] == {str(bench): 1}


def test_a_heldout_set_that_is_the_training_source_is_an_error(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", SUMS)
    same = [("dsr_sub", "dsr_sub"), (str(train), str(tmp_path / "." / "train.jsonl"))]
    for source, eval_source in same:
        cfg = load_config("tests", [f"data.source={source}", f"data.eval_source={eval_source}"])
        with pytest.raises(DataError, match=r"is data.source itself, so the run would be evaluated on the rows it "
                                            r"trains on: .*data.heldout_fraction=0.05.* another data.eval_source"):
            task_examples(cfg)
    assert task_examples(load_config("tests", ["data.eval_source=arith"])).eval  # arith's own held-out split


def long_and_short(tmp_path):
    rows = [{"problem": ("x" * 40 if i % 3 == 0 else "y") + f" {i}?", "answer": str(i)} for i in range(9)]
    return write_jsonl(tmp_path / "rows.jsonl", rows), write_jsonl(tmp_path / "held.jsonl", SUMS)


def test_the_summary_counts_the_examples_left_after_long_prompts(tmp_path, printed):
    train, held = long_and_short(tmp_path)
    cfg = load_config("tests", [f"data.source={train}", f"data.eval_source={held}", "data.template=plain",
                                "data.add_bos=false", "data.max_prompt_tokens=20", "data.long_prompts=skip"])
    data = load_task_data(cfg, char_tokenizer())
    assert len(data.train) == 6 and data.summary["train"]["used"] == 6 and data.summary["train"]["skipped_long"] == 3
    assert data.summary["heldout"]["used"] == len(data.eval) == 6
    out = printed()
    assert f"data train: {train}, 6 examples of 9 rows" in out and out.count("data train:") == 1
    assert "3 prompts over data.max_prompt_tokens=20 left out (data.long_prompts=skip): rows-1, rows-4, rows-7" in out


def test_more_prompts_per_step_than_training_examples_is_an_error(tmp_path):
    train, held = long_and_short(tmp_path)
    fields = [f"data.source={train}", f"data.eval_source={held}", "data.template=plain", "data.add_bos=false",
              "train.minibatch_size=2"]
    exact = load_config("tests", [*fields, "rollout.prompts_per_step=9"])
    assert len(load_task_data(exact, char_tokenizer()).train) == 9  # one pass a step: no repeats
    with pytest.raises(DataError, match=r"rollout.prompts_per_step=10 is more than the 9 training examples, so every "
                                        r"step would repeat prompts: set rollout.prompts_per_step <= 9"):
        load_task_data(load_config("tests", [*fields, "rollout.prompts_per_step=10"]), char_tokenizer())
    skipping = [*fields, "data.max_prompt_tokens=20", "data.long_prompts=skip", "rollout.prompts_per_step=7"]
    with pytest.raises(DataError, match="prompts_per_step=7 is more than the 6 training examples"):
        load_task_data(load_config("tests", skipping), char_tokenizer())  # counted after the long ones are left out


def test_a_gold_longer_than_the_answer_limit_is_an_invalid_row(tmp_path):
    """reward.max_answer_chars bounds what the verifier reads of an answer: a gold past it could never be
    matched, so the row is refused at load, under the run's limit and not the default."""
    gold = "\\frac{x_{0}+x_{1}+x_{2}+x_{3}+x_{4}+x_{5}}{2}"  # 44 characters
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"problem": "p", "answer": gold}) + "\n" + json.dumps({"problem": "q", "answer": "3"}))
    loose = load_config("tests", [f"data.source={rows}", "data.eval_source=arith", "reward.max_answer_chars=300"])
    assert len(load_examples(loose, str(rows), "train").examples) == 2
    tight = load_config("tests", [f"data.source={rows}", "data.eval_source=arith", "reward.max_answer_chars=20",
                                  "data.skip_invalid=true"])
    result = load_examples(tight, str(rows), "train")
    assert [e.label for e in result.examples] == ["3"] and len(result.invalid) == 1
