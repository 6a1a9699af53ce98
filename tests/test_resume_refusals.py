"""A `--resume` that cannot go on is a user error (one line, exit status 2, no traceback) naming the problem and
the fix, and leaves the run's files as they were: other optimizer settings, fewer steps than the checkpoint's,
--overwrite beside it, a damaged manifest, trainer state or `latest`, and a `latest` naming no folder."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from caspo.cli import app
from caspo.train import checkpoint as ckpt

QUICK = ["eval.before=false", "eval.after=false", "model.threads=1"]
STEP = "step_000002"
SAVED = [STEP]  # the tests preset saves at the end only


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_user_error(result, message: str):
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()[-2:]
    assert lines[1] == "(caspo --debug ... shows the traceback)", lines
    assert lines[0].startswith("train error: ") and message in lines[0], lines[0]


def files(run: Path) -> dict[str, str]:
    """Every file under `run` (and every folder) with its contents' digest."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(run.rglob("*"))}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("trained") / "run"
    result = invoke("train", "tests", f"train.output_dir={run}", "train.steps=2", *QUICK)
    assert result.exit_code == 0, result.output
    assert (run / "checkpoints" / "latest").read_text().strip() == STEP
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == SAVED
    return run


@pytest.fixture
def run(trained, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def resume(run: Path, *args, steps: int = 2):
    return invoke("train", "tests", f"train.output_dir={run}", f"train.steps={steps}", *QUICK, *args)


def test_a_refused_resume_leaves_config_yaml_as_it_was(run):
    before = files(run)
    assert "lr: 0.0001" in (run / "config.yaml").read_text()
    result = resume(run, "optim.lr=0.5", "--resume", "latest")
    assert_user_error(result, "was trained with other optimizer settings (optim.lr 0.0001 -> 0.5)")
    assert files(run) == before  # config.yaml still holds the run's own lr, as the message says
    # a corrupted checkpoint found by restore after the models are loaded: nothing is written either
    weights = run / "checkpoints" / STEP / "policy" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    before = files(run)
    result = resume(run, "optim.lr=0.5", "--resume", "latest")
    assert_user_error(result, "policy/model.safetensors does not match its checksum")
    assert files(run) == before


def test_a_resume_with_fewer_steps_than_the_checkpoint_is_refused_and_as_many_finishes(run, tmp_path):
    before = files(run)
    assert_user_error(resume(run, "--resume", "latest", steps=1), "the checkpoint is at step 2; set train.steps >= 2")
    assert files(run) == before
    # as many steps as the checkpoint's: nothing left to train, the run ends (a suite resumes a run that failed
    # after its last checkpoint, in its final evaluation, this way)
    result = resume(run, "--resume", "latest")
    assert result.exit_code == 0, result.output
    assert json.loads((run / "status.json").read_text())["state"] == "finished"


def test_resume_with_overwrite_is_refused_for_the_runs_own_checkpoint(run, tmp_path):
    before = files(run)
    for point in ("latest", run / "checkpoints" / STEP):
        assert_user_error(resume(run, "--resume", point, "--overwrite"),
                          "--resume and --overwrite together: --resume continues the run in")
        assert files(run) == before  # --overwrite removed nothing
    # a branch (another run's checkpoint) into a folder holding a run may start over there: documented
    branch = tmp_path / "branch"
    shutil.copytree(run, branch)
    result = resume(branch, "--resume", run / "checkpoints" / STEP, "--overwrite")
    assert result.exit_code == 0, result.output
    assert not (branch / "checkpoints").exists()  # the old run's files went; the branch saved nothing yet


def resave_state(folder: Path, drop: str) -> None:
    state = ckpt.load_trainer_state(folder)
    del state[drop]
    torch.save(state, folder / "trainer_state.pt")
    (folder / ckpt.MANIFEST).write_text(json.dumps(ckpt.file_manifest(folder), indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / ckpt.MANIFEST).write_text('["a"]'), f"{STEP}/manifest.json is damaged"),
    (lambda f: (f / ckpt.MANIFEST).write_text('{"trainer_state.pt": {"sha": 1}}'),
     f"{STEP}/manifest.json is damaged"),
    (lambda f: resave_state(f, "optimizers"), f"{STEP}/trainer_state.pt lacks optimizers: it is damaged"),
    (lambda f: resave_state(f, "cursor"), f"{STEP}/trainer_state.pt lacks cursor: it is damaged"),
    (lambda f: (f.parent / "latest").write_bytes(b"\xff\xfe"), "checkpoints/latest is not UTF-8 text"),
], ids=["manifest-list", "manifest-entry", "state-optimizers", "state-cursor", "latest-not-utf8"])
def test_a_damaged_checkpoint_file_is_named(run, damage, message):
    damage(run / "checkpoints" / STEP)
    before = files(run)
    result = resume(run, "--resume", "latest")
    assert_user_error(result, message)
    assert "resume from an earlier checkpoint" in result.stderr.replace("\n", "")
    assert files(run) == before


@pytest.mark.parametrize("latest, message", [
    ("", "checkpoints/latest is empty (it should name a checkpoint folder); pass --resume"),
    ("step_000009\n", "checkpoints/latest names step_000009, which is missing; pass --resume"),
])
def test_a_latest_naming_no_folder_says_so(run, latest, message):
    (run / "checkpoints" / "latest").write_text(latest)
    before = files(run)
    result = resume(run, "--resume", "latest")
    assert_user_error(result, message)
    assert f"/checkpoints/step_N (there: {', '.join(SAVED)})" in result.stderr.replace("\n", "")
    assert files(run) == before


def test_resolve_checkpoint_of_a_latest_naming_no_folder(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "latest").write_text("step_000003")
    with pytest.raises(ckpt.CheckpointError, match="names step_000003, which is missing; .* holds no step_"):
        ckpt.resolve_checkpoint(tmp_path)
    (root / "step_000003").mkdir()
    assert ckpt.resolve_checkpoint(tmp_path) == root / "step_000003"
