"""`caspo report`: two configs × 2 seeds compared (numbers checked against the metrics.jsonl written here),
grouping, runs made under other conditions refused, a crashed run with a cut last line, JSONL reading."""

import json
import statistics
import subprocess
import time
from datetime import datetime, timedelta, timezone

import pytest

from caspo.config import load_config, to_yaml
from caspo.report.compare import expand, group_runs, report
from caspo.report.runs import age_s, mean_std, read_run
from caspo.runlog import read_jsonl, record_start, run_start

REWARDS = {("grpo", 0): [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], ("grpo", 1): [0.0, 0.1, 0.1, 0.3, 0.3, 0.5],
           ("ppo", 0): [0.2, 0.2, 0.2, 0.2, 0.2, 0.2], ("ppo", 1): [0.3, 0.1, 0.4, 0.2, 0.6, 0.4]}
HELDOUT = {("grpo", 0): (0.20, 0.50), ("grpo", 1): (0.20, 0.40), ("ppo", 0): (0.20, 0.30), ("ppo", 1): (0.20, 0.25)}


def make_run(folder, method, seed, overrides=(), cut_last_line=False, state="finished", pid=None):
    cfg = load_config("tests", [f"method.name={method}", f"train.seed={seed}", f"train.output_dir={folder}",
                                "train.steps=6", *overrides])
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(to_yaml(cfg))
    before, after = HELDOUT[(method, seed)]
    records = [{"step": 0, "eval_accuracy": before, "t_eval": 1.0}]
    for i, r in enumerate(REWARDS[(method, seed)]):
        records.append({"step": i + 1, "reward_mean": r, "pass_at_g": min(1.0, 2 * r), "kl": 0.01 * (i + 1) + seed,
                        "response_len_mean": 20.0 + i, "policy_tokens": 8 * (20 + i), "mc_tokens": 0,
                        "t_roll": 0.5, "t_pol": 0.25 + seed, "t_step": 1.0 + seed})
    records.append({"step": 6, "eval_accuracy": after, "t_eval": 2.0})
    records[3]["t_ckpt"] = 0.5
    text = "".join(json.dumps(r) + "\n" for r in records)
    if cut_last_line:
        text = text[:-20]  # a crash in the middle of writing the last line
    (folder / "metrics.jsonl").write_text(text)
    record_start(folder, run_start(step=0, device="cpu", device_name="test cpu", precision="fp32", engine_dtype="fp32",
                                   load={"cpus": 2, "load_1m": 0.1, "shared": False, "shared_why": ""}), resumed=False)
    (folder / "status.json").write_text(json.dumps({"state": state, "step": 6, "pid": pid, "updated_at": None}))
    return folder, records


def test_two_configs_by_two_seeds_compared_against_their_metrics(tmp_path):
    made = {(m, s): make_run(tmp_path / f"{m}-s{s}", m, s) for m in ("grpo", "ppo") for s in (0, 1)}
    path = report(expand([str(folder) for folder, _ in made.values()]), tmp_path / "report")
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert set(summary["groups"]) == {"grpo", "ppo"}  # seeds of one config form its group
    for method in ("grpo", "ppo"):
        numbers = summary["groups"][method]["numbers"]
        runs = [made[(method, s)][1] for s in (0, 1)]
        steps = [[r for r in rows if "reward_mean" in r] for rows in runs]
        last5 = [statistics.mean(r["reward_mean"] for r in s[-5:]) for s in steps]
        assert numbers["reward_mean (last 5)"]["mean"] == pytest.approx(statistics.mean(last5))
        assert numbers["reward_mean (last 5)"]["std"] == pytest.approx(statistics.stdev(last5))
        assert numbers["reward_mean (last 5)"]["n"] == 2
        finals = [HELDOUT[(method, s)][1] for s in (0, 1)]
        assert numbers["eval_accuracy"]["mean"] == pytest.approx(statistics.mean(finals))
        # 95% t interval of the mean, 1 degree of freedom: 12.706 s / sqrt(2)
        assert numbers["eval_accuracy"]["ci95"] == pytest.approx(12.706 * statistics.stdev(finals) / 2 ** 0.5)
        assert numbers["policy_tokens"]["mean"] == statistics.mean(sum(r["policy_tokens"] for r in s) for s in steps)
        walls = [sum(r.get(k, 0) for r in rows for k in ("t_step", "t_ckpt", "t_eval")) for rows in runs]
        assert numbers["wall_s"]["mean"] == pytest.approx(statistics.mean(walls))
    per_run = summary["runs"][str(made[("ppo", 1)][0])]
    assert per_run["state"] == "finished"
    assert per_run["timing"]["t_pol"] == pytest.approx(1.25) and per_run["timing"]["t_step"] == pytest.approx(2.0)
    assert per_run["pins"]["device"] == "cpu test cpu" and per_run["pins"]["dtype"] == "fp32 (engine fp32)"
    text = path.read_text()
    grpo_last5 = [statistics.mean(REWARDS[("grpo", s)][-5:]) for s in (0, 1)]
    half_width = 12.706 * statistics.stdev(grpo_last5) / 2 ** 0.5  # t(0.975, 1 degree of freedom)
    assert f"| grpo | 2 | 6 | {statistics.mean(grpo_last5):.3f} ± {half_width:.3f} (n=2) |" in text
    # the numbers behind each interval: every seed's last evaluation, and its timing row named by group and seed
    assert "| eval_accuracy | ppo | 0.3000 | 0.2500 |" in text and "| eval_accuracy | grpo | 0.5000 | 0.4000 |" in text
    assert "| ppo | 1 | 0.50 | 0.00 | 0.00 | 0.00 | 0.00 | 0.00 | 1.25 |" in text
    for png in ("curves.png", "phases.png", "eval_accuracy_vs_compute.png"):
        assert (tmp_path / "report" / png).stat().st_size > 5000


def test_a_report_names_what_its_means_mix_and_what_each_rests_on(tmp_path):
    a, _ = make_run(tmp_path / "a", "grpo", 0)
    b, records = make_run(tmp_path / "b", "grpo", 1)
    with (a / "metrics.jsonl").open("a") as f:  # a benchmark only run a was evaluated on
        f.write(json.dumps({"step": 6, "bench_gsm8k_greedy": 0.5}) + "\n")
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:4]))  # b stopped at step 3
    text = report(expand([str(a), str(b)]), tmp_path / "out").read_text()
    assert "- grpo: its runs stopped at different steps (a 6, b 3); their means mix progress" in text
    def cells(start):
        return [c.strip() for c in next(x for x in text.splitlines() if x.startswith(start)).strip("|").split("|")]
    header, row = cells("| group | runs |"), cells("| grpo | 2 |")
    assert row[header.index("bench_gsm8k_greedy")] == "0.500 (n=1)"  # one of the group's two runs has it
    c, _ = make_run(tmp_path / "c", "grpo", 0)  # a second run of seed 0
    summary = report(expand([str(a), str(c)]), tmp_path / "out2").read_text()
    assert "- grpo: 2 runs of seed 0 count as that many seeds" in summary
    (tmp_path / "link").symlink_to(a)
    with pytest.raises(ValueError, match="given more than once"):  # the same folder by another name
        report(expand([str(a), str(tmp_path / "link")]), tmp_path / "out3")


def test_the_t_quantile_past_the_table():
    from caspo.report.runs import t_975

    exact = {11: 2.200985, 12: 2.178813, 20: 2.085963, 30: 2.042272, 120: 1.979930}  # Student t, 0.975
    assert all(abs(t_975(df) - t) < 1e-3 for df, t in exact.items())
    assert t_975(10) == 2.228


def test_grouping_by_config_names_what_differs_and_by_method_pools(tmp_path):
    runs = [read_run(make_run(tmp_path / f"e{e}-s{s}", "grpo", s, [f"train.epochs_per_rollout={e}"])[0])
            for e in (1, 2) for s in (0, 1)]
    by_config = group_runs(runs, "config")
    assert {k: len(v) for k, v in by_config.items()} == {"grpo train.epochs_per_rollout=1": 2,
                                                        "grpo train.epochs_per_rollout=2": 2}
    assert {k: len(v) for k, v in group_runs(runs, "method").items()} == {"grpo": 4}
    assert len(group_runs(runs, "run")) == 4


def test_runs_under_other_conditions_are_refused_unless_allowed(tmp_path):
    a, _ = make_run(tmp_path / "a", "grpo", 0)
    b, _ = make_run(tmp_path / "b", "grpo", 1, ["rollout.temperature=0.7"])
    with pytest.raises(ValueError, match=r"not made under the same conditions.*\n  rollout.temperature: a=1.0, b=0.7"):
        report(expand([str(a), str(b)]), tmp_path / "out")
    path = report(expand([str(a), str(b)]), tmp_path / "out", allow_mismatch=True)
    assert "**Conditions differ**" in path.read_text()


def test_a_crashed_run_with_a_cut_last_line_is_reported(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid no longer runs: the run's process is gone while status.json says running
    folder, records = make_run(tmp_path / "crashed", "grpo", 0, cut_last_line=True, state="running", pid=gone.pid)
    run = read_run(folder)
    assert run.records == records[:-1] and run.state == "crashed"
    path = report([run], tmp_path / "out")
    assert "| crashed | grpo | 0 | crashed | 6/6 |" in path.read_text()


def test_read_jsonl_names_a_damaged_line_before_the_end(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')
    with pytest.raises(ValueError, match="m.jsonl, line 2: not JSON"):
        read_jsonl(path)
    path.write_text('{"step": 1}\n{"step": 2')
    assert read_jsonl(path) == [{"step": 1}]


def test_a_resume_cuts_a_jsonl_back_keeping_its_lines_as_they_were(tmp_path):
    from caspo.runlog import DamagedRunFile, JsonlWriter

    path = tmp_path / "samples.jsonl"
    lines = ['{"step": 1, "x": 1.50}\n', '{"step":2}\n', '{"step": 3}\n', '{"step": 2, "redo": true}\n', '{"st']
    path.write_text("".join(lines))
    writer = JsonlWriter(path, truncate_after_step=2, drop=lambda r: r.get("redo", False))
    writer.write({"step": 3})
    writer.close()
    assert path.read_text() == lines[0] + lines[1] + '{"step": 3}\n'  # "1.50" and "step":2 kept verbatim
    assert [p.name for p in tmp_path.iterdir()] == ["samples.jsonl"]
    damaged = '{"step": 1}\n{"step": 2\n{"step": 3}\n'
    path.write_text(damaged)
    with pytest.raises(DamagedRunFile, match="samples.jsonl, line 2: not JSON.*mend or remove that line"):
        JsonlWriter(path, truncate_after_step=2)
    assert path.read_text() == damaged and [p.name for p in tmp_path.iterdir()] == ["samples.jsonl"]


def test_mean_std_and_its_interval():
    assert mean_std([2.0]) == {"mean": 2.0, "std": 0.0, "n": 1, "ci95": 0.0}
    stats = mean_std([1.0, 2.0, 3.0])
    assert (stats["mean"], stats["std"], stats["n"]) == (2.0, 1.0, 3)
    assert stats["ci95"] == pytest.approx(4.303 / 3 ** 0.5)


def test_refresh_labelling_counts_once_per_refresh_in_the_compute_table(tmp_path):
    folder, _ = make_run(tmp_path / "grpo-s0", "grpo", 0)
    refreshes = [(2, 1000), (4, 700), (4, 700)]  # the refresh after step 4 logged again by a resumed run
    with (folder / "metrics.jsonl").open("a") as f:
        for step, tokens in refreshes:
            f.write(json.dumps({"step": step, "refresh_value_model": "v", "refresh_tokens": tokens,
                                "t_refresh": 1.0}) + "\n")
    report(expand([str(folder)]), tmp_path / "report")
    numbers = json.loads((tmp_path / "report" / "summary.json").read_text())["groups"]["grpo"]["numbers"]
    assert numbers["refresh_tokens"]["mean"] == 1700
    assert "| 1,700 |" in (tmp_path / "report" / "report.md").read_text()
    with (folder / "metrics.jsonl").open("a") as f:  # a refresh logged before its tokens were counted
        f.write(json.dumps({"step": 6, "refresh_value_model": "v", "t_refresh": 1.0}) + "\n")
    report(expand([str(folder)]), tmp_path / "report")
    assert "| not recorded |" in (tmp_path / "report" / "report.md").read_text()


@pytest.fixture
def new_york_time(monkeypatch):
    """This machine's zone set to UTC-5 (a POSIX rule: no tz database needed), and set back after."""
    monkeypatch.setenv("TZ", "EST5")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize("offset", [timedelta(0), timedelta(hours=5, minutes=30), timedelta(hours=-5)])
def test_a_status_written_under_any_offset_is_aged_right_in_another_zone(new_york_time, offset):
    written = datetime.now(timezone.utc) - timedelta(minutes=10)
    stamp = written.astimezone(timezone(offset)).strftime("%Y-%m-%dT%H:%M:%S%z")  # as caspo.runlog.now() writes
    assert age_s({"updated_at": stamp}) == pytest.approx(600, abs=5)


DAMAGE = [  # (file, its text, what the error says about it)
    ("config.yaml", "model: [\n", r"config.yaml: not valid YAML \(.*\); mend it"),
    ("config.yaml", "- 1\n", r"config.yaml: holds a list, not the mapping caspo writes there; mend it"),
    ("config.yaml", "model: {}\n", r"config.yaml: has no 'method' \(a mapping\); mend it"),
    ("run.json", "garbage\n", r"run.json: not valid JSON \(Expecting value.*\); mend it, or move it away to start"),
    ("run.json", "[1]\n", r"run.json: holds a list, not the mapping"),
    ("run.json", '{"starts": [1]}\n', r"run.json: its 'starts' is a list, not a list of mappings"),
    ("status.json", "garbage\n", r"status.json: not valid JSON .*; mend it, or remove it \(a running run writes"),
    ("status.json", '"finished"\n', r"status.json: holds a string, not the mapping"),
    ("metrics.jsonl", '{"step": 1}\n[1, 2]\n', r"metrics.jsonl, line 2: a list, not a JSON object .*mend or remove"),
    ("config.yaml", b"\xff\xfe", r"config.yaml is not UTF-8 text \(byte 0: invalid start byte\); re-save it as UTF-8"),
]


@pytest.mark.parametrize("name,text,message", DAMAGE, ids=[f"{d[0]}-{i}" for i, d in enumerate(DAMAGE)])
def test_a_damaged_run_file_is_named_with_how_to_mend_it(tmp_path, name, text, message):
    """`caspo report` of a run whose file is not valid JSON / YAML, or not the mapping (or list of mappings) it
    must be: a DamagedRunFile (a user error) naming the file, not a traceback or a bare JSON error."""
    from caspo.runlog import DamagedRunFile

    folder, _ = make_run(tmp_path / "r", "grpo", 0)
    (folder / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(DamagedRunFile, match=message) as err:
        report(expand([str(folder)]), tmp_path / "out")
    assert str(folder / name) in str(err.value)
    if name == "run.json":  # a resumed run appending its start reads it the same way
        with pytest.raises(DamagedRunFile, match=message):
            record_start(folder, {}, resumed=True)


@pytest.mark.parametrize("text,message", [
    ("{bad", r"suite.json: not valid JSON \(Expecting property name.*\); mend it, or move it away \(a rerun"),
    ('{"preset": "tests"}', r"suite.json: has no 'overrides' \(a list\)"),
    ('{"preset": "tests", "overrides": [], "runs": [{"dir": "a"}]}', r"suite.json: runs\[0\] is .*not a run with "
                                                                     "label, seed, dir, overrides"),
])
def test_a_damaged_suite_json_is_named_with_how_to_mend_it(tmp_path, text, message):
    from caspo.runlog import DamagedRunFile

    (tmp_path / "suite.json").write_text(text)
    with pytest.raises(DamagedRunFile, match=message):
        expand([str(tmp_path)])
