"""`caspo eval` on planted completions: a scripted engine answers each request from a script, so the
metrics in the JSON are the hand-computed ones; a run folder is evaluated checkpoint by checkpoint."""

import json
import re
import shutil

import pytest
import yaml
from typer.testing import CliRunner

from caspo.cli import app
from caspo.config import load_config, to_yaml
from caspo.eval import run as eval_run
from caspo.eval.heldout import EVAL_RUN_SEED, EVAL_SEED_STEP
from caspo.eval.targets import resolve
from caspo.models.policy import ASSETS
from caspo.rollout.base import Completion
from caspo.rollout.sampling import sample_seed

SEEDS = {sample_seed(EVAL_RUN_SEED, EVAL_SEED_STEP, i, s): (i, s) for i in range(3) for s in range(4)}
STOP, CUT = "stop", "length"
SCRIPT = [  # per problem: the greedy completion, then its 4 samples
    {"greedy": ("so \\boxed{1}", STOP),
     "samples": [("\\boxed{1}", STOP), ("\\boxed{1}", STOP), ("\\boxed{5}", STOP), ("\\boxed{5}", STOP)]},
    {"greedy": ("I think nothing", STOP),  # no answer
     "samples": [("\\boxed{7}", STOP), ("\\boxed{2}", STOP), ("\\boxed{7}", STOP), ("\\boxed{2}", CUT)]},
    {"greedy": ("the answer is \\boxed{3}", STOP),
     "samples": [("\\boxed{3}", STOP), ("\\boxed{ 3 }", STOP), ("\\boxed{3}", STOP), ("\\boxed{three}", STOP)]},
]
EXPECTED = {  # the hand-computed metrics of SCRIPT (labels 1, 2, 3)
    "greedy": 2 / 3, "greedy_boxed_rate": 2 / 3, "greedy_truncated_rate": 0.0,
    "avg@4": (2 / 4 + 1 / 4 + 3 / 4) / 3,
    "pass@1": (2 / 4 + 1 / 4 + 3 / 4) / 3,
    "pass@2": ((1 - 1 / 6) + (1 - 3 / 6) + 1) / 3,  # 1 - C(n-c,2)/C(4,2); n-c < k gives 1
    "pass@3": (1 + (1 - 1 / 4) + 1) / 3,
    "pass@4": 1.0,
    "maj@4": 2 / 3,  # problem 0: a 2-2 tie goes to "1", seen first; problem 1: "7" wins; problem 2: "3"
    "sampled_boxed_rate": 1.0, "sampled_truncated_rate": 1 / 12,
}


class ScriptedEngine:
    """Completes each request from SCRIPT; after a publication (version >= 1) every greedy answer is right."""

    def __init__(self, tokenizer):
        self.tokenizer, self.version, self.asleep, self.published = tokenizer, 0, False, []

    def generate(self, requests, sampling):
        out = []
        for r in requests:
            i = int(re.search(r"Q(\d+)", self.tokenizer.decode(r.prompt_ids)).group(1))
            if sampling.temperature == 0:
                text, finish = (f"\\boxed{{{i + 1}}}", STOP) if self.version else SCRIPT[i]["greedy"]
            else:
                problem, s = SEEDS[r.seed]
                assert problem == i and sampling.temperature == 0.7 and sampling.top_p == 0.9
                text, finish = SCRIPT[i]["samples"][s]
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
            out.append(Completion(tokens, [0.0] * len(tokens), finish, self.version))
        return out

    def begin(self, version):
        self.version = version

    def load(self, named_tensors):
        self.published.append(len(named_tensors))

    def commit(self):
        return "digest"


@pytest.fixture
def scripted(monkeypatch):
    engines = []

    def build(cfg, policy, tokenizer, max_len):
        engines.append(ScriptedEngine(tokenizer))
        return engines[-1]

    monkeypatch.setattr(eval_run, "build_engine", build)
    return engines


@pytest.fixture
def bench(tmp_path):
    path = tmp_path / "planted.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"Q{i}: what is {i + 1}?", "answer": str(i + 1),
                                        "subject": "s"}) + "\n" for i in range(3)))
    return path


def invoke(*args):
    return CliRunner().invoke(app, ["eval", *map(str, args)])


def test_eval_gives_the_hand_computed_metrics(tmp_path, bench, scripted):
    out = tmp_path / "out"
    result = invoke("embedded:tiny-arith", "data.id_field=id", "reward.workers=0", "--benchmarks", bench,
                    "--samples", 4, "--temperature", 0.7, "--top-p", 0.9, "--out", out)
    assert result.exit_code == 0, result.output
    data = json.loads((out / "tiny-arith.json").read_text())
    assert data["format"] == "caspo-eval-1" and data["step"] is None and data["policy"] == "embedded:tiny-arith"
    assert data["settings"]["samples"] == 4 and data["settings"]["temperature"] == 0.7
    metrics = data["benchmarks"]["planted"]["metrics"]
    assert metrics == pytest.approx(EXPECTED) and list(metrics) == list(EXPECTED)
    tokenizer = scripted[0].tokenizer  # every scripted text is generated once: its tokens are counted once
    texts = [p["greedy"][0] for p in SCRIPT] + [t for p in SCRIPT for t, _ in p["samples"]]
    generation = data["benchmarks"]["planted"]["generation"]
    assert generation["tokens"] == sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts)
    assert generation["tokens_per_s"] > 0
    records = [json.loads(x) for x in (out / "tiny-arith" / "planted.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["p0", "p1", "p2"]
    assert records[1]["answers"] == ["7", "2", "7", None] and records[1]["rewards"] == [0.0, 1.0, 0.0, 0.0]
    assert records[2]["greedy_answer"] == "3" and records[2]["answers"] == ["3", "3", "3", "three"]
    assert records[1]["greedy_answer"] is None and records[1]["greedy_boxed"] is False
    assert (out / "accuracy.png").stat().st_size > 0
    assert "| planted | tiny-arith | 3 |" in (out / "summary.md").read_text()
    assert json.loads(result.stdout[result.stdout.index("{"):])["results"]["tiny-arith"]["planted"]["maj@4"] == \
        pytest.approx(2 / 3)


def make_run(tmp_path, steps=(1, 2)):
    run = tmp_path / "run"
    for step in steps:
        shutil.copytree(ASSETS / "tiny-arith", run / "checkpoints" / f"step_{step:06d}" / "policy")
    (run / "checkpoints" / "latest").write_text(f"step_{steps[-1]:06d}\n")
    (run / "config.yaml").write_text(to_yaml(load_config("tests")))
    return run


def test_eval_of_a_run_writes_one_json_per_checkpoint(tmp_path, bench, scripted):
    run, out = make_run(tmp_path), tmp_path / "out"
    result = invoke(run, "data.id_field=id", "reward.workers=0", "--benchmarks", bench, "--out", out)
    assert result.exit_code == 0, result.output
    (engine,) = scripted
    assert len(engine.published) == 1  # the second checkpoint's weights went into the same engine
    first, second = (json.loads((out / f"step_00000{s}.json").read_text()) for s in (1, 2))
    assert (first["step"], second["step"]) == (1, 2)
    assert first["settings"]["template"] == "arith" and "avg@4" not in first["benchmarks"]["planted"]["metrics"]
    assert first["benchmarks"]["planted"]["metrics"]["greedy"] == pytest.approx(2 / 3)
    assert second["benchmarks"]["planted"]["metrics"]["greedy"] == 1.0
    assert (out / "accuracy.png").exists() and (out / "summary.md").read_text().count("| planted |") == 2


def test_checkpoint_selection(tmp_path):
    run = make_run(tmp_path, steps=(5, 10, 20))
    pick = {spec: [t.name for t in resolve(str(run), spec)[0]] for spec in ("all", "latest", "step_10", "base,latest")}
    assert pick == {"all": ["step_000005", "step_000010", "step_000020"], "latest": ["step_000020"],
                    "step_10": ["step_000010"], "base,latest": ["base", "step_000020"]}
    targets, config = resolve(str(run / "checkpoints" / "step_000010" / "policy"))
    assert [(t.name, t.step) for t in targets] == [("step_000010", 10)] and config is None
    assert resolve(str(run))[1] == run / "config.yaml"
    assert resolve(str(run), "base")[0][0].policy == "embedded:tiny-arith"
    with pytest.raises(FileNotFoundError, match="no checkpoint step_7; it has step_000005, step_000010, step_000020"):
        resolve(str(run), "step_7")
    with pytest.raises(ValueError, match="picks checkpoints of a run folder"):
        resolve("embedded:tiny-arith", "step_3")
    with pytest.raises(FileNotFoundError, match="not a run folder"):
        resolve(str(tmp_path / "nothing"))
    # a hub id is one policy, read from the hub cache; a run's base keeps the revision the run pinned
    (hub,), _ = resolve("Qwen/Qwen2.5-Math-1.5B")
    assert (hub.name, hub.policy, hub.revision) == ("Qwen2.5-Math-1.5B", "Qwen/Qwen2.5-Math-1.5B", None)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["model"].update(policy="Qwen/Qwen2.5-Math-1.5B", revision="a" * 40)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (base,) = resolve(str(run), "base")[0]
    assert (base.policy, base.revision) == ("Qwen/Qwen2.5-Math-1.5B", "a" * 40)


def test_a_result_of_another_policy_is_not_added_to(tmp_path, bench, scripted):
    """Two policies of one name (two runs' step_50, or two folders called tiny-arith) into one --out: the
    second is refused, not filed under the first's numbers."""
    out, other = tmp_path / "out", tmp_path / "elsewhere" / "tiny-arith"
    shutil.copytree(ASSETS / "tiny-arith", other)
    common = ["data.id_field=id", "reward.workers=0", "--benchmarks", bench, "--out", out, "--preset", "arith-tiny"]
    assert invoke("embedded:tiny-arith", *common).exit_code == 0
    result = invoke(other, *common)
    assert result.exit_code == 2 and "holds results of embedded:tiny-arith, not of" in result.output
    # the reward settings are settings: a result scored with a fallback is another result
    result = invoke("embedded:tiny-arith", *common, "reward.fallback=last_number")
    assert result.exit_code == 2 and "fallback" in result.output


def test_checkpoints_saved_without_their_benchmarks_are_named(tmp_path):
    from types import SimpleNamespace

    from caspo.train.run_eval import unevaluated

    run = make_run(tmp_path, steps=(1, 2, 3))
    (run / "eval").mkdir()
    (run / "eval" / "step_000001.json").write_text(json.dumps({"benchmarks": {"a": {}, "b": {}}}))
    (run / "eval" / "step_000002.json").write_text(json.dumps({"benchmarks": {"a": {}}}))  # b never ran
    suites = [SimpleNamespace(name="a"), SimpleNamespace(name="b")]
    assert unevaluated(run, suites) == ["step_000002", "step_000003"]


def test_the_command_that_fills_in_missing_benchmarks_runs_as_printed(tmp_path, monkeypatch):
    from caspo.train.run_eval import missing_benchmarks_note

    run = make_run(tmp_path, steps=(1, 2))
    command = re.search(r"`caspo (.*?)`", missing_benchmarks_note(run, ["step_000002"])).group(1).split()
    seen = {}
    monkeypatch.setattr("caspo.eval.run.evaluate_targets",
                        lambda cfg, targets, out: seen.update(targets=[t.name for t in targets], out=out) or [])
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    assert seen == {"targets": ["step_000002"], "out": str(run / "eval")}


def test_eval_errors_are_one_line(tmp_path):
    result = invoke("embedded:tiny-arith", "--benchmarks", "math5000", "--out", tmp_path)
    assert result.exit_code == 2 and "eval error: unknown data source 'math5000'" in result.output


def test_a_policy_folder_on_a_data_file_needs_a_preset(tmp_path, bench):
    """Without a preset a policy would be evaluated with arith-tiny's template and 96 tokens: fine for the embedded
    policies (the tests here), refused for a folder or a hub id, as for a shipped benchmark."""
    folder = tmp_path / "policy"
    shutil.copytree(ASSETS / "tiny-arith", folder)
    result = invoke(folder, "data.id_field=id", "--benchmarks", bench, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert f"{bench} need(s) a real run's template and token budget: add --preset qwen-math-dsr" in result.output


def test_eval_adds_its_benchmarks_to_a_result_of_the_same_settings(tmp_path, bench, scripted):
    out = tmp_path / "out"
    other = tmp_path / "other.jsonl"
    shutil.copy(bench, other)
    common = ["embedded:tiny-arith", "data.id_field=id", "reward.workers=0", "--out", out]
    assert invoke(*common, "--benchmarks", bench).exit_code == 0
    assert invoke(*common, "--benchmarks", other).exit_code == 0
    data = json.loads((out / "tiny-arith.json").read_text())
    assert set(data["benchmarks"]) == {"planted", "other"}  # the first evaluation's benchmark is kept
    assert "| planted | tiny-arith |" in (out / "summary.md").read_text()
    result = invoke(*common, "--benchmarks", other, "--samples", 2)
    assert result.exit_code == 2 and "holds results made with other settings (samples: 0 -> 2" in result.output
    assert set(json.loads((out / "tiny-arith.json").read_text())["benchmarks"]) == {"planted", "other"}


def test_the_summary_shows_every_column_and_names_settings_that_differ(tmp_path):
    from caspo.eval.report import write_markdown

    def result(checkpoint, step, metrics, samples):
        return {"checkpoint": checkpoint, "step": step, "settings": {"samples": samples, "template": "qwen"},
                "benchmarks": {"b": {"n": 5, "metrics": metrics}}}

    greedy_only = result("step_10", 10, {"greedy": 0.2}, 0)
    sampled = result("step_20", 20, {"greedy": 0.4, "avg@4": 0.3, "pass@1": 0.3, "pass@4": 0.6, "maj@4": 0.35}, 4)
    text = write_markdown([greedy_only, sampled], tmp_path / "summary.md").read_text()
    assert "| benchmark | checkpoint | n | greedy | avg@4 | pass@1 | pass@4 | maj@4 | greedy s.e. |" in text
    assert "| b | step_10 | 5 | 0.200 |  |  |  |  | 0.179 |" in text  # √(0.2 · 0.8 / 5)
    assert "| b | step_20 | 5 | 0.400 | 0.300 | 0.300 | 0.600 | 0.350 | 0.219 |" in text  # √(0.4 · 0.6 / 5)
    assert "- samples: step_10 0; step_20 4" in text and "template" not in text


def test_long_prompts_skip_leaves_long_problems_out_of_a_benchmark_and_counts_them(tmp_path, scripted):
    bench = tmp_path / "planted.jsonl"
    problems = [f"Q{i}: what is {i + 1}?" + (" Think about it." * 40 if i == 1 else "") for i in range(3)]
    bench.write_text("".join(json.dumps({"id": f"p{i}", "problem": p, "answer": str(i + 1)}) + "\n"
                             for i, p in enumerate(problems)))
    out = tmp_path / "out"
    common = ["embedded:tiny-arith", "data.id_field=id", "reward.workers=0", "data.max_prompt_tokens=100"]
    result = invoke(*common, "data.long_prompts=skip", "--benchmarks", bench, "--out", out)
    assert result.exit_code == 0, result.output
    planted = json.loads((out / "tiny-arith.json").read_text())["benchmarks"]["planted"]
    assert planted["n"] == 2 and planted["data"]["skipped_long"] == 1 and planted["data"]["skipped_long_ids"] == ["p1"]
    assert planted["metrics"]["greedy"] == 1.0  # SCRIPT's greedy answers p0 and p2 right, p1 (left out) wrong
    result = invoke(*common, "--benchmarks", bench, "--out", tmp_path / "again")
    assert result.exit_code == 2 and "over data.max_prompt_tokens=100" in result.output


@pytest.mark.parametrize("flag, message", [
    ("--benchmarks", "--benchmarks is empty (' , '): list benchmarks"),
    ("--checkpoints", "--checkpoints is empty (' , '): use all, latest, base or step_N"),
])
def test_an_empty_list_option_is_refused(tmp_path, flag, message):
    result = invoke(make_run(tmp_path), flag, " , ", "--out", tmp_path / "out")
    assert result.exit_code == 2 and f"eval error: {message}" in result.output, result.output


def test_a_model_policy_other_than_the_target_is_refused(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(eval_run, "evaluate_targets", lambda cfg, targets, out: seen.append(targets) or [])
    result = invoke("embedded:tiny-arith", "model.policy=/nonexistent", "--limit", 1, "--out", tmp_path / "o")
    assert result.exit_code == 2 and seen == []
    assert ("eval error: model.policy=/nonexistent: caspo eval evaluates its target, embedded:tiny-arith (the target "
            "is the policy); pass the policy to evaluate as that argument and leave model.policy out") in result.output
    run = make_run(tmp_path)
    policy = run / "checkpoints" / "step_000002" / "policy"
    result = invoke(run, f"model.policy={policy}", "--out", tmp_path / "o")  # a run's two checkpoints
    assert result.exit_code == 2 and "the target is the policy" in result.output
    # the same policy, however spelled, is no conflict
    assert invoke("embedded:tiny-arith", "model.policy=embedded:tiny-arith", "--out", tmp_path / "o").exit_code == 0
    assert invoke(policy, f"model.policy={run}/checkpoints/../checkpoints/step_000002/policy",
                  "--out", tmp_path / "o").exit_code == 0
    assert len(seen) == 2


def test_run_files_that_are_not_utf8_are_named(tmp_path):
    run = make_run(tmp_path)
    (run / "checkpoints" / "latest").write_bytes(b"\xff\xfe")
    result = invoke(run, "--checkpoints", "latest", "--out", tmp_path / "o")
    assert result.exit_code == 2, result.output
    assert f"eval error: {run}/checkpoints/latest is not UTF-8 text" in result.output and "re-save it" in result.output
    (run / "config.yaml").write_bytes(b"\xff\xfe")
    for checkpoints in ("base", "step_1"):  # the base policy's record, and the config the evaluation loads
        result = invoke(run, "--checkpoints", checkpoints, "--out", tmp_path / "o")
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert f"eval error: {run}/config.yaml is not UTF-8 text (byte 0: invalid start byte); re-save it as UTF-8" \
            in result.output


def test_a_mistyped_path_under_a_local_folder_is_no_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match=r"^runs/typo \(no such folder; runs/ is a folder here, so this is a "
                                                r"path, not a hub id\): not a run folder"):
        resolve("runs/typo")
    assert resolve("Qwen/Qwen2.5-Math-1.5B")[0][0].policy == "Qwen/Qwen2.5-Math-1.5B"  # no Qwen/ here: a hub id
