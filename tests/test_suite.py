"""`caspo suite`: its methods items, its plan, what a rerun does with each run folder, and (slow) the tests
preset with 2 methods × 2 seeds: one run left unfinished is resumed, finished ones are skipped."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from caspo.cli_args import checked_config
from caspo.config import ConfigError
from caspo.runlog import read_jsonl
from caspo.train import suite

pytestmark = pytest.mark.timeout(900)


def test_methods_items_give_labels_and_their_own_overrides():
    items = suite.parse_methods("grpo, mu2=grpo+train.epochs_per_rollout=2,stops=ppo+rollout.stop=[a,b]")
    assert items == [("grpo", ["method.name=grpo"]),
                     ("mu2", ["method.name=grpo", "train.epochs_per_rollout=2"]),
                     ("stops", ["method.name=ppo", "rollout.stop=[a,b]"])]
    assert suite.parse_methods("grpo+method.clip_high=0.28") == [
        ("grpo+method.clip_high=0.28", ["method.name=grpo", "method.clip_high=0.28"])]
    with pytest.raises(ValueError, match="names a label twice"):
        suite.parse_methods("grpo,grpo")
    with pytest.raises(ValueError, match="'clip' is not a KEY=VALUE override"):
        suite.parse_methods("grpo+clip")
    with pytest.raises(ValueError, match="write METHOD or LABEL=METHOD"):
        suite.parse_methods("my label=grpo")
    runs = suite.plan(suite.parse_methods("grpo,grpo+method.clip_high=0.28"), [0, 1])
    assert [r.dir for r in runs] == ["grpo/seed0", "grpo/seed1", "grpo_method.clip_high=0.28/seed0",
                                     "grpo_method.clip_high=0.28/seed1"]


def test_each_run_folder_is_skipped_resumed_or_started_over(tmp_path):
    assert suite.next_action(tmp_path / "never") == "fresh"
    (tmp_path / "crashed").mkdir()
    (tmp_path / "crashed" / "status.json").write_text(json.dumps({"state": "failed"}))
    assert suite.next_action(tmp_path / "crashed") == "fresh"  # nothing to resume from
    step = tmp_path / "stopped" / "checkpoints" / "step_000001"
    (step / "policy").mkdir(parents=True)
    (step / "policy" / "config.json").write_text("{}")
    (tmp_path / "stopped" / "checkpoints" / "latest").write_text("step_000001\n")
    (tmp_path / "stopped" / "status.json").write_text(json.dumps({"state": "stopped"}))
    assert suite.next_action(tmp_path / "stopped") == "resume"
    (tmp_path / "stopped" / "status.json").write_text(json.dumps({"state": "finished"}))
    assert suite.next_action(tmp_path / "stopped") == "skip"
    run = suite.SuiteRun("grpo", 3, "grpo/seed3", ["method.name=grpo"])
    cmd = suite.train_command("tests", ["train.steps=2"], run, tmp_path / "r", "cuda:1", "resume")
    assert cmd[1:] == ["-m", "caspo.cli", "train", "tests", "train.steps=2", "method.name=grpo", "train.seed=3",
                       f"train.output_dir={tmp_path / 'r'}", "model.device=cuda:1", "--resume", "latest"]


def test_evaluation_on_finish_asks_for_what_eval_lacks(tmp_path):
    for name in ("step_000001", "step_000002", "step_000003"):
        (tmp_path / "checkpoints" / name / "policy").mkdir(parents=True)
        (tmp_path / "checkpoints" / name / "policy" / "config.json").write_text("{}")
    (tmp_path / "eval").mkdir()

    def result(name, *benchmarks):
        (tmp_path / "eval" / f"{name}.json").write_text(json.dumps({"benchmarks": dict.fromkeys(benchmarks, {})}))

    result("base", "arith", "math500")
    result("step_000001", "arith", "math500")
    result("step_000003", "arith")  # training evaluated arith only: math500 is still to do
    cmd = suite.eval_command(tmp_path, "arith,math500", "cuda:0")
    assert cmd[1:] == ["-m", "caspo.cli", "eval", str(tmp_path), "model.device=cuda:0", "--benchmarks", "arith,math500",
                       "--checkpoints", "step_000002,step_000003", "--out", str(tmp_path / "eval")]
    result("step_000002", "arith")
    cmd = suite.eval_command(tmp_path, "arith,math500", "cuda:0")
    assert cmd[cmd.index("--benchmarks") + 1] == "math500"  # what one of them lacks, and only that
    assert suite.eval_command(tmp_path, "arith", None) is None


def test_a_rerun_keeps_its_settings_and_adds_runs(tmp_path):
    first = suite.plan(suite.parse_methods("grpo"), [0])
    suite.record_suite(tmp_path, "tests", ["train.steps=2"], first)
    more = suite.record_suite(tmp_path, "tests", ["train.steps=2"], suite.plan(suite.parse_methods("ppo"), [0, 1]))
    assert [r.dir for r in more] == ["grpo/seed0", "ppo/seed0", "ppo/seed1"]
    with pytest.raises(ValueError, match="holds a suite of tests with overrides"):
        suite.record_suite(tmp_path, "tests", ["train.steps=3"], first)
    with pytest.raises(ValueError, match="give the variant another LABEL"):
        suite.record_suite(tmp_path, "tests", ["train.steps=2"],
                           [suite.SuiteRun("grpo", 0, "grpo/seed0", ["method.name=grpo", "optim.lr=1"])])
    with pytest.raises(ConfigError, match="suite run nope seed 0: .*nope"):
        suite.check_configs(checked_config, "tests", [], suite.plan(suite.parse_methods("nope"), [0]), tmp_path)


class ScriptedSlots:
    """Places runs without starting processes: a command exits at its first poll with the code `exit_code` gives,
    a training that exits 0 leaving its folder with one checkpoint."""

    def __init__(self, devices, exit_code):
        self.devices, self.exit_code = devices, exit_code
        self.started, self.finished, self.most_at_once, self.closed = [], 0, 0, False

    def sharing(self, device):
        return self.devices.count(device)

    def start(self, command, log):
        self.started.append(command)
        self.most_at_once = max(self.most_at_once, len(self.started) - self.finished)
        return command

    def poll(self, command):
        self.finished += 1
        code = self.exit_code(command)
        if command[3] == "train" and code == 0:
            run_dir = output_dir(command)
            (run_dir / "checkpoints" / "step_000001" / "policy").mkdir(parents=True)
            (run_dir / "checkpoints" / "step_000001" / "policy" / "config.json").write_text("{}")
        return code

    def close(self):
        self.closed = True


def output_dir(command: list[str]) -> Path:
    """The run folder that a ``caspo train`` command writes to."""
    return Path(next(a for a in command if a.startswith("train.output_dir=")).split("=", 1)[1])


def test_the_queue_fills_each_slot_evaluates_what_trained_and_reports_a_failed_run(tmp_path):
    out = tmp_path / "suite"
    failing = lambda cmd: int(cmd[3] == "train" and "method.name=ppo" in cmd and "train.seed=1" in cmd)  # noqa: E731
    slots = ScriptedSlots(["cpu", "cpu"], failing)
    result = suite.run_suite("tests", "grpo,ppo", [0, 1], out, overrides=["train.steps=1"], benchmarks="arith",
                             slots=slots, checked_config=checked_config)
    log = out / "ppo" / "seed1" / "suite.log"
    assert result == {"report": None, "ran": ["grpo/seed0", "grpo/seed1", "ppo/seed0", "ppo/seed1"], "skipped": [],
                      "failed": [f"ppo/seed1 (train exited 1; see {log})"]}  # nothing trained: no report
    trained = [cmd for cmd in slots.started if cmd[3] == "train"]
    evaluated = [cmd for cmd in slots.started if cmd[3] == "eval"]
    assert [output_dir(cmd) for cmd in trained] == [out / run for run in result["ran"]]
    assert all(cmd[-1] == "--overwrite" and "model.device=cpu" in cmd for cmd in trained)  # fresh folders
    # the three runs that trained, and not the failed one, have their checkpoints evaluated on the benchmarks
    assert sorted(cmd[cmd.index("--out") + 1] for cmd in evaluated) == [
        str(out / run / "eval") for run in ("grpo/seed0", "grpo/seed1", "ppo/seed0")]
    assert all(cmd[cmd.index("--checkpoints") + 1] == "base,step_000001" and cmd[cmd.index("--benchmarks") + 1]
               == "arith" for cmd in evaluated)
    assert slots.most_at_once == 2 and slots.closed
    assert log.read_text().count("\n$ ") == 1 and (out / "grpo" / "seed0" / "suite.log").read_text().count("\n$ ") == 2


@pytest.mark.slow
def test_the_tests_preset_suite_resumes_the_unfinished_run_and_skips_finished_ones(tmp_path):
    out = tmp_path / "suite"
    shared = ["train.steps=2", "eval.before=false", "eval.after=false", "train.save_every=1"]
    # one run stopped after its first step, as a killed suite would leave it
    partial = [sys.executable, "-m", "caspo.cli", "train", "tests", *shared, "method.name=ppo", "train.seed=1",
               f"train.output_dir={out / 'ppo' / 'seed1'}", "train.stop_after=1"]
    assert subprocess.run(partial, capture_output=True, text=True).returncode == 0
    cli = [sys.executable, "-m", "caspo.cli", "suite", "tests", *shared, "--methods", "grpo,ppo", "--seeds", "0,1",
           "--out", str(out)]
    done = subprocess.run(cli, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ran"] == ["grpo/seed0", "grpo/seed1", "ppo/seed0", "ppo/seed1"] and result["failed"] == []
    resumed = json.loads((out / "ppo" / "seed1" / "run.json").read_text())["starts"]
    assert [s["step"] for s in resumed] == [0, 1]  # started, then resumed at step 1
    for run in result["ran"]:
        assert json.loads((out / run / "status.json").read_text())["state"] == "finished"
        assert [r["step"] for r in read_jsonl(out / run / "metrics.jsonl")] == [1, 2]
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert {k: len(v["runs"]) for k, v in summary["groups"].items()} == {"grpo": 2, "ppo": 2}
    seed0 = read_jsonl(out / "grpo" / "seed0" / "metrics.jsonl")
    seed1 = read_jsonl(out / "grpo" / "seed1" / "metrics.jsonl")
    assert summary["groups"]["grpo"]["numbers"]["reward_mean (last 5)"]["mean"] == pytest.approx(
        (sum(r["reward_mean"] for r in seed0) / 2 + sum(r["reward_mean"] for r in seed1) / 2) / 2)
    again = subprocess.run(cli, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["skipped"] == result["ran"] and json.loads(again.stdout)["ran"] == []
    assert len(json.loads((out / "ppo" / "seed1" / "run.json").read_text())["starts"]) == 2  # not run again


@pytest.mark.slow
def test_a_suite_on_a_local_ray_runs_each_run_as_an_actor(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "suite"
    cli = [sys.executable, "-m", "caspo.cli", "suite", "tests", "train.steps=1", "eval.before=false",
           "eval.after=false", "model.threads=1", "--methods", "grpo,ppo", "--seeds", "0", "--out", str(out),
           "--ray-address", "local", "--ray-slots", "2"]
    done = subprocess.run(cli, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(done.stdout[done.stdout.index("{"):])
    assert result["ran"] == ["grpo/seed0", "ppo/seed0"] and result["failed"] == []
    for run in result["ran"]:
        assert json.loads((out / run / "status.json").read_text())["state"] == "finished"
        assert '"run_dir"' in (out / run / "suite.log").read_text()  # the actor's output went to the run's log
    assert (out / "report" / "summary.json").is_file()


def test_runs_sharing_a_cuda_device_split_its_kv_share(tmp_path):
    """--devices 0,0,1: the two runs at once on cuda:0 get half the config's KV share each, for training and
    evaluation; cuda:1's run and a CPU list keep the config's."""
    slots = suite.LocalSlots(["cuda:0", "cuda:0", "cuda:1"])
    assert [slots.sharing(d) for d in slots.devices] == [2, 2, 1]
    run = suite.SuiteRun("grpo", 0, "grpo/seed0", ["method.name=grpo"])
    shared = ["rollout.gpu_memory_fraction=0.3"]
    half = suite.train_command("tests", shared, run, tmp_path / "r", "cuda:0", "fresh", sharing=2)
    assert half[-2:] == ["rollout.gpu_memory_fraction=0.15", "--overwrite"]
    alone = suite.train_command("tests", shared, run, tmp_path / "r", "cuda:1", "fresh", sharing=1)
    on_cpu = suite.train_command("tests", shared, run, tmp_path / "r", "cpu", "fresh", sharing=2)
    for cmd in (alone, on_cpu):  # only the shared override's own share
        assert [a for a in cmd if a.startswith("rollout.gpu_memory_fraction")] == shared
    (tmp_path / "r" / "checkpoints" / "step_000001" / "policy").mkdir(parents=True)
    (tmp_path / "r" / "checkpoints" / "step_000001" / "policy" / "config.json").write_text("{}")
    (tmp_path / "r" / "config.yaml").write_text("rollout:\n  gpu_memory_fraction: 0.24\n")
    cmd = suite.eval_command(tmp_path / "r", "arith", "cuda:0", sharing=3)
    assert "rollout.gpu_memory_fraction=0.08" in cmd and "model.device=cuda:0" in cmd


def refused(tmp_path, message, methods="grpo", seeds=(0,), **kwargs):
    """run_suite refuses with `message` before it records the suite or starts anything."""
    out = tmp_path / "suite"
    slots = ScriptedSlots(["cpu"], lambda cmd: 0)
    with pytest.raises(ConfigError, match=message):
        suite.run_suite("tests", methods, list(seeds), out, slots=slots, **kwargs, checked_config=checked_config)
    assert slots.started == [] and not (out / "suite.json").exists()


def test_a_repeated_seed_or_run_folder_is_refused_before_anything_starts(tmp_path):
    """--seeds 0,0 ran two runs in one folder (at once on --devices cpu,cpu, the second's --overwrite deleting the
    first's files), then failed with a KeyError; two label-less items whose labels slug alike shared a folder."""
    refused(tmp_path, r"--seeds 0,1,0 names seed 0 more than once .*list each seed once", seeds=(0, 1, 0))
    refused(tmp_path, r"--methods items 'grpo\+rollout.stop=\[a b\]' and 'grpo\+rollout.stop=\[a_b\]' would both "
            r"run in .*grpo_rollout.stop=_a_b_/seed0; give one of them its own LABEL", "grpo+rollout.stop=[a b],"
            "grpo+rollout.stop=[a_b]")


def test_empty_seeds_and_ray_slots_without_a_ray_address_are_refused(tmp_path):
    refused(tmp_path, "--seeds names no seed: give a comma list", seeds=())
    refused(tmp_path, r"--ray-slots 4 without --ray-address: .*add --ray-address HOST:PORT", ray_slots=4)
    refused(tmp_path, "--devices and --ray-address both place the runs", devices=["cpu"], ray_address="local")
    # from the command line too: the command passes its Ray options to run_suite, which checks them first
    from typer.testing import CliRunner

    from caspo.cli import app

    result = CliRunner().invoke(app, ["suite", "tests", "--methods", "grpo", "--out", str(tmp_path / "cli"),
                                      "--ray-slots", "4"])
    assert result.exit_code == 2 and "--ray-slots 4 without --ray-address" in result.output
    assert not (tmp_path / "cli").exists()


@pytest.mark.parametrize("kwargs,message", [
    ({"overrides": ["data.source=missing.jsonl", "data.heldout_fraction=0.5"]},
     r"suite run grpo seed 0: .*missing.jsonl: no such data file"),
    ({"overrides": ["model.policy=no/such/folder/x"]}, r"suite run grpo seed 0: .*no/such/folder/x"),
    ({"group_by": "nosuch"}, r"--group-by 'nosuch': choose one of config, method, run"),
    ({"benchmarks": "arith,nosuch"}, r"suite run grpo seed 0: unknown data source 'nosuch'.*eval.benchmarks"),
    ({"benchmarks": " , "}, r"--benchmarks ' , ' names no benchmark"),
])
def test_each_runs_config_group_by_and_benchmarks_are_checked_before_the_suite_starts(tmp_path, kwargs, message):
    """As `caspo train` and `caspo eval` check them: a missing data file or policy folder started every run to fail;
    a bad --group-by or --benchmarks name failed only after all the training."""
    refused(tmp_path, message, **kwargs)


def test_a_run_finished_since_the_suite_began_is_skipped(tmp_path):
    """The queue takes a run off with its action now: one finished meanwhile (by another suite on the folder) is
    skipped, not a KeyError('skip')."""
    out = tmp_path / "suite"

    class OtherSuiteFinishing(ScriptedSlots):
        def start(self, command, log):
            other = out / "grpo" / "seed1"
            other.mkdir(parents=True, exist_ok=True)
            (other / "status.json").write_text(json.dumps({"state": "finished"}))
            return super().start(command, log)

    slots = OtherSuiteFinishing(["cpu"], lambda cmd: 0)
    result = suite.run_suite("tests", "grpo", [0, 1], out, overrides=["train.steps=1"], slots=slots,
                             checked_config=checked_config)
    assert result["ran"] == ["grpo/seed0"] and result["skipped"] == ["grpo/seed1"] and result["failed"] == []
    assert [output_dir(cmd) for cmd in slots.started] == [out / "grpo" / "seed0"]


def test_a_damaged_suite_json_or_status_json_is_refused_before_anything_starts(tmp_path):
    from caspo.runlog import DamagedRunFile

    out = tmp_path / "suite"
    out.mkdir()
    (out / "suite.json").write_text('{"preset": "tests"}')
    slots = ScriptedSlots(["cpu"], lambda cmd: 0)
    with pytest.raises(DamagedRunFile, match=r"suite.json: has no 'overrides' \(a list\); mend it, or move it away"):
        suite.run_suite("tests", "grpo", [0], out, slots=slots, checked_config=checked_config)
    (out / "suite.json").unlink()
    (out / "grpo" / "seed0").mkdir(parents=True)
    (out / "grpo" / "seed0" / "status.json").write_text("{bad")
    with pytest.raises(DamagedRunFile, match=r"seed0/status.json: not valid JSON"):
        suite.run_suite("tests", "grpo", [0], out, slots=slots, checked_config=checked_config)
    assert slots.started == []
