"""The `caspo` command line: train, sft, eval, config, verify-resume, value."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from caspo.cli_args import OVERRIDES, PRESET, config_or_exit
from caspo.config import to_yaml
from caspo.value.cli import value_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
app.add_typer(value_app, name="value", help="phase 1: Monte Carlo step labels, prefix-value training, probes")

@app.command()
def config(preset: str = PRESET, overrides: Optional[List[str]] = OVERRIDES):
    """Print the resolved configuration."""
    typer.echo(to_yaml(config_or_exit(preset, overrides)))


@app.command()
def train(preset: str = PRESET, overrides: Optional[List[str]] = OVERRIDES,
          resume: Optional[str] = typer.Option(None, help="checkpoint folder, run folder, or 'latest'"),
          overwrite: bool = typer.Option(False, help="start over in a train.output_dir that holds a run")):
    """Train a policy with the configured method."""
    from caspo.value.refresh import train as run_train

    summary = run_train(config_or_exit(preset, overrides), resume=resume, overwrite=overwrite)
    typer.echo(json.dumps(summary, indent=2))


@app.command()
def sft(preset: str = PRESET, overrides: Optional[List[str]] = OVERRIDES,
        output: str = typer.Option(..., help="folder for the trained policy and tokenizer"),
        init: Optional[str] = typer.Option(None, help="continue from this policy instead of from scratch")):
    """Supervised fine-tuning of a tiny policy on the arithmetic task."""
    from caspo.train.sft import run_sft

    typer.echo(json.dumps(run_sft(config_or_exit(preset, overrides), output, init=init), indent=2))


@app.command("eval")
def evaluate(preset: str = PRESET, overrides: Optional[List[str]] = OVERRIDES):
    """Greedy held-out accuracy of `model.policy`."""
    from caspo.train.loop import build_trainer
    from caspo.train.loop import evaluate as run_eval

    tr = build_trainer(config_or_exit(preset, overrides))
    with tr.pool:
        typer.echo(json.dumps(run_eval(tr), indent=2))


@app.command("verify-resume")
def verify_resume(preset: str = PRESET, overrides: Optional[List[str]] = OVERRIDES,
                  workdir: str = typer.Option("runs/verify-resume", help="folder for the two runs")):
    """Check that 2 steps + a resumed third equal 3 uninterrupted steps, bit for bit."""
    from caspo.train.verify_resume import verify_resume as run_verify

    config_or_exit(preset, overrides)  # fail fast on a bad config
    if not run_verify(preset, overrides or [], workdir):
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
