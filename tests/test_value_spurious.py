"""The spurious-line check: which prefixes it builds and where it reads their values."""

import math
from types import SimpleNamespace

import pytest

from caspo.value.spurious import probe_responses, spurious_line_check

SOLUTION = "14 + 6 = 20\n20 - 9 = 11\n\\boxed{11}"


def test_probe_responses_by_hand():
    assert probe_responses(SOLUTION) == {"correct": "14 + 6 = 20\n20 - 9 = 11", "skipped": "14 + 6 = 20",
                                         "spurious": "14 + 6 = 20\n20 - 9 = 11\n11 * 2 = 22"}
    assert probe_responses("14 + 6 = 20\n20 * 3 = 60\n\\boxed{60}") is None  # the policy never skips a product


def test_values_are_read_at_the_end_of_each_prefix():
    """A stand-in model whose V is the number of response tokens read: σ(len/β) for each prefix."""
    from caspo.models.policy import resolve_model_path
    from caspo.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path("embedded:tiny-arith"))
    counting = SimpleNamespace(beta=10.0, cumulative=lambda batch: batch.response_mask.cumsum(-1))
    product_last = "2 * 3 = 6\n\\boxed{6}"
    report = spurious_line_check(counting, tokenizer, [[5, 6]] * 3, [product_last, SOLUTION, SOLUTION], problems=1)
    texts = probe_responses(SOLUTION)
    lengths = {name: len(tokenizer.encode(text, add_special_tokens=False)) for name, text in texts.items()}
    assert report["problems"] == 1  # the product-last problem is passed over, the limit stops at one
    for name, n in lengths.items():
        assert report[f"mean_prob_{name}"] == pytest.approx(1 / (1 + math.exp(-n / 10.0)))
    assert report["share_spurious_above_correct"] == 1.0


def test_a_split_without_usable_problems_is_refused():
    with pytest.raises(ValueError, match="no problem ends in"):
        spurious_line_check(SimpleNamespace(beta=10.0), None, [[5]], ["2 * 3 = 6\n\\boxed{6}"])


def test_check_spurious_command(value_model_folder):
    """φ = reference values every prefix at 1/2; a preset with another prompt format is refused."""
    import json

    from typer.testing import CliRunner

    from caspo.value.cli import value_app

    runner = CliRunner()
    result = runner.invoke(value_app, ["check-spurious", str(value_model_folder), "tests", "--problems", "5"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["problems"] == 5 and report["share_spurious_above_correct"] == 0.0
    assert all(report[f"mean_prob_{n}"] == pytest.approx(0.5) for n in ("correct", "skipped", "spurious"))
    refused = runner.invoke(value_app, ["check-spurious", str(value_model_folder), "tests", "data.template=plain"])
    assert refused.exit_code != 0 and "trained on prompts" in refused.output
