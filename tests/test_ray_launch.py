"""`caspo train --ray-address`: what each rank's process gets, how a failed rank stops the others, and a
Ray-local run of 2 workers against a single process (slow; needs the ray extra)."""

import json
import os
import sys
import threading
import time

import pytest
from test_distributed import RUN, caspo, exported, samples

from caspo.train import ray_launch


def test_a_rank_gets_the_source_path_first_the_determinism_variables_and_its_rank():
    driver = {"PYTHONPATH": "/elsewhere", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONHASHSEED": "0",
              "NCCL_ALGO": "Ring", "UNRELATED": "x"}
    env = ray_launch.rank_env(1, 2, "10.0.0.5", 29511, driver)
    source = ray_launch.source_path()
    assert os.path.isdir(os.path.join(source, "caspo"))
    assert env["PYTHONPATH"].split(os.pathsep) == [source, "/elsewhere"]
    assert (env["CUBLAS_WORKSPACE_CONFIG"], env["PYTHONHASHSEED"], env["NCCL_ALGO"]) == (":4096:8", "0", "Ring")
    assert "UNRELATED" not in env  # the rank's host keeps its own environment otherwise
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("1", "2", "0")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.5", "29511")


def test_stop_ends_the_rank_process_while_run_waits():
    rank = ray_launch.RankProcess()  # the actor's class, called here without Ray
    result = {}
    waiter = threading.Thread(target=lambda: result.update(code=rank.run(
        [sys.executable, "-c", "import time; time.sleep(60)"], {})))
    waiter.start()
    while rank.child is None:
        time.sleep(0.01)
    rank.stop()
    waiter.join(timeout=10)
    assert result["code"] < 0  # ended by SIGTERM, well before its 60 s


def test_without_ray_the_option_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    from typer.testing import CliRunner

    from caspo.cli import app

    result = CliRunner().invoke(app, ["train", "tests", f"train.output_dir={tmp_path}", "--ray-address", "local"])
    assert result.exit_code == 2
    assert "--ray-address needs Ray: pip install 'caspo[ray]'" in result.output


@pytest.mark.slow
def test_two_ray_workers_sample_and_train_as_one_process(tmp_path):
    pytest.importorskip("ray")
    runs = {"one": tmp_path / "one", "ray": tmp_path / "ray"}
    result = caspo("train", "tests", *RUN, "train.steps=2", f"train.output_dir={runs['one']}")
    assert result.returncode == 0, result.stderr[-3000:]
    result = caspo("train", "tests", *RUN, "train.steps=2", f"train.output_dir={runs['ray']}", "--nproc", "2",
                   "--ray-address", "local")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    starts = json.loads((runs["ray"] / "run.json").read_text())["starts"]
    assert starts[0]["world_size"] == 2
    assert (runs["ray"] / "ranks" / "rank1" / "metrics.jsonl").exists()
    one, two = samples(runs["one"]), samples(runs["ray"])
    assert len(one) == 2 * 8 and [s["tokens_digest"] for s in one] == [s["tokens_digest"] for s in two]
    w1, w2 = exported(runs["one"])["policy"], exported(runs["ray"])["policy"]
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) <= 1e-6
