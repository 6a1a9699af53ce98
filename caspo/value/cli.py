"""Phase 1 of CASPO: Monte Carlo prefix labels, prefix value training, probes.

caspo value collect arith-tiny rollout.max_batch=64 --out labels.jsonl [--shard 0/4 | --nproc 4]

caspo value merge labels.jsonl labels.0.jsonl labels.1.jsonl ...

caspo value train labels.jsonl --policy embedded:tiny-arith --out value/ --val-split prompt

caspo value probe value/ labels.jsonl

caspo value check-mc arith-tiny --prompts 200

caspo value check-spurious value/ arith-tiny

caspo value smoke arith-tiny method.caspo.value_model=value/ [--threshold 0.7]
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import List, Literal, Optional

import typer

from caspo.cli_args import OVERRIDES, PRESET, checked_config, option_argv
from caspo.config import ConfigError

value_app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

THREADS_HELP = "CPU threads for torch (0: torch's default); more than the free cores makes small models far slower"
DEVICE_HELP = "cpu, cuda, cuda:N (a GPU's index) or auto (cuda when available)"


def positive(flag: str, value: float) -> float:
    """`value` if it is a finite number > 0, else a ConfigError naming `flag`."""
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{flag} {value}: must be a finite number > 0")
    return value


def torch_device(flag: str, device: str) -> str:
    """The device `device` names (auto resolved), checked as model.device is: a ConfigError naming `flag`."""
    from caspo.models.policy import resolve_device

    return str(resolve_device(device, flag))


@value_app.command()
def collect(preset: str = PRESET, overrides: Optional[List[str]] = OVERRIDES,
            out: Path = typer.Option(..., help="label file to write (JSONL)"),
            shard: str = typer.Option("0/1", help="i/n: this process takes prompts i, i+n, i+2n, ..."),
            recipe: str = typer.Option("cpu", help="sizes: cpu (embedded policy, minutes) or gpu (K=16, J=16, S=5)"),
            prompts: Optional[int] = typer.Option(None, min=1, help="training prompts over all shards (recipe's "
                                                                    "if unset)"),
            k: Optional[int] = typer.Option(None, min=2, help="base rollouts per prompt (at least 2: a prompt is "
                                                              "labelled when they hold a right and a wrong one)"),
            j: Optional[int] = typer.Option(None, min=1, help="continuations per labelled prefix"),
            boundaries: Optional[int] = typer.Option(None, min=1, help="labelled step boundaries per rollout (S)"),
            splitter: Optional[str] = typer.Option(None, help="newline | latex (default: newline for arith)"),
            pairing: Literal["all", "paper", "paper_multi"] = typer.Option(
                "all", help="labelled rollouts of a mixed-outcome prompt: all of them, one right and one wrong "
                            "(paper), or min(right, wrong) disjoint pairs (paper_multi)"),
            state_temperature: Optional[float] = typer.Option(
                None, help="sample the base rollouts (the labelled states) at this temperature; continuations, "
                           "and so the labels, keep the preset's (default: the preset's)"),
            nproc: int = typer.Option(1, "--nproc", min=1, help="shards at once, one process per device, merged "
                                                                "into --out")):
    """Label response prefixes with Monte Carlo success rates of the preset's policy."""
    from caspo.value.collect import RECIPES, parse_shard
    from caspo.value.collect import collect as run_collect

    if recipe not in RECIPES:
        raise typer.BadParameter(f"unknown recipe {recipe!r}; choose from {', '.join(RECIPES)}")
    if state_temperature is not None:
        positive("--state-temperature", state_temperature)
    if nproc > 1:
        from caspo.models.policy import resolve_device
        from caspo.value.shards import collect_shards

        if shard != "0/1":
            raise ConfigError("--nproc runs every shard itself: leave --shard out")
        cfg = checked_config(preset, overrides)  # fail fast, before any process starts
        options = {"--recipe": recipe, "--prompts": prompts, "--k": k, "--j": j, "--boundaries": boundaries,
                   "--splitter": splitter, "--pairing": pairing, "--state-temperature": state_temperature}
        argv = [preset, *(overrides or []), *option_argv(options)]
        rows = collect_shards(argv, out, nproc, resolve_device(cfg.model.device).type == "cuda")
        typer.echo(f"{rows} rows from {nproc} shards -> {out}")
        return
    sizes = {"prompts": prompts, "k": k, "j": j, "boundaries": boundaries, "state_temperature": state_temperature}
    spec = dataclasses.replace(RECIPES[recipe], pairing=pairing,
                               **{key: v for key, v in sizes.items() if v is not None})
    part = parse_shard(shard)  # one shard of several may label nothing; a whole collection that does is no use
    header = run_collect(checked_config(preset, overrides), spec, out, part, splitter, allow_empty=part[1] > 1)
    typer.echo(json.dumps({key: v for key, v in header.items() if key != "provenance"}, indent=2))


@value_app.command()
def merge(out: Path = typer.Argument(..., help="merged label file to write"),
          shards: List[Path] = typer.Argument(..., help="the shard files 0/n ... n-1/n")):
    """Concatenate the shards of one collection (all of them, each once)."""
    from caspo.value.labels import merge_label_files

    merged = merge_label_files(shards, out, allow_empty=False)
    typer.echo(f"{len(merged.rows)} rows from {len(shards)} shards -> {out}")


@value_app.command()
def train(labels: Path = typer.Argument(..., help="label file from `caspo value collect` / `merge`"),
          policy: str = typer.Option(..., help="model that φ starts from and the frozen reference"),
          out: Path = typer.Option(..., help="folder for the best value model, metrics.json, calibration.png"),
          val_split: str = typer.Option("prompt", help="row | prompt | file:PATH (a held-out label file)"),
          val_fraction: float = typer.Option(0.1, help="share of rows or prompts held out (row / prompt split)"),
          beta: float = typer.Option(10.0, help="V = β Σ log(π_φ/π_ref) (> 0)"),
          lr: float = typer.Option(3e-4, help="AdamW learning rate, > 0 (a 1.5B full fine-tune wants ~5e-6)"),
          epochs: int = typer.Option(2, min=1),
          batch_size: int = typer.Option(16, min=1, help="rollouts per optimizer step"),
          micro_batch_size: int = typer.Option(16, min=1, help="rollouts per forward"),
          eval_every: int = typer.Option(0, min=0, help="optimizer steps between validations (0: once per epoch)"),
          max_train_prefix_len: int = typer.Option(0, min=0, help="drop training prefixes longer than this many "
                                                   "response tokens, counted (0: keep all)"),
          save_every: int = typer.Option(0, min=0, help="also save the model every N epochs in "
                                         "OUT/step_NNNNNN/ with that epoch's metrics (0: only the best)"),
          merge_duplicates: bool = typer.Option(False, help="one forward per distinct rollout, weighted by its "
                                                "copies (same loss; batch-size then counts distinct rollouts)"),
          seed: int = typer.Option(0), device: str = typer.Option("cpu", help=DEVICE_HELP),
          threads: int = typer.Option(1, min=0, help=THREADS_HELP),
          nproc: int = typer.Option(1, "--nproc", min=1, help="ranks, one per device (torchrun underneath): φ and "
                                                              "the reference sharded with FSDP2"),
          overwrite: bool = typer.Option(False, "--overwrite", help="replace a model already in --out")):
    """Fit a prefix value model: BCE of σ(V/β) against p̂; keeps the best validation ρ."""
    import subprocess

    import torch

    from caspo.train import distributed
    from caspo.train.run_files import refuse_model_folder
    from caspo.value.train import TrainSpec, train_value

    positive("--beta", beta)
    positive("--lr", lr)
    if nproc > 1 and device.startswith("cuda:"):
        raise ConfigError(f"--device {device} with --nproc {nproc} would put every rank on one card; pass --device "
                          "cuda: rank r then takes cuda:LOCAL_RANK")
    torch_device("--device", device)  # checked here; each rank resolves its own
    if not overwrite:  # a policy, a run's checkpoint or another value model: the best φ would replace it
        refuse_model_folder(out, "--out")
    if nproc > 1 and not distributed.launched():  # start the ranks, each running this command without --nproc
        options = {"--policy": policy, "--out": out, "--val-split": val_split, "--val-fraction": val_fraction,
                   "--beta": beta, "--lr": lr, "--epochs": epochs, "--batch-size": batch_size,
                   "--micro-batch-size": micro_batch_size, "--eval-every": eval_every,
                   "--max-train-prefix-len": max_train_prefix_len, "--save-every": save_every, "--seed": seed,
                   "--device": device, "--threads": threads, "--merge-duplicates": merge_duplicates,
                   "--overwrite": overwrite}
        argv = ["value", "train", str(labels), *option_argv(options)]
        raise typer.Exit(subprocess.call(distributed.launch_command(nproc, argv)))
    if threads:
        torch.set_num_threads(threads)
    spec = TrainSpec(beta=beta, lr=lr, epochs=epochs, batch_size=batch_size, micro_batch_size=micro_batch_size,
                     val_split=val_split, val_fraction=val_fraction, eval_every=eval_every, seed=seed,
                     merge_duplicates=merge_duplicates, max_train_prefix_len=max_train_prefix_len,
                     save_every=save_every)
    summary = train_value(labels, policy, out, spec, device)
    main = distributed.is_main()
    distributed.finish()  # a rank leaves its group once the value model is gone
    if main:
        typer.echo(json.dumps(summary, indent=2))


@value_app.command()
def probe(checkpoint: Path = typer.Argument(..., help="prefix value model folder"),
          labels: Path = typer.Argument(..., help="label file to judge it on"),
          out: Optional[Path] = typer.Option(None, help="folder for metrics.json and calibration.png"),
          allow_mismatch: bool = typer.Option(False, help="probe even if the labels' provenance differs"),
          batch_size: int = typer.Option(32, min=1, help="rollouts per forward"),
          device: str = typer.Option("cpu", help=DEVICE_HELP),
          threads: int = typer.Option(1, min=0, help=THREADS_HELP),
          precision: str = typer.Option("fp32", help="fp32, bf16 or fp16: read V as a run of that "
                                                     "train.precision does")):
    """Spearman ρ, within-response ρ, AUC and accuracy of a value model on a label file."""
    import torch

    from caspo.models.prefix_value import load_prefix_value
    from caspo.models.provenance import check_provenance
    from caspo.models.tokenizer import load_tokenizer
    from caspo.precision import COMPUTE_DTYPES
    from caspo.value.labels import read_label_file
    from caspo.value.probe import evaluate, write_report

    device = torch_device("--device", device)
    if precision not in COMPUTE_DTYPES:
        raise ConfigError(f"--precision {precision}: use one of {', '.join(COMPUTE_DTYPES)}")
    if threads:
        torch.set_num_threads(threads)
    label_file = read_label_file(labels)
    model = load_prefix_value(checkpoint, None, device=device)
    check_provenance(model.provenance, label_file.provenance, f"label file {labels}", allow_mismatch,
                     ignore=("reference",))  # label sets have no reference
    pad = load_tokenizer(checkpoint).pad_token_id
    metrics, values = evaluate(model, label_file.rows, pad, batch_size, device, precision)
    if out is not None:
        write_report(out, metrics, values, label_file.rows, model.beta, f"probe {checkpoint.name} on {labels.name}",
                     extra={"checkpoint": str(checkpoint), "labels": str(labels)})
    typer.echo(json.dumps(metrics, indent=2))


@value_app.command("compare")
def compare(preset: str = PRESET, overrides: Optional[List[str]] = OVERRIDES):
    """Correlation of CASPO's and VinePPO's step advantages on one batch (needs method.caspo.value_model)."""
    from caspo.value.compare import compare_step_advantages

    cfg = checked_config(preset, ["method.name=caspo", *(overrides or [])])
    typer.echo(json.dumps(compare_step_advantages(cfg), indent=2))


@value_app.command()
def smoke(preset: str = PRESET, overrides: Optional[List[str]] = OVERRIDES,
          threshold: float = typer.Option(0.7, min=0.0, max=1.0, help="v_acc a value model needs to pass")):
    """The smoke gate: V of each response of the first CASPO rollout batch against its outcome (exit 1 if v_acc
    is below --threshold); read v_acc against the majority baseline and the AUC."""
    from caspo.config import ConfigError
    from caspo.value.smoke import smoke_gate

    cfg = checked_config(preset, ["method.name=caspo", *(overrides or [])])
    if cfg.method.name != "caspo":  # an override after the one above
        raise ConfigError(f"the smoke gate rolls out as CASPO's first step: drop method.name={cfg.method.name}")
    report = smoke_gate(cfg, threshold)
    typer.echo(json.dumps(report, indent=2))
    if not report["passed"]:
        raise typer.Exit(1)


@value_app.command("check-mc")
def check_mc(preset: str = PRESET, overrides: Optional[List[str]] = OVERRIDES,
             prompts: int = typer.Option(200, min=1, help="held-out prompts"),
             k: int = typer.Option(9, min=1, help="continuations per V(prompt)"),
             m: int = typer.Option(64, min=1, help="independent samples per prompt for the reference rate"),
             planted: int = typer.Option(50, min=1, help="prompts that also get a planted wrong first line"),
             out: Optional[Path] = typer.Option(None, help="JSON report to write")):
    """Check MC values: z-scores of V(prompt) against independent samples; a planted wrong line."""
    from caspo.value.mc_check import run_check

    report = run_check(checked_config(preset, overrides), prompts, k, m, planted)
    if out is not None:
        out.write_text(json.dumps(report, indent=2) + "\n")
    if not report["calibration_passed"]:
        raise typer.Exit(1)


@value_app.command("check-spurious")
def check_spurious(checkpoint: Path = typer.Argument(..., help="prefix value model folder"),
                   preset: str = PRESET, overrides: Optional[List[str]] = OVERRIDES,
                   problems: int = typer.Option(100, min=1, help="held-out problems ending in + or −"),
                   threads: int = typer.Option(1, min=0, help=THREADS_HELP)):
    """Does the value model rank a spurious extra line below the correct state? (arithmetic task)"""
    import torch

    from caspo.data.build import load_task_data
    from caspo.models.prefix_value import load_prefix_value
    from caspo.models.provenance import prompt_format, provenance_mismatches
    from caspo.models.tokenizer import load_tokenizer
    from caspo.value.spurious import spurious_line_check

    if threads:
        torch.set_num_threads(threads)
    cfg = checked_config(preset, overrides, policy=False)  # the value model's folder holds its policy
    if cfg.data.source != "arith":
        raise typer.BadParameter(f"preset {preset!r} reads data.source={cfg.data.source!r}; the check builds "
                                 "arithmetic solutions, use an arith preset")
    model = load_prefix_value(checkpoint, None)
    tokenizer = load_tokenizer(checkpoint)
    # only the prompts must match: the check reads values, it samples nothing
    prompts_here = dataclasses.replace(model.provenance, **prompt_format(cfg, tokenizer))
    differ = provenance_mismatches(prompts_here, model.provenance)
    if differ:
        raise typer.BadParameter(f"the value model was trained on prompts of another format than preset {preset!r} "
                                 f"builds ({'; '.join(differ)}); pass the preset it was trained with")
    data = load_task_data(cfg, tokenizer)
    report = spurious_line_check(model, tokenizer, data.eval_prompts, [e.meta["solution"] for e in data.eval],
                                 problems)
    typer.echo(json.dumps(report, indent=2))
