"""The command line: a user error is one red line naming the problem and the fix (a second line points to
--debug), exit status 2 and no traceback; --debug raises it; any other exception is a bug and raises."""

import json
from importlib.metadata import version

import pytest
from typer.testing import CliRunner

import caspo
from caspo import cli
from caspo.cli import app
from caspo.cli_args import checked_config
from caspo.config import ConfigError

QUICK = ["eval.before=false", "eval.after=false", "train.steps=1", "model.threads=1"]


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_user_error(result, command: str, message: str):
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()[-2:]  # after what ran before it (a progress bar)
    assert lines[1] == "(caspo --debug ... shows the traceback)", lines
    assert "error" not in "".join(result.stderr.strip().splitlines()[:-2])
    assert lines[0].startswith(f"{command} error: ") and message in lines[0], lines[0]


def test_version_is_the_installed_package_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout == f"caspo {version('caspo')}\n"
    assert caspo.__version__ == version("caspo")


@pytest.fixture
def files(tmp_path):
    bad_rows = tmp_path / "rows.jsonl"
    bad_rows.write_text('{"problem": "1 + 1?", "answer": "2"}\n{"problem": "2 + 2?"\n')
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text('{"step": 1}\n')
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    run = tmp_path / "run1"
    (run / "checkpoints" / "step_000002" / "policy").mkdir(parents=True)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"train:\n  steps: 2 # caf\xe9\n")
    return {"rows": bad_rows, "used": used, "empty": not_a_model, "tmp": tmp_path, "run": run, "latin1": latin1}


CASES = [  # (command line, the command, part of the message); {name} is a path of the `files` fixture
    ("config tests optim.lr=-1", "config", "optim.lr must be > 0, got -1.0"),
    ("config tests data.template=nope", "config", "data.template='nope' is no template name and has no {query}"),
    ("config tests data.source={tmp}/none.jsonl data.eval_source=math500", "config",
     "none.jsonl: no such data file; check the data path in the config (in data.source)"),
    ("train tests model.policy={tmp}/no-model", "train", "no-model': no such folder; pass a folder with config.json"),
    ("train tests model.policy={empty}", "train", "is a folder without config.json"),
    ("train tests model.policy=embedded:nope", "train", "no embedded policy 'nope' (shipped: tiny-arith"),
    ("train tests train.output_dir={tmp}/run --resume {tmp}/nowhere", "train", "nowhere (expected a step_* folder"),
    ("train tests train.output_dir={used}", "train", "already holds a run (metrics.jsonl); resume it with --resume"),
    ("train tests train.output_dir={tmp}/run data.source={rows} data.eval_source=math500", "train",
     "rows.jsonl: 1 invalid row of 2 (rows-2); first: "),
    ("train tests train.output_dir={tmp}/run data.max_prompt_tokens=3", "train",
     "prompt of row 'arith-train-0' is 100 tokens, over data.max_prompt_tokens=3"),
    ("train tests train.output_dir={tmp}/run model.device=cpu rollout.backend=native "
     "rollout.shared_prefix_attention=true rollout.cuda_graphs=true", "train",
     "rollout.cuda_graphs and rollout.shared_prefix_attention=true need a CUDA device; the policy is on cpu"),
    ("train tests train.output_dir={tmp}/run data.max_prompt_tokens=500", "train",
     "a sequence may reach 540 tokens (data.max_prompt_tokens plus the longest of rollout.max_new_tokens"),
    ("sft tests sft.lr=0 --output {tmp}/sft", "sft", "sft.lr must be > 0"),
    ("config tests model.policy=", "config", "model.policy is empty; set it to a policy folder"),
    ("config {latin1}", "config", "latin1.yaml is not UTF-8 text (byte 23: invalid continuation byte); re-save it"),
    ("train tests train.output_dir={rows}", "train", "rows.jsonl is a file; pass a folder path for the run"),
    ("train tests train.output_dir={rows}/run", "train", "rows.jsonl/run is inside {rows}, which is a file"),
    ("sft tests --output {tmp}/sft --init {run}", "sft",
     "--init {run} is a run folder; pass one of its checkpoints' policies, e.g. {run}/checkpoints/step_000002/policy"),
    ("sft tests --output {tmp}/sft --init {run}/checkpoints/step_000002", "sft",
     "is a checkpoint folder; pass its policy: {run}/checkpoints/step_000002/policy"),
    ("eval {tmp}/nothing --out {tmp}/out", "eval", "nothing: not a run folder"),
    ("eval embedded:tiny-arith --checkpoints step_3 --out {tmp}/out", "eval", "picks checkpoints of a run folder"),
    ("eval embedded:tiny-arith --samples -1 --out {tmp}/out", "eval", "eval.samples must be >= 0"),
    ("verify-resume tests reward.workers=-3", "verify-resume", "reward.workers must be >= 0"),
    ("value collect tests --out {tmp}/l.jsonl --shard 4", "value", "shard must look like i/n (e.g. 0/4), got '4'"),
    ("value probe {tmp} {tmp}/none.jsonl", "value", "none.jsonl: no such label file; `caspo value collect`"),
    ("suite tests --methods grpo --seeds 0,a --out {tmp}/s", "suite",
     "--seeds: 'a' is not an integer (--seeds takes a comma list of integers)"),
]


@pytest.mark.parametrize("line, command, message", CASES, ids=[c[0].split(" {")[0] for c in CASES])
def test_user_errors_are_one_line_and_exit_2(files, line, command, message):
    args = line.format(**files).split()
    quick = QUICK if args[0] == "train" else []
    for name, path in files.items():  # a message may name a path of the fixture (and hold other braces)
        message = message.replace(f"{{{name}}}", str(path))
    assert_user_error(invoke(*args[:2], *quick, *args[2:]), command, message)


def test_debug_shows_the_traceback():
    result = invoke("--debug", "config", "tests", "optim.lr=-1")
    assert result.exit_code == 1 and isinstance(result.exception, ConfigError)
    assert str(result.exception) == "optim.lr must be > 0, got -1.0"


def test_a_bug_is_not_a_user_error(monkeypatch):
    def broken(cfg):
        raise KeyError("not the user's fault")

    monkeypatch.setattr(cli, "to_yaml", broken)
    result = invoke("config", "tests")
    assert result.exit_code == 1 and isinstance(result.exception, KeyError)
    assert "config error" not in result.output


def test_config_prints_a_valid_config():
    result = invoke("config", "tests", "optim.lr=2e-4")
    assert result.exit_code == 0 and "lr: 0.0002" in result.stdout


@pytest.mark.parametrize("overrides, message", [
    (["data.template='Solve: {q}'"], "is no template name and has no {query}"),
    (["sft.skip_last_when=never"], "ArithSpec.skip_last_when='never': must be 'any' or 'last_op_'"),
    (["data.source='hf:'", "data.eval_source=math500"], "names no dataset; write hf:NAME"),
    (["eval.benchmarks=[math500, missing.parquet]"],
     r"missing.parquet: no such data file;.*\(in eval.benchmarks\[1\]\)"),
    (["data.eval_source=math5000"], r"unknown data source 'math5000'.*\(in data.eval_source\)"),
])
def test_checks_after_load_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        checked_config("tests", overrides)


def test_sources_that_are_not_files_pass_the_existence_check():
    cfg = checked_config("tests", ["data.source=hf:org/dataset@train", "data.eval_source=math500",
                                   "eval.benchmarks=[gsm8k, arith, heldout]", "data.template='Q: {query}'"])
    assert cfg.data.template == "Q: {query}"
    # an evaluation reads no training data: a missing data.source matters only to the heldout benchmark
    evaluation = checked_config("tests", ["data.source=gone.jsonl", "data.eval_source=math500"], data=False)
    assert (evaluation.data.source, evaluation.data.eval_source) == ("gone.jsonl", "math500")
    with pytest.raises(ConfigError, match=r"gone.jsonl: no such data file;.*\(in data.source\)"):
        checked_config("tests", ["data.source=gone.jsonl", "data.eval_source=math500",
                                 "eval.benchmarks=[heldout]"], data=False)


def test_eval_flags_are_checked_like_overrides(tmp_path, monkeypatch):
    seen = {}

    def evaluate_targets(cfg, targets, out):
        seen.update(samples=cfg.eval.samples, top_p=cfg.eval.top_p, benchmarks=cfg.eval.benchmarks)
        return []

    monkeypatch.setattr("caspo.eval.run.evaluate_targets", evaluate_targets)
    result = invoke("eval", "embedded:tiny-arith", "--samples", 3, "--top-p", 0.5, "--benchmarks", "math500, gsm8k",
                    "--preset", "qwen-math-dsr", "--out", tmp_path)
    assert result.exit_code == 0, result.output
    assert seen == {"samples": 3, "top_p": 0.5, "benchmarks": ["math500", "gsm8k"]}
    assert json.loads(result.stdout)["results"] == {}


def test_eval_of_a_policy_on_math_benchmarks_needs_a_preset(tmp_path):
    result = invoke("eval", "embedded:tiny-arith", "--benchmarks", "arith,gsm8k", "--out", tmp_path)
    assert result.exit_code == 2
    assert "gsm8k need(s) a real run's template and token budget: add --preset qwen-math-dsr" in result.output


def test_resuming_with_another_seed_is_a_user_error(tmp_path):
    run = [f"train.output_dir={tmp_path / 'run'}", *QUICK]
    assert invoke("train", "tests", *run).exit_code == 0
    result = invoke("train", "tests", *run, "train.steps=2", "train.seed=5", "--resume", "latest")
    assert_user_error(result, "train", "the checkpoint's prompt stream has seed=0, this run's has 5")


def test_a_branch_refuses_a_folder_holding_a_run_and_a_resume_names_what_changed(tmp_path, files):
    run = tmp_path / "run"
    assert invoke("train", "tests", f"train.output_dir={run}", *QUICK).exit_code == 0
    checkpoint = run / "checkpoints" / "step_000001"
    # a branch from another run's checkpoint into a folder that holds a run would cut its logs back to step 1
    result = invoke("train", "tests", f"train.output_dir={files['used']}", *QUICK, "--resume", checkpoint)
    assert_user_error(result, "train", f"resuming {checkpoint} into it would mix two runs")
    branch = tmp_path / "branch"
    result = invoke("train", "tests", f"train.output_dir={branch}", *QUICK[:-2], "train.steps=2", "model.threads=1",
                    "--resume", checkpoint)
    assert result.exit_code == 0, result.output
    changes = [f"train.output_dir: {run} -> {branch}", "train.steps: 1 -> 2"]
    assert "settings changed from the checkpoint's:" in result.stderr.replace("\n", "")
    start = json.loads((branch / "run.json").read_text())["starts"][-1]
    assert start["config_changes"] == changes and start["step"] == 1
    assert start["data"]["train"]["examples"] > 0  # the data summary the run printed, kept
    assert [json.loads(x)["step"] for x in (branch / "metrics.jsonl").read_text().splitlines()] == [2]
    (branch / "run.json").write_text('{"starts": [')  # a damaged record of the run is named, not a traceback
    result = invoke("train", "tests", f"train.output_dir={branch}", *QUICK[:-2], "train.steps=3", "model.threads=1",
                    "--resume", "latest")
    assert_user_error(result, "train", "run.json: not valid JSON")
    # --overwrite removes every file of the old run, its evaluations among them
    (run / "eval").mkdir()
    (run / "eval" / "step_000600.json").write_text("{}")
    assert invoke("train", "tests", f"train.output_dir={run}", *QUICK, "--overwrite").exit_code == 0
    assert not (run / "eval").exists()


def test_a_cuda_index_beyond_the_visible_devices_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert checked_config("tests", ["model.device=cuda:1"]).model.device == "cuda:1"
    assert checked_config("tests", ["model.device=cuda"]).model.device == "cuda"
    with pytest.raises(ConfigError, match=r"^model.device=cuda:2, but 2 CUDA devices are visible \(cuda:0 to cuda:1\); "
                                          "pick one of them or model.device=cuda$"):
        checked_config("tests", ["model.device=cuda:2"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert_user_error(invoke("config", "tests", "model.device=cuda:1"), "config",
                      "model.device=cuda:1, but 1 CUDA device is visible (cuda:0)")


def test_a_tilde_in_path_arguments_is_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    seen = {}
    monkeypatch.setattr("caspo.eval.run.evaluate_targets",
                        lambda cfg, targets, out: seen.update(policy=targets[0].policy, out=out) or [])
    import shutil

    from caspo.models.policy import ASSETS

    shutil.copytree(ASSETS / "tiny-arith", tmp_path / "pol")
    result = invoke("eval", "~/pol", "--out", "~/out", "--benchmarks", "arith", "--limit", 1)
    assert result.exit_code == 0, result.output
    assert seen == {"policy": str(tmp_path / "pol"), "out": str(tmp_path / "out")}
    result = invoke("config", "tests", "model.policy=~/pol", "train.output_dir=~/runs/x")
    assert result.exit_code == 0, result.output
    assert f"policy: {tmp_path}/pol" in result.stdout and f"output_dir: {tmp_path}/runs/x" in result.stdout
