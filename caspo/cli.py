"""The `caspo` command line: train, sft, convert, eval, config, verify-resume, value, report, suite."""

from __future__ import annotations

import json
from functools import partial
from typing import List, Optional

import click
import typer
from typer.core import TyperGroup

import caspo.allocator  # noqa: F401  (first of caspo's modules: sets the CUDA allocator before torch starts CUDA)
from caspo.cli_args import (
    OVERRIDES,
    PRESET,
    check_init,
    check_output_dir,
    checked_config,
    expand_path,
    option_argv,
)
from caspo.config import ConfigError, to_yaml
from caspo.value.cli import value_app


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors a user causes and can fix (a config, a data file, a model or checkpoint path, a run folder),
    each raised with a message naming the problem and the fix. Imported only when an error is being handled."""
    from caspo.data.examples import DataError
    from caspo.models.provenance import ProvenanceError
    from caspo.rollout.native.kv_cache import CacheDoesNotFit
    from caspo.rollout.native.spec import UnsupportedModelError
    from caspo.runlog import DamagedRunFile
    from caspo.train.checkpoint import CheckpointError
    from caspo.train.loop import RunStopped
    from caspo.value.labels import LabelFileError

    # OSError: a missing file or folder, a model that is neither a folder nor on the hub, a run folder in use
    return (ConfigError, DataError, ProvenanceError, UnsupportedModelError, CheckpointError, RunStopped,
            LabelFileError, CacheDoesNotFit, DamagedRunFile, OSError)


class Commands(TyperGroup):
    """The app's commands; a user error ends the command with its message in red and exit status 2, without
    a traceback (`caspo --debug COMMAND ...` shows it). Any other exception is a bug and shows its traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except user_errors() as err:
            if ctx.params.get("debug"):
                raise
            message = str(err).strip() or type(err).__name__
            typer.secho(f"{ctx.invoked_subcommand or 'caspo'} error: {message}", fg=typer.colors.RED, err=True)
            typer.secho("(caspo --debug ... shows the traceback)", dim=True, err=True)
            raise typer.Exit(2) from None


app = typer.Typer(cls=Commands, add_completion=False, no_args_is_help=True, help=__doc__)
app.add_typer(value_app, name="value", help="phase 1: Monte Carlo step labels, prefix-value training, probes")


def integer(flag: str, item: str, takes: str = "a comma list of integers") -> int:
    try:
        return int(item)
    except ValueError:
        raise ValueError(f"{flag}: {item.strip()!r} is not an integer ({flag} takes {takes})") from None


def print_version(value: bool) -> None:
    if not value:
        return
    from importlib.metadata import PackageNotFoundError

    import caspo

    try:
        typer.echo(f"caspo {caspo.__version__}")
    except PackageNotFoundError:
        typer.secho("caspo is not installed, so it has no version: install it with `pip install -e .` in the "
                    "checkout", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    raise typer.Exit()


@app.callback()
def main(debug: bool = typer.Option(False, "--debug", help="on an error, show the traceback instead of one line"),
         version: bool = typer.Option(False, "--version", callback=print_version, is_eager=True,
                                      help="print the version and exit")):
    """Reinforcement learning of language models on verifiable math."""


@app.command()
def config(preset: str = PRESET, overrides: Optional[List[str]] = OVERRIDES):
    """Print the resolved configuration."""
    typer.echo(to_yaml(checked_config(preset, overrides, method_overrides=True)))


@app.command()
def train(ctx: typer.Context, preset: str = PRESET, overrides: Optional[List[str]] = OVERRIDES,
          resume: Optional[str] = typer.Option(None, help="checkpoint folder, run folder, or 'latest'"),
          overwrite: bool = typer.Option(False, help="start over in a train.output_dir that holds a run"),
          nproc: int = typer.Option(1, "--nproc", min=1, help="processes on this host, one per device (torchrun "
                                                                "underneath; docs/distributed.md)"),
          ray_address: Optional[str] = typer.Option(None, "--ray-address", help="run the --nproc ranks on this Ray "
                                                    "cluster (host:port, or local to start one)")):
    """Train a policy with the configured method."""
    import os
    import subprocess

    from caspo.methods import unread_note
    from caspo.runlog import console
    from caspo.train import distributed
    from caspo.train.signals import wait_relaying
    from caspo.value.refresh import train as run_train

    resume = expand_path(resume)
    cfg = checked_config(preset, overrides, method_overrides=True)
    check_output_dir(cfg.train.output_dir)
    if (nproc > 1 or ray_address) and not distributed.launched():  # start the ranks, each running this command
        distributed.check_config(cfg, nproc)
        if cfg.train.deterministic:  # in place before any rank starts (Ray passes it on to each)
            os.environ.update(distributed.DETERMINISTIC_ENV)
        argv = ["--debug"] if ctx.parent and ctx.parent.params.get("debug") else []
        # without --nproc: torchrun's parser would take it for its own --nproc-per-node
        argv += ["train", preset, *(overrides or []), *option_argv({"--resume": resume, "--overwrite": overwrite})]
        if ray_address:
            from caspo.train.ray_launch import launch

            raise typer.Exit(launch(ray_address, nproc, argv, cfg.model.device,
                                    shutdown_s=60 * cfg.train.collective_timeout_minutes))
        launcher = subprocess.Popen(distributed.launch_command(nproc, argv),
                                    env=distributed.launch_env(60 * cfg.train.collective_timeout_minutes))
        raise typer.Exit(wait_relaying(launcher))
    if nproc > 1 and distributed.launched() and int(os.environ["WORLD_SIZE"]) != nproc:
        raise ConfigError(f"--nproc {nproc}, but the launcher started {os.environ['WORLD_SIZE']} processes")
    note = unread_note(cfg)
    if note and int(os.environ.get("RANK", "0")) == 0:  # once, not from every rank
        console.print(f"[yellow]{note}[/]", soft_wrap=True)  # one line, however wide the terminal
    summary = run_train(cfg, resume=resume, overwrite=overwrite)
    main = distributed.is_main()
    distributed.finish()  # a rank leaves its group once the run's models are gone
    if main:
        typer.echo(json.dumps(summary, indent=2))


@app.command()
def looped(ctx: typer.Context, overrides: Optional[List[str]] = OVERRIDES,
           algorithm: str = typer.Option("ppo", help="ppo (actor and critic, GAE), grpo, dppo or flow-dppo"),
           model: Optional[str] = typer.Option(None, help="the looped checkpoint (model.policy)"),
           data: Optional[str] = typer.Option(None, help="a JSONL file of prompt / label rows (data.source)"),
           output_dir: Optional[str] = typer.Option(None, "--output-dir", help="train.output_dir"),
           rollout_batch_size: int = typer.Option(4, "--rollout-batch-size", help="prompts per rollout"),
           n_samples_per_prompt: Optional[int] = typer.Option(None, "--n-samples-per-prompt",
                                                              help="completions per prompt (4 for grpo, else 1)"),
           stop_after: int = typer.Option(0, "--stop-after", help="stop with a checkpoint after this many updates"),
           resume: Optional[str] = typer.Option(None, help="checkpoint folder, run folder, or 'latest'"),
           precision: str = typer.Option("fp32", help="fp32, bf16, or fp16 (fixed loss scale 128)"),
           recompute: bool = typer.Option(False, "--recompute", help="checkpoint each physical block's activations"),
           rlt_cuda_graphs: bool = typer.Option(False, "--rlt-cuda-graphs",
                                                help="the engine's CUDA-graph decode (eager by default)"),
           overwrite: bool = typer.Option(False, help="start over in an output folder that holds a run"),
           nproc: int = typer.Option(1, "--nproc", min=1, help="ranks, one per device"),
           ray_address: Optional[str] = typer.Option(None, "--ray-address",
                                                     help="run the ranks on this Ray cluster (host:port, or local)")):
    """The fixed-depth recurrent policy recipe with its flags: caspo train looped-recipe plus the flags as
    overrides; extra key=value arguments pass through after them."""
    from caspo.cli_looped import PRESET, check_pass_through, recipe_overrides

    flags = recipe_overrides(algorithm, rollout_batch_size, n_samples_per_prompt, precision, recompute,
                             rlt_cuda_graphs, stop_after, model, data, output_dir)
    check_pass_through(flags, overrides or [])
    train(ctx, preset=PRESET, overrides=[*flags, *(overrides or [])], resume=resume, overwrite=overwrite,
          nproc=nproc, ray_address=ray_address)


@app.command()
def sft(preset: str = PRESET, overrides: Optional[List[str]] = OVERRIDES,
        output: str = typer.Option(..., help="folder for the trained policy and tokenizer"),
        init: Optional[str] = typer.Option(None, help="continue from this policy instead of from scratch"),
        overwrite: bool = typer.Option(False, "--overwrite",
                                       help="replace an SFT run or another model already in --output")):
    """Supervised fine-tuning of a tiny policy on the arithmetic task."""
    from caspo.train.sft import run_sft

    output, init = expand_path(output), expand_path(init)
    if init is not None:
        check_init(init)
    cfg = checked_config(preset, overrides, policy=False, data=False)  # a policy from scratch, arith
    typer.echo(json.dumps(run_sft(cfg, output, init=init, overwrite=overwrite), indent=2))


@app.command()
def convert(src: str = typer.Argument(..., help="an upstream Ouro or Nanbeige4.2 folder (config.json, safetensors, "
                                                 "tokenizer)"),
            dst: str = typer.Argument(..., help="the folder to write (must not exist)"),
            ignore_key: Optional[List[str]] = typer.Option(None, "--ignore-key", help="an upstream config key the "
                                                           "conversion does not know, checked to be without effect")):
    """Write an upstream looped checkpoint as a caspo-looped HF folder (model, tokenizer, source record)."""
    from caspo.models.looped_upstream import convert_upstream

    try:
        model = convert_upstream(src, dst, ignore_keys=ignore_key or [])
    except ValueError as err:  # not an upstream folder, a setting the looped model does not implement
        raise ConfigError(str(err)) from None
    c = model.config
    typer.echo(json.dumps({"dst": dst, "layout": c.layout, "depth": c.depth, "layers": c.num_hidden_layers,
                           "parameters": sum(p.numel() for p in model.parameters())}, indent=2))


@app.command("eval")
def evaluate(
    policy_or_run: str = typer.Argument(..., help="a run folder, a checkpoint, a policy folder or embedded:NAME"),
    overrides: Optional[List[str]] = OVERRIDES,
    preset: Optional[str] = typer.Option(None, help="preset or YAML; default: the run's or checkpoint's config.yaml, "
                                                   "else arith-tiny (which a shipped math benchmark refuses)"),
    benchmarks: Optional[str] = typer.Option(None, help="comma list of math500, gsm8k, olympiadbench, math, dsr_sub, "
                                                       "arith, heldout or data files; default eval.benchmarks"),
    samples: Optional[int] = typer.Option(None, help="samples per problem: avg@K, pass@k (k <= K), maj@K"),
    limit: Optional[int] = typer.Option(None, help="first N problems of each benchmark (0 = all)"),
    temperature: Optional[float] = typer.Option(None, help="the samples' temperature (default: the run's)"),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="the samples' top-p (default: the run's)"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="tokens per completion"),
    checkpoints: Optional[str] = typer.Option(None, help="a run's checkpoints: all, latest, base, step_N (comma list)"),
    out: str = typer.Option(..., help="folder for <checkpoint>.json, summary.md and accuracy.png"),
):
    """Greedy accuracy, avg@K, pass@k and maj@K of a policy or a run's checkpoints on benchmarks."""
    from caspo.data.registry import ARITH, HELDOUT, SHIPPED
    from caspo.eval.run import evaluate_targets
    from caspo.eval.targets import resolve
    from caspo.models.policy import EMBEDDED

    policy_or_run, out = expand_path(policy_or_run), expand_path(out)
    benchmark_list = comma_items("--benchmarks", benchmarks, "list benchmarks (math500, gsm8k, arith, heldout, "
                                 "data files, ...) or leave it out for eval.benchmarks")
    comma_items("--checkpoints", checkpoints, "use all, latest, base or step_N, or leave it out for all")
    try:
        targets, run_config = resolve(policy_or_run, checkpoints)
    except ValueError as err:  # the selection does not fit the target (a missing one is a FileNotFoundError)
        raise ConfigError(f"{err}") from None
    flags = {"samples": samples, "limit": limit, "temperature": temperature, "top_p": top_p,
             "max_new_tokens": max_new_tokens, "benchmarks": benchmark_list}
    # the shipped math sets; and data files, unless the policy is an embedded one, whose preset is arith-tiny
    named = [b for b in flags["benchmarks"] or [] if b in SHIPPED or
             (b not in (ARITH, HELDOUT) and not policy_or_run.startswith(EMBEDDED))]
    if named and preset is None and run_config is None:  # else arith-tiny's template and 96 tokens, silently
        raise ConfigError(f"{', '.join(named)} need(s) a real run's template and token budget: add --preset "
                          "qwen-math-dsr (or rho1b-math, or a YAML); without it a policy gets arith-tiny's settings")
    # the flags as the last overrides, so that they are checked like any other setting
    flag_overrides = [f"eval.{key}={json.dumps(value)}" for key, value in flags.items() if value is not None]
    cfg = checked_config(preset or (str(run_config) if run_config else "arith-tiny"),
                         [*(overrides or []), *flag_overrides], policy=False, data=False)
    check_policy_override(overrides or [], cfg.model.policy, policy_or_run, targets)
    results = evaluate_targets(cfg, targets, out)
    typer.echo(json.dumps({"out": out, "results": {r["checkpoint"]: {name: b["metrics"] for name, b in
                                                                      r["benchmarks"].items()} for r in results}},
                          indent=2))


def comma_items(flag: str, text: str | None, use: str) -> list[str] | None:
    """A comma-list option's items (None when the option is not given); an empty list is an error."""
    if text is None:
        return None
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ConfigError(f"{flag} is empty ({text!r}): {use}")
    return items


def check_policy_override(overrides: list[str], policy: str, policy_or_run: str, targets: list) -> None:
    """`caspo eval` evaluates its POLICY_OR_RUN argument: a model.policy override is refused unless it names
    that same policy (it would otherwise be dropped without notice)."""
    from pathlib import Path

    if not any(item.split("=", 1)[0].strip() == "model.policy" for item in overrides):
        return
    same = len(targets) == 1 and (targets[0].policy == policy or (
        Path(policy).exists() and Path(targets[0].policy).exists() and Path(policy).samefile(targets[0].policy)))
    if not same:
        raise ConfigError(f"model.policy={policy}: caspo eval evaluates its target, {policy_or_run} (the target is "
                          "the policy); pass the policy to evaluate as that argument and leave model.policy out")


@app.command("verify-resume")
def verify_resume(preset: str = PRESET, overrides: Optional[List[str]] = OVERRIDES,
                  workdir: str = typer.Option("runs/verify-resume", help="folder for the two runs"),
                  nproc: int = typer.Option(1, "--nproc", min=1, help="processes of each run (as caspo train)")):
    """Check that 2 steps + a resumed third equal 3 uninterrupted steps, bit for bit."""
    from caspo.train.distributed import check_config
    from caspo.train.verify_resume import verify_resume as run_verify

    cfg = checked_config(preset, overrides, method_overrides=True)
    check_config(cfg, nproc)  # fail fast on a bad config
    if not run_verify(preset, overrides or [], workdir, nproc=nproc):
        raise typer.Exit(1)


@app.command()
def report(runs: List[str] = typer.Argument(..., help="run folders, or suite folders (holding suite.json)"),
           out: str = typer.Option(..., help="folder for report.md, summary.json and the PNGs"),
           group_by: str = typer.Option("config", help="config (runs differing only in seed), method, or run"),
           allow_mismatch: bool = typer.Option(False, help="compare runs made under different conditions")):
    """Curves, timing and pins of runs (running, finished or crashed); runs × seeds compared, mean ± 95% interval."""
    from caspo.config import ConfigError
    from caspo.report.compare import expand
    from caspo.report.compare import report as write_report

    try:
        path = write_report(expand([expand_path(r) for r in runs]), expand_path(out), group_by=group_by,
                            allow_mismatch=allow_mismatch)
    except ValueError as err:  # runs that do not compare, a bad --group-by, a damaged metrics.jsonl
        raise ConfigError(str(err)) from None
    typer.echo(str(path))


@app.command()
def suite(preset: str = PRESET, overrides: Optional[List[str]] = OVERRIDES,
          methods: str = typer.Option(..., help="comma list of METHOD or LABEL=METHOD, each with +KEY=VALUE "
                                                "overrides of its own (e.g. mu2=grpo+train.epochs_per_rollout=2)"),
          seeds: str = typer.Option("0", help="comma list of train.seed values"),
          out: str = typer.Option(..., help="the suite's folder: <label>/seed<k>/, suite.json, report/"),
          devices: Optional[str] = typer.Option(None, help="CUDA device indices (comma list; cpu for the CPU), one run "
                                                           "on each at a time; a device named k times runs k at once, "
                                                           "each with 1/k of the KV share; default: model.device, "
                                                           "one run at a time"),
          benchmarks: Optional[str] = typer.Option(None, help="evaluate each finished run's checkpoints on these "
                                                              "(as caspo eval --benchmarks)"),
          group_by: str = typer.Option("config", help="the report's grouping: config, method or run"),
          ray_address: Optional[str] = typer.Option(None, "--ray-address", help="place the runs on this Ray cluster "
                                                    "(host:port, or local), one device each"),
          ray_slots: Optional[int] = typer.Option(None, "--ray-slots", help="with --ray-address: runs at a time "
                                                                           "(default 1)")):
    """Methods × seeds from one preset, queued one run per device; rerun to resume; then a caspo report."""
    from caspo.config import ConfigError
    from caspo.train.suite import run_suite

    try:
        seed_list = [integer("--seeds", s) for s in seeds.split(",") if s.strip()]
        device_list = [d.strip() if d.strip() == "cpu" else f"cuda:{integer('--devices', d, 'CUDA indices or cpu')}"
                       for d in devices.split(",")] if devices else None
        result = run_suite(preset, methods, seed_list, expand_path(out),
                           checked_config=partial(checked_config, method_overrides=True),  # as each run's caspo train
                           devices=device_list, overrides=overrides or [], benchmarks=benchmarks, group_by=group_by,
                           ray_address=ray_address, ray_slots=ray_slots)
    except ValueError as err:  # a bad --methods / --seeds / --devices item, a folder holding another suite
        raise ConfigError(str(err)) from None
    typer.echo(json.dumps(result, indent=2))
    if result["failed"]:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
