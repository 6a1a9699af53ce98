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


# Bad input: each refused up front, with a message naming the flag and no traceback (exit status 2).

TRAIN = ["train", "labels.jsonl", "--policy", "embedded:tiny-arith", "--out", "v"]


@pytest.mark.parametrize("args, flag", [
    (TRAIN + ["--batch-size", 0], "--batch-size"),
    (TRAIN + ["--micro-batch-size", 0], "--micro-batch-size"),
    (TRAIN + ["--epochs", 0], "--epochs"),
    (TRAIN + ["--threads", -3], "--threads"),
    (TRAIN + ["--eval-every", -1], "--eval-every"),
    (["collect", "tests", "--out", "l.jsonl", "--prompts", 0], "--prompts"),
    (["collect", "tests", "--out", "l.jsonl", "--prompts", -5], "--prompts"),
    (["collect", "tests", "--out", "l.jsonl", "--k", 1], "--k"),
    (["collect", "tests", "--out", "l.jsonl", "--j", 0], "--j"),
    (["collect", "tests", "--out", "l.jsonl", "--boundaries", 0], "--boundaries"),
    (["probe", "v", "labels.jsonl", "--batch-size", 0], "--batch-size"),
    (["probe", "v", "labels.jsonl", "--threads", -1], "--threads"),
    (["check-mc", "tests", "--prompts", 0], "--prompts"),
    (["check-mc", "tests", "--k", 0], "--k"),
    (["check-mc", "tests", "--m", 0], "--m"),
    (["check-mc", "tests", "--planted", 0], "--planted"),
    (["check-spurious", "v", "tests", "--problems", 0], "--problems"),
    (["check-spurious", "v", "tests", "--problems", -1], "--problems"),
    (["check-spurious", "v", "tests", "--threads", -1], "--threads"),
])
def test_value_commands_refuse_a_count_out_of_range(tmp_path, monkeypatch, args, flag):
    monkeypatch.chdir(tmp_path)
    result = run(*args)
    assert result.exit_code == 2 and f"Invalid value for '{flag}'" in result.output, result.output
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("flag, value", [("--lr", "-1"), ("--lr", "0"), ("--lr", "nan"), ("--beta", "0"),
                                         ("--beta", "-2"), ("--beta", "inf")])
def test_value_train_refuses_a_rate_or_scale_that_is_not_positive(tmp_path, monkeypatch, flag, value):
    monkeypatch.chdir(tmp_path)
    result = run(*TRAIN, flag, value)
    assert result.exit_code == 2 and f"{flag} {float(value)}: must be a finite number > 0" in result.output
    assert "Traceback" not in result.output


def test_value_collect_refuses_a_state_temperature_that_is_not_positive(tmp_path):
    result = run("collect", "tests", "--out", tmp_path / "l.jsonl", "--state-temperature", 0)
    assert result.exit_code == 2 and "--state-temperature 0.0: must be a finite number > 0" in result.output


@pytest.mark.parametrize("command", [TRAIN, ["probe", "v", "labels.jsonl"]])
def test_value_device_flags_are_checked_and_named(tmp_path, monkeypatch, command):
    """--device is checked as model.device is, and its messages name --device, not model.device."""
    import torch

    monkeypatch.chdir(tmp_path)
    bogus = run(*command, "--device", "bogus")
    assert bogus.exit_code == 2, bogus.output
    assert "--device 'bogus': use cpu, cuda, cuda:N (a GPU's index) or auto" in bogus.output
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cuda = run(*command, "--device", "cuda")
    assert cuda.exit_code == 2, cuda.output
    assert "--device cuda but no CUDA device is visible; use --device cpu" in cuda.output
    assert "model.device" not in cuda.output


def test_resolve_device_names_model_device_by_default(monkeypatch):
    import torch

    from caspo.config import ConfigError
    from caspo.models.policy import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^model.device=cuda:1 but no CUDA device is visible; use model.device=cpu$"):
        resolve_device("cuda:1")
    with pytest.raises(ConfigError, match=r"^model.device='gpu': use cpu, cuda, cuda:N"):
        resolve_device("gpu")
    assert resolve_device("auto").type == "cpu" and resolve_device("cpu").type == "cpu"


@pytest.mark.parametrize("files", [["config.json"], ["model.safetensors"], ["manifest.json"]])
def test_value_train_refuses_an_out_folder_that_holds_a_model(tmp_path, files):
    out = tmp_path / "policy"
    out.mkdir()
    for name in files:
        (out / name).write_text("{}")
    result = run("train", tmp_path / "labels.jsonl", "--policy", "embedded:tiny-arith", "--out", out)
    assert result.exit_code == 2, result.output
    assert f"--out {out} holds a model already ({files[0]}); pass --overwrite" in result.output
    assert sorted(p.name for p in out.iterdir()) == files and (out / files[0]).read_text() == "{}"


def test_value_train_overwrites_a_model_folder_with_overwrite(tmp_path, labels_path):
    out = tmp_path / "value"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "notes.txt").write_text("kept")  # no model file: an empty or unrelated folder is not refused
    summary = json.loads(ok("train", labels_path, "--policy", "embedded:tiny-arith", "--out", out,
                            "--val-fraction", 0.5, "--epochs", 1, "--batch-size", 8, "--overwrite"))
    assert summary["out"] == str(out) and (out / "value_config.json").is_file()
    assert json.loads((out / "config.json").read_text())  # the value model's own config now


def test_value_train_writes_into_a_folder_without_a_model(tmp_path, labels_path):
    out = tmp_path / "value"
    out.mkdir()
    (out / "notes.txt").write_text("kept")
    ok("train", labels_path, "--policy", "embedded:tiny-arith", "--out", out, "--val-fraction", 0.5,
       "--epochs", 1, "--batch-size", 8)
    assert (out / "value_config.json").is_file() and (out / "notes.txt").read_text() == "kept"


def empty_shard(header: dict, path, shard: str):
    from caspo.value.labels import write_label_file

    kept = {k: v for k, v in header.items() if k not in ("format", "rows")}
    return write_label_file(path, {**kept, "shard": shard}, [])


def test_value_merge_refuses_to_write_an_empty_label_file(tmp_path, labels):
    from caspo.value.labels import write_label_file

    shards = [empty_shard(labels.header, tmp_path / f"s{i}.jsonl", f"{i}/2") for i in range(2)]
    result = run("merge", tmp_path / "m.jsonl", *shards)
    assert result.exit_code == 2, result.output
    assert "the 2 shards hold no labelled prefix" in result.output and "not written" in result.output
    assert not (tmp_path / "m.jsonl").exists()
    # one empty shard among others is fine: a shard may have no mixed-outcome prompt
    kept = {k: v for k, v in labels.header.items() if k not in ("format", "rows")}
    write_label_file(tmp_path / "s0.jsonl", {**kept, "shard": "0/2"}, labels.rows)
    assert f"{len(labels.rows)} rows from 2 shards" in ok("merge", tmp_path / "m.jsonl", *shards)


def test_value_collect_refuses_to_write_an_empty_collection(tmp_path, monkeypatch):
    """No prompt with both a right and a wrong base rollout: no file for a whole collection, an empty shard of
    several (the merge then judges)."""
    import caspo.value.collect as collect_module

    def all_wrong(cfg, setup, data, chunk, k, *args, **kwargs):
        return [[1, 2, 3]] * (len(chunk) * k), [0.0] * (len(chunk) * k)

    monkeypatch.setattr(collect_module, "base_rollouts", all_wrong)
    args = ["collect", "tests", "reward.workers=0", "model.threads=1", "--prompts", 4, "--k", 2]
    whole = run(*args, "--out", tmp_path / "l.jsonl")
    assert whole.exit_code == 2, whole.output
    assert "none of the 4 prompts had both a right and a wrong answer among its 2 base rollouts" in whole.output
    assert not (tmp_path / "l.jsonl").exists()
    ok(*args, "--shard", "1/2", "--out", tmp_path / "l1.jsonl")
    assert read_label_file(tmp_path / "l1.jsonl").rows == []
