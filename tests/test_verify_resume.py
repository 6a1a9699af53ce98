"""`caspo verify-resume` on bad input, without training: a failed run is a user error with the run's own error
line; an override of a setting verify-resume makes itself is refused (one giving its value passes)."""

import subprocess

import pytest
from typer.testing import CliRunner

from caspo.cli import app
from caspo.config import ConfigError
from caspo.train import verify_resume as module

CHILD_STDERR = ("some progress\ntrain error: model.device=cuda but no CUDA device is visible; use model.device=cpu\n"
                "(caspo --debug ... shows the traceback)\n")


def test_a_failed_run_is_a_user_error_with_its_last_error_line(tmp_path, monkeypatch):
    calls = []

    def failing(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 2, stdout="", stderr=CHILD_STDERR)

    monkeypatch.setattr(module.subprocess, "run", failing)
    result = CliRunner().invoke(app, ["verify-resume", "tests", "--workdir", str(tmp_path)])
    assert result.exit_code == 2 and len(calls) == 1, result.output
    log = tmp_path / "uninterrupted.log"
    assert f"verify-resume error: the uninterrupted run exited 2: train error: model.device=cuda but no CUDA device " \
           f"is visible; use model.device=cpu (its output: {log})" in " ".join(result.output.split())
    assert "Traceback" not in result.output and "RuntimeError" not in result.output
    assert CHILD_STDERR in log.read_text()
    # a run that crashed (a bug) gives its traceback's last line
    assert module.last_error("Traceback (most recent call last):\n  File 'x'\nKeyError: 'skip'\n") == "KeyError: 'skip'"


@pytest.mark.parametrize("override,message", [
    ("train.steps=10", "train.steps=10: verify-resume sets train.steps=3 itself"),
    ("train.deterministic=false", "verify-resume sets train.deterministic=true itself"),
    ("eval.after=true", "verify-resume sets eval.after=false itself"),
    ("train.save_every=1", "verify-resume sets train.save_every=0 itself"),
    ("train.output_dir=elsewhere", r"verify-resume sets train.output_dir itself \(its runs go in --workdir\)"),
    ("train.stop_after=1", "verify-resume sets train.stop_after itself"),
])
def test_an_override_of_what_verify_resume_sets_is_refused(tmp_path, monkeypatch, override, message):
    """Appended after the user's overrides, its own won silently: train.steps=10 ran 3 steps."""
    monkeypatch.setattr(module.subprocess, "run", lambda *a, **k: pytest.fail("a run started"))
    result = CliRunner().invoke(app, ["verify-resume", "tests", override, "--workdir", str(tmp_path)])
    assert result.exit_code == 2 and "leave it out" in result.output, result.output
    with pytest.raises(ConfigError, match=message):
        module.check_overrides(["model.threads=1", override])


def test_an_override_giving_verify_resumes_own_value_passes():
    with pytest.raises(ConfigError, match="train={steps: 10}: verify-resume sets train.steps=3 itself"):
        module.check_overrides(["train={steps: 10}"])  # a section's mapping sets its keys
    module.check_overrides(["train.steps=3", "train.deterministic=true", "eval.before=false", "train.save_every=0",
                            "model.threads=1"])
