"""Arguments every `caspo` command shares: a preset and dotted overrides, loaded into a checked config."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import List, Optional

import typer

from caspo.config import Config, ConfigError, load_config
from caspo.data.check import check_arith, check_sources, check_template
from caspo.eval.benchmarks import HELDOUT
from caspo.methods import check_unread_overrides, resolve_method
from caspo.models.hub import looks_like_folder, missing_model_error
from caspo.models.policy import resolve_model_path

PRESET = typer.Argument(..., help="preset name (e.g. arith-tiny) or path to a YAML file")
OVERRIDES = typer.Argument(None, help="dotted overrides, e.g. train.steps=50 method.name=grpo")


def option_argv(options: dict) -> list[str]:
    """Parsed options back as command-line words, for a command that starts copies of itself: a value of None
    is left out, True is a bare flag, False nothing."""
    out: list[str] = []
    for flag, value in options.items():
        if value is None or value is False:
            continue
        out += [flag] if value is True else [flag, str(value)]
    return out


def checked_config(preset: str, overrides: Optional[List[str]], *, policy: bool = True, data: bool = True,
                   method_overrides: bool = False) -> Config:
    """The config with its method's checks and the data layer's (template, arithmetic task, benchmarks that
    exist); a ConfigError otherwise, which the CLI prints as one line. `policy`: the command loads
    model.policy, so it must exist (a hub id is checked when it loads); `data`: it reads data.source and
    data.eval_source, so they must exist (without it, only when eval.benchmarks has the heldout set);
    `method_overrides`: the command trains with the config's method, so an override of a method.* setting
    that method does not read is refused (the value commands read some outside any method)."""
    cfg = load_config(preset, overrides or [])
    resolve_method(cfg)
    if method_overrides:
        check_unread_overrides(cfg, overrides or [])
    check_template(cfg.data.template)
    check_arith(cfg)
    sources = {f"eval.benchmarks[{i}]": name for i, name in enumerate(cfg.eval.benchmarks) if name != HELDOUT}
    if data or HELDOUT in cfg.eval.benchmarks:
        sources = {"data.source": cfg.data.source, "data.eval_source": cfg.data.eval_source, **sources}
    check_sources(sources)
    check_device_index(cfg.model.device)
    if policy:
        check_policy(cfg.model.policy)
    return cfg


def expand_path(path: str | None) -> str | None:
    """A path argument of the command line with a leading ~ made the home folder (as the config's paths)."""
    return os.path.expanduser(path) if path and path.startswith("~") else path


def check_device_index(device: str) -> None:
    """model.device=cuda:N names one of the visible CUDA devices (without any, loading says so)."""
    import torch

    index = re.fullmatch(r"cuda:(\d+)", device)
    count = torch.cuda.device_count() if index else 0
    if index and count and int(index.group(1)) >= count:
        raise ConfigError(f"model.device={device}, but {count} CUDA device{'s are' if count > 1 else ' is'} visible "
                          f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''}); pick one of them or "
                          "model.device=cuda")


def check_output_dir(output_dir: str) -> None:
    """train.output_dir is a folder, or a path where one can be made (no file on the way)."""
    path = Path(output_dir)
    for part in [path, *path.parents]:
        if part.exists():
            if not part.is_dir():
                what = "is a file" if part == path else f"is inside {part}, which is a file"
                raise ConfigError(f"train.output_dir={output_dir} {what}; pass a folder path for the run")
            return


def check_init(init: str) -> None:
    """`caspo sft --init` takes a policy folder: a run folder or a checkpoint folder gets the policy inside it."""
    path = Path(init)
    if (path / "checkpoints").is_dir():
        steps = sorted(p.name for p in (path / "checkpoints").glob("step_*") if (p / "policy").is_dir())
        example = path / "checkpoints" / (steps[-1] if steps else "step_N") / "policy"
        raise ConfigError(f"--init {init} is a run folder; pass one of its checkpoints' policies, e.g. {example}")
    if path.name.startswith("step_") and (path / "policy").is_dir():
        raise ConfigError(f"--init {init} is a checkpoint folder; pass its policy: {path / 'policy'}")


def check_policy(spec: str) -> None:
    """An embedded policy that ships, a folder with config.json, or a hub id (which only loading can check)."""
    if not spec.strip():
        raise ConfigError("model.policy is empty; set it to a policy folder (with config.json), a hub id (ORG/NAME) "
                          "or embedded:NAME")
    path = resolve_model_path(spec)  # an embedded name that does not ship is an error naming those that do
    if not looks_like_folder(path):
        return
    if not Path(path).is_dir():
        raise missing_model_error(path, FileNotFoundError(path))
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"model.policy={spec!r} is a folder without config.json; pass a save_pretrained folder "
                          "(config.json, the weights, the tokenizer), embedded:NAME or a hub id")
