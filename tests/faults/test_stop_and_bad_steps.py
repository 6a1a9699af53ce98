"""Faults a long run survives: SIGTERM mid-step, non-finite gradients, a reused or wrong run folder."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from caspo.config import load_config
from caspo.train import checkpoint as ckpt
from caspo.train import loop
from caspo.train.verify_resume import state_hashes, traces

pytestmark = pytest.mark.timeout(300)

BASE = ["train.steps=3", "train.deterministic=true", "eval.before=false", "eval.after=false", "model.threads=1"]


def run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)


@pytest.mark.slow  # about 40 s: three runs; the default run checks bit-identical resume with verify-resume
def test_sigterm_mid_step_checkpoints_that_step_and_resumes_bit_identically(tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    common = f"from caspo.config import load_config\nfrom caspo.train import loop\nBASE = {BASE!r}\n"
    done = run(common + f"loop.train(load_config('tests', BASE + ['train.output_dir={straight}']))\n")
    assert done.returncode == 0, done.stderr[-2000:]
    # the signal arrives while step 2 is running (inside its update), as a scheduler's SIGTERM would
    killed = run(common + textwrap.dedent(f"""
        import os, signal
        real = loop.update
        def update(tr_actor, batch, cfg, method, state, *rest):
            if method and real.calls == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            real.calls += 1
            return real(tr_actor, batch, cfg, method, state, *rest)
        real.calls = 0
        loop.update = update
        summary = loop.train(load_config('tests', BASE + ['train.output_dir={stopped}']))
        assert summary['stopped_by'] == 'SIGTERM', summary
    """))
    assert killed.returncode == 0, killed.stderr[-2000:]
    assert ckpt.resolve_checkpoint(stopped).name == "step_000002"  # the step it was in finished and was saved
    resumed = run(common + f"loop.train(load_config('tests', BASE + ['train.output_dir={stopped}']), "
                           "resume='latest')\n")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert {**state_hashes(straight), **traces(straight)} == {**state_hashes(stopped), **traces(stopped)}


def test_non_finite_gradients_skip_the_update_and_stop_the_run_after_max_bad_steps(tmp_path, monkeypatch):
    cfg = load_config("tests", [f"train.output_dir={tmp_path}", "train.steps=6", "train.save_every=1",
                                "train.max_bad_steps=2", "eval.before=false", "eval.after=false"])
    real = loop.update.__globals__["policy_loss"]
    calls = {"n": 0}

    def poisoned(model, micro, cfg, denom, *args):
        loss, metrics = real(model, micro, cfg, denom, *args)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] > 8 else loss), metrics  # steps 1-2 clean: 4 micro-batches each

    monkeypatch.setitem(loop.update.__globals__, "policy_loss", poisoned)
    with pytest.raises(loop.RunStopped, match="2 outer steps in a row skipped an update"):
        loop.train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 2, 4]  # both updates of a step skipped; stopped at the 2nd
    assert ckpt.resolve_checkpoint(tmp_path).name == "step_000003"  # step 4's state was never saved
    good = ckpt.load_trainer_state(ckpt.resolve_checkpoint(tmp_path))
    assert all(torch.isfinite(v).all() for s in good["optimizers"]["policy"]["state"].values()
               for v in s.values() if isinstance(v, torch.Tensor))


def test_a_run_folder_in_use_is_refused_unless_resumed_or_overwritten(tmp_path):
    cfg = load_config("tests", [f"train.output_dir={tmp_path}", "train.steps=1", "eval.before=false",
                                "eval.after=false"])
    loop.train(cfg)
    first = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(FileExistsError, match="already holds a run .*--resume latest.*--overwrite"):
        loop.train(cfg)
    assert (tmp_path / "metrics.jsonl").read_text() == first  # nothing truncated
    loop.train(cfg, overwrite=True)
    assert ckpt.resolve_checkpoint(tmp_path).name == "step_000001"


def test_a_bad_resume_path_fails_before_anything_is_written(tmp_path):
    cfg = load_config("tests", [f"train.output_dir={tmp_path / 'run'}", "eval.before=false"])
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        loop.train(cfg, resume=str(tmp_path / "nowhere"))
    assert not (tmp_path / "run").exists()
