"""benchmarks/seed_targets.py's report: each of issue 18's targets read from the benchmarks' JSON lines."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from seed_targets import markdown, part_commands, read_records, report_rows  # noqa: E402

H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"


def smoke(method, prompts, steps, card=H200, commit="abc", nproc=1, kv_share=0.139):
    """A trainer_smoke record; `steps` are (t_step, peak allocated GiB, policy MFU)."""
    return {"benchmark": "trainer_smoke", "method": method, "card": card, "commit": commit,
            "shape": {"prompts": prompts, "samples": 8, "new_tokens": 1024},
            "knobs": {"nproc": nproc, "kv_share": kv_share},
            "steps": [{"step": i + 1, "t_step": t, "mem_peak_gb": peak, "policy_mfu": mfu}
                      for i, (t, peak, mfu) in enumerate(steps)]}


def rollout(top_p, rate, logit_scale=1.0, card=H200):
    shape = {"prompts": 256, "samples": 1, "prompt_len": 128, "new_tokens": 512, "temperature": 0.6,
             "top_p": top_p, "logit_scale": logit_scale}
    return {"benchmark": "rollout_throughput", "card": card, "commit": "abc", "shape": shape,
            "engines": {"native-graphs": {"tokens_per_s": rate, "decode_tokens_per_s": rate * 1.1}}}


def rows_by_target(records):
    return {row[0]: row for row in report_rows(records)}


def test_the_steady_step_and_mfu_leave_the_first_step_out_and_the_peak_does_not():
    rows = rows_by_target([smoke("grpo", 32, [(34.0, 48.4, 0.17), (12.0, 47.5, 0.53), (12.6, 47.6, 0.51)])])
    assert rows["32 × 8 grpo: step"][2:4] == ["12.6", "met"]  # the worst of steps 2 and 3, not step 1's 34 s
    assert rows["32 × 8 grpo: step"][6] == "3 steps, KV share 0.139"
    assert rows["32 × 8 grpo: policy MFU"][1:4] == ["≥ 50%", "51%", "met"]
    assert rows["32 × 8 grpo: peak allocated"][2:4] == ["48.4", "missed"]  # a peak in the first step still counts


def test_the_latest_record_of_a_shape_counts_and_other_shapes_or_ranks_do_not():
    rows = rows_by_target([smoke("grpo", 32, [(30.0, 40, 0.2), (16.0, 40, 0.45)], commit="old"),
                           smoke("grpo", 32, [(30.0, 40, 0.2), (11.8, 40, 0.52)], commit="new"),
                           smoke("grpo", 64, [(30.0, 40, 0.2), (25.0, 40, 0.4)], nproc=2),
                           smoke("grpo", 16, [(30.0, 40, 0.2), (5.0, 40, 0.6)])])
    assert rows["32 × 8 grpo: step"][2:6] == ["11.8", "met", H200, "new"]
    assert rows["64 × 8 grpo: step"][2:4] == ["-", "not measured"]


def test_ratios_divide_last_steps_of_one_card_only():
    records = [smoke("caspo", 64, [(40.0, 90, 0.4), (16.5, 90, 0.47)], commit="c1"),
               smoke("vineppo", 64, [(104.1, 89, 0.4), (105.2, 89, 0.47)], commit="c1", kv_share=0.455),
               smoke("grpo", 64, [(26.1, 80, 0.4), (15.1, 80, 0.44), (14.7, 80, 0.44)], commit="c2")]
    rows = rows_by_target(records)
    assert rows["64 × 8 vineppo / caspo"][2:7] == ["6.38", "missed", H200, "c1",
                                                   "105.2 s / 16.5 s, KV share 0.455 / 0.139"]
    assert rows["64 × 8 caspo / grpo"][2:6] == ["1.12", "met", H200, "c1 / c2"]
    assert rows["64 × 8 grpo: step"][2:4] == ["15.1", "met"]
    assert rows["64 × 8 ppo_critic / grpo"][3] == "not measured"

    records.append(smoke("ppo_critic", 64, [(20.0, 100, 0.4), (20.0, 100, 0.48)], card=H100))
    row = rows_by_target(records)["64 × 8 ppo_critic / grpo"]
    assert row[2:4] == ["-", "no figure"] and "different cards" in row[6]


def test_the_seed_shape_holds_by_its_reserved_peak_and_a_failed_run_has_no_figure():
    ran = {"benchmark": "seed_shape", "card": H100, "commit": "abc", "cap_gib": 76, "returncode": 0,
           "steps": [{"t_step": 184.8, "mem_peak_reserved_gb": 75.8, "mem_alloc_retries": 1},
                     {"t_step": 150.4, "mem_peak_reserved_gb": 75.1, "mem_alloc_retries": 1}]}
    row = rows_by_target([ran])["seed's shape: peak reserved"]
    assert row[1:4] == ["≤ 76.0 GiB", "75.8", "met"]
    assert row[6] == "steps of 184.8, 150.4 s under a 76 GiB cap, 2 allocator retries"
    expandable = {**ran, "allocator": "expandable_segments:True"}  # the allocator's setting, where one was given
    assert rows_by_target([expandable])["seed's shape: peak reserved"][6].endswith(
        "2 allocator retries, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")

    failed = {**ran, "returncode": 1, "steps": ran["steps"][:1]}
    row = rows_by_target([ran, failed])["seed's shape: peak reserved"]
    assert row[2:4] == ["-", "no figure"] and row[6] == "failed (exit status 1) after 1 steps"


def test_rollout_targets_read_the_default_shape_on_random_logits():
    rows = rows_by_target([rollout(0.9, 61_000, logit_scale=8.0), rollout(0.9, 55_312), rollout(1.0, 80_500)])
    assert rows["rollout top-p 0.9"][1:4] == ["≥ 60,000 tokens/s", "55,312", "missed"]  # the scale-8 run is not it
    assert rows["rollout top-p 1.0"][2:4] == ["80,500", "met"]
    assert rows["rollout top-p 1.0"][6] == "decode alone 88,550"


def test_markdown_has_a_row_per_target():
    table = markdown(report_rows([])).splitlines()
    assert len(table) == 2 + 10 and all(line.count("|") == 8 for line in table)
    assert all("not measured" in line for line in table[2:])


def share(command: list[str]) -> str:
    return command[command.index("--gpu-memory-fraction") + 1]


def test_parts_pass_the_kv_share_and_the_results_file_to_each_benchmark():
    (command,) = part_commands("grpo-32", 79.2, "out.jsonl", "abc")
    assert share(command) == "0.1389"  # 11 GiB of 79.2
    assert command[command.index("--out") + 1] == "out.jsonl" and command[command.index("--commit") + 1] == "abc"
    rollouts = part_commands("rollout", 79.2, "out.jsonl", "abc")
    assert [c[c.index("--top-p") + 1] for c in rollouts] == ["0.9", "1.0"]
    with pytest.raises(ValueError, match="unknown part"):
        part_commands("grpo-16", 79.2, "out.jsonl", "abc")


def test_step_values_run_each_method_in_its_own_process_with_its_own_cache():
    caspo, vineppo = part_commands("step-values-64", 79.2, "out.jsonl", "abc")
    assert caspo[caspo.index("--methods") + 1] == "caspo" and share(caspo) == "0.2020"  # 16 GiB
    assert vineppo[vineppo.index("--methods") + 1] == "vineppo" and share(vineppo) == "0.4545"  # 36 GiB
    assert {share(c) for c in part_commands("step-values-64", 139.8, "o", "c", kv_gib=42)} == {"0.3004"}
    with pytest.raises(SystemExit, match="36.0 GiB does not fit this card's 30.0 GiB"):
        part_commands("step-values-64", 30.0, "out.jsonl", "abc")


def test_a_results_file_with_a_broken_line_is_named_by_its_line(tmp_path):
    path = tmp_path / "targets.jsonl"
    path.write_text('{"benchmark": "rollout_throughput"}\n\n{"benchmark": \n')
    with pytest.raises(SystemExit, match=r"targets.jsonl:3: not a JSON line"):
        read_records(path)
    path.write_text('{"benchmark": "rollout_throughput"}\n\n')
    assert read_records(path) == [{"benchmark": "rollout_throughput"}]
