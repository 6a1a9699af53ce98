"""The phase-1 command line's knobs: `caspo value collect --pairing`, `caspo value train --max-train-prefix-len
--save-every` and `caspo value smoke`, through the `caspo` app as a user runs them."""

import json
import typing

import pytest
from typer.testing import CliRunner

from caspo.cli import app
from caspo.config import load_config
from caspo.value.cli import collect as collect_command
from caspo.value.collect import PAIRINGS
from caspo.value.labels import read_label_file
from caspo.value.train import split_rows

pytestmark = pytest.mark.timeout(180)

SMALL = ["reward.workers=0", "model.threads=1", "--prompts", "12", "--k", "4", "--j", "2", "--boundaries", "2"]


def run(*args):
    return CliRunner().invoke(app, ["value", *map(str, args)])


def ok(*args) -> str:
    result = run(*args)
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture(scope="module")
def labels_path(tmp_path_factory):
    """One collection of every rollout of the mixed-outcome prompts (pairing all) on the tests preset."""
    path = tmp_path_factory.mktemp("labels") / "all.jsonl"
    ok("collect", "tests", *SMALL, "--out", path)
    return path


@pytest.fixture
def labels(labels_path):
    return read_label_file(labels_path)


def test_the_pairing_choices_are_the_collections():
    assert typing.get_args(typing.get_type_hints(collect_command)["pairing"]) == PAIRINGS


@pytest.mark.parametrize("pairing", ["paper", "paper_multi"])
def test_collect_pairing_labels_the_first_right_and_wrong_rollouts(tmp_path, labels, pairing):
    out = tmp_path / f"{pairing}.jsonl"
    header = json.loads(ok("collect", "tests", *SMALL, "--pairing", pairing, "--out", out))
    paired = read_label_file(out)
    assert header["pairing"] == paired.header["pairing"] == pairing
    by_prompt = {}
    for r in labels.rows:
        by_prompt.setdefault(r.prompt_index, {})[r.sample] = r.base_reward
    assert by_prompt and header["stats"]["mixed_prompts"] == len(by_prompt)
    assert header["stats"]["mc_reward_unscored"] == 0  # every rollout and continuation had a verdict
    expected = set()  # (prompt, sample) that the pairing picks, read off the `all` collection's outcomes
    for prompt, outcomes in by_prompt.items():
        right = sorted(s for s, r in outcomes.items() if r > 0.5)
        wrong = sorted(s for s, r in outcomes.items() if r <= 0.5)
        n = 1 if pairing == "paper" else min(len(right), len(wrong))
        expected |= {(prompt, s) for s in right[:n] + wrong[:n]}
    assert {(r.prompt_index, r.sample) for r in paired.rows} == expected
    assert header["stats"]["labelled_rollouts"] == len(expected)
    # same seeds: a paired collection's rows are the `all` collection's rows of those rollouts
    assert paired.rows == [r for r in labels.rows if (r.prompt_index, r.sample) in expected]


def test_collect_refuses_an_unknown_pairing(tmp_path):
    result = run("collect", "tests", "--pairing", "pairs", "--out", tmp_path / "l.jsonl")
    assert result.exit_code == 2 and "Invalid value for '--pairing'" in result.output
    assert not (tmp_path / "l.jsonl").exists()


def test_train_drops_long_prefixes_and_saves_every_epoch(tmp_path, labels_path, labels):
    cap = sorted(r.boundary for r in labels.rows)[len(labels.rows) // 2]  # the median prefix length
    out = tmp_path / "value"
    summary = json.loads(ok("train", labels_path, "--policy", "embedded:tiny-arith", "--out", out,
                            "--val-fraction", 0.5, "--epochs", 2, "--batch-size", 8,
                            "--max-train-prefix-len", cap, "--save-every", 1))
    train_rows, _ = split_rows(labels.rows, "prompt", 0.5, seed=0)
    dropped = sum(r.boundary > cap for r in train_rows)
    assert 0 < dropped < len(train_rows)
    assert summary["dropped_long_prefixes"] == dropped and summary["train_rows"] == len(train_rows) - dropped
    assert json.loads((out / "metrics.json").read_text())["spec"]["max_train_prefix_len"] == cap
    steps_per_epoch = -(-(len({(r.prompt_index, r.sample) for r in train_rows if r.boundary <= cap})) // 8)
    epochs = [out / f"step_{steps_per_epoch * e:06d}" for e in (1, 2)]
    assert summary["epoch_checkpoints"] == [str(f) for f in epochs]
    for e, folder in enumerate(epochs, 1):
        assert json.loads((folder / "metrics.json").read_text())["epoch"] == e
        assert (folder / "value_config.json").is_file()


@pytest.mark.parametrize("flag", ["--max-train-prefix-len", "--save-every"])
def test_train_refuses_a_negative_knob(tmp_path, flag):
    result = run("train", tmp_path / "l.jsonl", "--policy", "embedded:tiny-arith", "--out", tmp_path / "v",
                 flag, -1)
    assert result.exit_code == 2 and f"Invalid value for '{flag}'" in result.output


def test_smoke_reports_the_gate_and_exits_1_below_the_threshold(value_model_folder):
    args = ["smoke", "tests", f"method.caspo.value_model={value_model_folder}", "reward.workers=0"]
    passing = run(*args, "--threshold", 0.0)
    assert passing.exit_code == 0, passing.output
    report = json.loads(passing.stdout[passing.stdout.index("{"):])
    # φ = reference: V = 0 on every response, σ = 1/2 reads as "wrong": v_acc is the share of wrong responses
    assert report["threshold"] == 0.0 and report["passed"]
    assert report["v_acc"] == pytest.approx(1 - report["positive_rate"])
    assert report["n"] == load_config("tests").responses_per_step
    failing = run(*args, "--threshold", 1.0)
    assert 0 < report["positive_rate"], "the tests preset's first batch must hold a right response"
    assert failing.exit_code == 1 and '"passed": false' in failing.stdout


def test_smoke_refuses_another_method_and_a_missing_value_model(value_model_folder):
    other = run("smoke", "tests", f"method.caspo.value_model={value_model_folder}", "method.name=grpo")
    assert other.exit_code == 2 and "drop method.name=grpo" in other.output
    missing = run("smoke", "tests")
    assert missing.exit_code == 2 and "method.caspo.value_model=PATH" in missing.output
    out_of_range = run("smoke", "tests", "--threshold", 1.5)
    assert out_of_range.exit_code == 2 and "Invalid value for '--threshold'" in out_of_range.output


def test_probe_reads_values_at_a_runs_precision(labels_path, labels):
    """The probe's metrics at --precision bf16 are those of V read under bf16 autocast, as a bf16 run reads it:
    mean σ(V/β) and the cross-entropy against p̂ recomputed from such values, which differ from the fp32 ones."""
    import numpy as np
    import torch

    from caspo.models.policy import ASSETS
    from caspo.models.prefix_value import load_prefix_value
    from caspo.models.tokenizer import load_tokenizer
    from caspo.value.probe import predict

    value_model = ASSETS / "tiny-arith-slips-value"  # a trained φ: its bf16 read differs from its fp32 one
    probed = {p: json.loads(ok("probe", value_model, labels_path, "--allow-mismatch", "--precision", p))
              for p in ("fp32", "bf16")}
    model = load_prefix_value(value_model, None, allow_mismatch=True)
    pad = load_tokenizer(value_model).pad_token_id
    values = {"fp32": predict(model, labels.rows, pad)}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        values["bf16"] = predict(model, labels.rows, pad)
    assert np.abs(values["bf16"] - values["fp32"]).max() > 1e-3  # bf16 moves V
    p_hat = np.array([r.p_hat for r in labels.rows])
    for precision, v in values.items():
        prob = np.clip(1 / (1 + np.exp(-v / model.beta)), 1e-7, 1 - 1e-7)
        bce = -(p_hat * np.log(prob) + (1 - p_hat) * np.log(1 - prob)).mean()
        assert probed[precision]["mean_predicted"] == pytest.approx(prob.mean(), rel=1e-12), precision
        assert probed[precision]["bce"] == pytest.approx(bce, rel=1e-12), precision
    assert probed["fp32"]["mean_predicted"] != pytest.approx(probed["bf16"]["mean_predicted"], rel=1e-12)
    assert abs(probed["fp32"]["spearman"] - probed["bf16"]["spearman"]) < 0.1  # bf16 keeps V's ranking
    result = run("probe", value_model, labels_path, "--allow-mismatch", "--precision", "fp8")
    assert result.exit_code == 2 and "--precision fp8: use one of fp32, bf16, fp16" in result.output
