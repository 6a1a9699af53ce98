"""Phase 1: boundary choice, splits, label files and shards, and collect -> train -> probe end to end."""

import json

import pytest
from typer.testing import CliRunner

from caspo.models.prefix_value import Provenance
from caspo.value.cli import value_app
from caspo.value.collect import choose_boundaries, parse_shard
from caspo.value.labels import LabelFileError, LabelRow, merge_label_files, read_label_file, write_label_file
from caspo.value.train import split_rows

PROVENANCE = Provenance(prompt_template="{query}", add_bos=False, tokenizer_hash="t:x", verifier_version="v",
                        temperature=1.0, top_p=1.0, top_k=0, stop_strings=(), max_new_tokens=40,
                        label_policy="w:p").to_dict()


def row(prompt_index, sample=0, boundary=1, p_hat=0.5):
    return LabelRow(prompt_id=f"p{prompt_index}", prompt_index=prompt_index, sample=sample, prompt_tokens=[5, 6],
                    response_tokens=[7, 8, 9], boundary=boundary, step=1, p_hat=p_hat, j=4, base_reward=1.0,
                    label="3", provenance=PROVENANCE)


def header(shard, **extra):
    return {"shard": shard, "k": 4, "j": 4, "provenance": PROVENANCE,
            "stats": {"base_rollouts": 8, "mixed_prompts": 1}, **extra}


def test_choose_boundaries_spreads_over_interior_steps():
    starts = [0, 3, 7, 12, 20, 25]  # interior: 3 7 12 20 25
    assert choose_boundaries(starts, 3) == [3, 12, 25]
    assert choose_boundaries(starts, 1) == [12]
    assert choose_boundaries(starts, 5) == choose_boundaries(starts, 9) == [3, 7, 12, 20, 25]
    assert choose_boundaries([0], 3) == []  # one step: nothing between prompt and end


def test_parse_shard():
    assert parse_shard("1/4") == (1, 4)
    for bad in ("4/4", "1", "a/b"):
        with pytest.raises(ValueError):
            parse_shard(bad)


def test_prompt_split_keeps_each_prompt_on_one_side():
    rows = [row(p, s, b) for p in range(40) for s in range(2) for b in (1, 2)]
    train, val = split_rows(rows, "prompt", 0.3, seed=0)
    assert {r.prompt_id for r in train}.isdisjoint({r.prompt_id for r in val})
    assert len(train) + len(val) == len(rows) and 0 < len(val) < len(rows)
    assert split_rows(rows, "prompt", 0.3, seed=0) == (train, val)  # reproducible
    row_train, row_val = split_rows(rows, "row", 0.3, seed=0)
    assert not {r.prompt_id for r in row_train}.isdisjoint({r.prompt_id for r in row_val})
    with pytest.raises(ValueError, match="choose row, prompt"):
        split_rows(rows, "random", 0.3, seed=0)


def test_merge_refuses_missing_shards_and_other_collections(tmp_path):
    a = write_label_file(tmp_path / "a.jsonl", header("0/2"), [row(2), row(0)])
    b = write_label_file(tmp_path / "b.jsonl", header("1/2"), [row(1)])
    merged = merge_label_files([b, a], tmp_path / "m.jsonl")
    assert [r.prompt_index for r in merged.rows] == [0, 1, 2]
    assert merged.header["stats"] == {"base_rollouts": 16, "mixed_prompts": 2}
    with pytest.raises(LabelFileError, match="every shard"):
        merge_label_files([a], tmp_path / "m2.jsonl")
    c = write_label_file(tmp_path / "c.jsonl", header("1/2", j=8), [row(1)])
    with pytest.raises(LabelFileError, match="another collection.*j"):
        merge_label_files([a, c], tmp_path / "m3.jsonl")


def test_a_truncated_label_file_is_refused(tmp_path):
    path = write_label_file(tmp_path / "a.jsonl", header("0/1"), [row(0), row(1)])
    path.write_text("\n".join(path.read_text().splitlines()[:2]) + "\n")
    with pytest.raises(LabelFileError, match="header says 2 rows, found 1"):
        read_label_file(path)


def invoke(*args):
    result = CliRunner().invoke(value_app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.timeout(120)
def test_collect_train_probe_end_to_end(tmp_path):
    small = ["reward.workers=0", "model.threads=1", "--prompts", 12, "--k", 4, "--j", 2, "--boundaries", 2]
    invoke("collect", "tests", *small, "--out", tmp_path / "labels.jsonl")
    for i in range(2):
        invoke("collect", "tests", *small, "--out", tmp_path / f"shard{i}.jsonl", "--shard", f"{i}/2")
    invoke("merge", tmp_path / "merged.jsonl", tmp_path / "shard1.jsonl", tmp_path / "shard0.jsonl")
    whole, merged = read_label_file(tmp_path / "labels.jsonl"), read_label_file(tmp_path / "merged.jsonl")
    assert merged.rows == whole.rows and len(whole.rows) >= 8  # shards rebuild the unsharded collection
    assert {r.j for r in whole.rows} == {2} and all(0 <= r.boundary < len(r.response_tokens) for r in whole.rows)

    out = tmp_path / "value"
    invoke("train", tmp_path / "labels.jsonl", "--policy", "embedded:tiny-arith", "--out", out,
           "--val-split", "prompt", "--val-fraction", 0.5, "--epochs", 1, "--batch-size", 8)
    metrics = json.loads((out / "metrics.json").read_text())
    assert {"spearman", "within_response_spearman", "auc_outcome", "calibration", "history"} <= set(metrics)
    assert (out / "calibration.png").stat().st_size > 1000
    assert json.loads((out / "value_config.json").read_text())["provenance"]["reference"].startswith("w:")

    probed = json.loads(invoke("probe", out, tmp_path / "labels.jsonl"))
    assert probed["n"] == len(whole.rows) and -1 <= probed["spearman"] <= 1
