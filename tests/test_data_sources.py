"""Data sources: shipped names, parquet, `datasets` folders and hub names, field mapping, held-out sets,
invalid rows counted, named and skipped only when asked."""

import json
import os
import subprocess
import sys

import pytest

from caspo.config import ConfigError, load_config
from caspo.data import SHIPPED, DataError, load_source
from caspo.data.load import validate_rows
from caspo.data.registry import WRONG_GOLD
from caspo.data.rows import RawRow, parse_source
from caspo.data.split import heldout_split
from caspo.data.task import task_examples

ROWS = [{"id": 10 + i, "question": f"What is {i} + {i}?", "reward_model": {"ground_truth": str(2 * i)},
         "topic": "sums"} for i in range(6)]
MAPPED = ["data.query_field=question", "data.label_field=reward_model.ground_truth", "data.id_field=id"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_names_load_with_their_own_fields(name):
    result = load_source(name, query_field="ignored", label_field="ignored", limit=30)
    assert len(result.examples) == 30 and result.invalid == []
    assert len({e.id for e in result.examples}) == 30
    assert all(e.query.strip() and e.label.strip() for e in result.examples)


def test_dsr_sub_leaves_out_its_known_invalid_rows():
    result = load_source("dsr_sub")
    assert result.rows == 1209 and len(result.examples) == 1203 and result.invalid == [] and result.stale == []
    excluded = ["dsr_sub-139", "dsr_sub-265", "dsr_sub-309", "dsr_sub-546", "dsr_sub-782", "dsr_sub-1187"]
    assert [r.id for r in result.excluded] == excluded
    assert result.summary()["excluded_ids"][1] == "dsr_sub-265"
    assert "empty" in SHIPPED["dsr_sub"].known_invalid["dsr_sub-265"]


def test_math_leaves_out_golds_that_are_one_of_several_answers():
    """MATH's gold is the last \\boxed{} of its solution: for these rows one of the answers asked for, so a
    correct response scores 0. They are left out though the verifier reads them; none is in MATH-500."""
    wrong = {i for i, why in SHIPPED["math"].known_invalid.items() if why.startswith(WRONG_GOLD)}
    assert wrong >= {"test/algebra/1878.json", "test/intermediate_algebra/225.json", "test/precalculus/1227.json",
                     "test/precalculus/679.json", "test/intermediate_algebra/1855.json", "test/algebra/1730.json"}
    rows = {r["id"]: r for r in map(json.loads, SHIPPED["math"].path.read_text().split("\n")[:-1])}
    for row_id in wrong:
        solution = rows[row_id]["solution"]
        assert solution.count("\\boxed") >= 2 and rows[row_id]["answer"] in solution, row_id
    math500 = {json.loads(line)["id"] for line in SHIPPED["math500"].path.read_text().split("\n")[:-1]}
    assert not wrong & math500
    raw = [RawRow(f"f:{i}", r["id"], r) for i, r in enumerate(rows[i] for i in ["test/algebra/1.json", *wrong])]
    loaded = validate_rows("math", raw, query_field="problem", label_field="answer", id_field="id",
                           skip_invalid=False, known_invalid=SHIPPED["math"].known_invalid)
    assert [e.id for e in loaded.examples] == ["test/algebra/1.json"] and loaded.stale == []
    assert {r.id for r in loaded.excluded} == wrong and all(WRONG_GOLD in str(r) for r in loaded.excluded)


def test_run_data_from_named_sources():
    cfg = load_config("tests", ["data.source=dsr_sub", "data.eval_source=math500", "eval.heldout_size=20",
                                "data.train_size=50"])
    ex = task_examples(cfg)
    assert len(ex.train) == 50 and ex.train[0].id == "dsr_sub-0"
    assert len(ex.eval) == 20 and ex.eval[0].id == "test/precalculus/807.json"
    assert ex.summary["train"]["source"] == "dsr_sub" and ex.summary["heldout"]["source"] == "math500"
    assert ex.summary["overlap"] == 0


def test_a_file_source_needs_a_heldout_set(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    with pytest.raises(ConfigError, match=r"no held-out problems: set data.eval_source .* or data.heldout_fraction"):
        load_config("tests", [f"data.source={path}", *MAPPED])
    off = load_config("tests", [f"data.source={path}", *MAPPED, "eval.before=false", "eval.after=false"])
    assert task_examples(off).eval == []  # a run that never evaluates needs none
    for bad, message in [(["data.source=arith", "data.heldout_fraction=0.1"], "arith has its own held-out split"),
                         ([f"data.source={path}", "data.eval_source=math500", "data.heldout_fraction=0.1"],
                          "alternatives"),
                         ([f"data.source={path}", "data.heldout_fraction=1.5"], r"must be in \(0, 1\)")]:
        with pytest.raises(ConfigError, match=message):
            load_config("tests", bad)


def test_heldout_fraction_splits_by_prompt_deterministically(tmp_path):
    rows = ROWS + [{**ROWS[0], "id": 99}]  # the same prompt twice
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = load_config("tests", [f"data.source={path}", *MAPPED, "data.heldout_fraction=0.34"])
    ex = task_examples(cfg)
    assert len({e.query for e in ex.eval}) == 2  # round(0.34 × 6 distinct prompts)
    assert {e.query for e in ex.train}.isdisjoint(e.query for e in ex.eval) and ex.summary["overlap"] == 0
    assert sorted(e.id for e in ex.train + ex.eval) == sorted(str(r["id"]) for r in rows)
    twins = [e for e in ex.train + ex.eval if e.query == ROWS[0]["question"]]
    assert len(twins) == 2 and len({e in ex.eval for e in twins}) == 1  # both on one side
    again = task_examples(cfg)
    assert [e.id for e in again.eval] == [e.id for e in ex.eval]
    splits = {tuple(e.id for e in heldout_split(ex.train + ex.eval, 0.34, seed)[1]) for seed in range(6)}
    assert len(splits) > 1  # the seed decides
    with pytest.raises(DataError, match="leaves one side empty"):
        heldout_split(ex.train[:1], 0.5, 0)


def test_invalid_rows_are_counted_named_and_skipped_only_when_asked(tmp_path):
    rows = [ROWS[0], {**ROWS[1], "question": ""}, {**ROWS[2], "reward_model": {"ground_truth": "\\"}}, ROWS[3],
            {k: v for k, v in ROWS[4].items() if k != "reward_model"}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    fields = dict(query_field="question", label_field="reward_model.ground_truth", id_field="id")
    with pytest.raises(DataError) as info:
        load_source(str(path), **fields)
    message = str(info.value)
    assert message.startswith(f"{path}: 3 invalid rows of 5 (11, 12, 14); first: {path}:2:question: query must be")
    assert "data.skip_invalid=true" in message
    result = load_source(str(path), **fields, skip_invalid=True)
    assert [e.id for e in result.examples] == ["10", "13"] and result.skipped == 3
    summary = result.summary()
    assert summary["invalid"] == 3 and summary["rows"] == 5
    label = "reward_model.ground_truth"
    assert [p.split(": ")[0] for p in summary["invalid_first"]] == [f"{path}:2:question", f"{path}:3:{label}",
                                                                   f"{path}:5:{label}"]
    assert "rejected by the verifier" in summary["invalid_first"][1]


def test_parquet_with_field_mapping(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    result = load_source(str(path), query_field="question", label_field="reward_model.ground_truth", id_field="id")
    assert [(e.id, e.query, e.label) for e in result.examples][:2] == [("10", "What is 0 + 0?", "0"),
                                                                     ("11", "What is 1 + 1?", "2")]
    assert result.examples[0].meta == {"reward_model": {"ground_truth": "0"}, "topic": "sums"}  # top level only
    cfg = load_config("tests", [f"data.source={path}", *MAPPED, "eval.before=false", "eval.after=false"])
    assert len(task_examples(cfg).train) == 6
    with pytest.raises(DataError, match=r"rows\.parquet\[0\]:problem: missing field \(row has \['id', 'question'"):
        load_source(str(path))


def test_datasets_folders_with_field_mapping(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")  # not the user's cache

    folder = tmp_path / "files"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", ROWS[:4])
    write_jsonl(folder / "test.jsonl", ROWS[4:])
    fields = dict(query_field="question", label_field="reward_model.ground_truth", id_field="id")
    test = load_source(f"{folder}@test", **fields)
    assert [e.id for e in test.examples] == ["14", "15"] and test.examples[1].label == "10"
    with pytest.raises(DataError, match=r"choose a split with @SPLIT, one of \['test', 'train'\]"):
        load_source(str(folder), **fields)
    assert len(load_source(f"hf:{folder}@train", **fields).examples) == 4  # the hub call, on a local folder

    saved = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(saved))
    assert [e.id for e in load_source(str(saved), **fields).examples] == [str(r["id"]) for r in ROWS]


def test_a_hub_name_goes_through_load_dataset_and_fails_clearly_offline(tmp_path):
    code = ("from caspo.data import load_source\n"
            "try:\n    load_source('hf:caspo-nobody/no-such-dataset@train')\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout
    assert out.startswith("DataError hf:caspo-nobody/no-such-dataset@train: datasets could not load "
                          "'caspo-nobody/no-such-dataset'")
    assert "HF_DATASETS_OFFLINE=1" in out and out.count("\n") == 1


def test_unknown_sources_name_the_forms(tmp_path):
    with pytest.raises(DataError, match=r"College Math does not ship .* data.skip_invalid=true"):
        parse_source("collegemath")
    with pytest.raises(DataError, match=r"unknown data source 'math5000': use a shipped name \(dsr_sub, math500"):
        parse_source("math5000")
    with pytest.raises(DataError, match="no such data file"):
        parse_source(str(tmp_path / "missing.parquet"))
    assert parse_source("hf:openai/gsm8k:main@test").__dict__ == {"kind": "hub", "target": "openai/gsm8k",
                                                                "config": "main", "split": "test"}


def test_a_label_read_off_the_last_box_of_a_worked_solution():
    """data.label_field=boxed:solution, as MATH's train split needs: MATH-500's solutions give its answers."""
    from caspo.data.load import load_source
    from caspo.data.registry import SHIPPED

    loaded = load_source(str(SHIPPED["math500"].path), label_field="boxed:solution", id_field="id")
    assert len(loaded.examples) == 500
    assert all(e.label == e.meta["answer"] for e in loaded.examples)
    assert "solution" not in loaded.examples[0].meta  # the field the label came from is used up
