"""Arguments every `caspo` command shares: a preset and dotted overrides, loaded into a checked config."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from caspo.config import Config, ConfigError, load_config
from caspo.data.check import check_arith, check_sources, check_template
from caspo.eval.benchmarks import HELDOUT
from caspo.methods import resolve_method
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


def checked_config(preset: str, overrides: Optional[List[str]], *, policy: bool = True, data: bool = True) -> Config:
    """The config with its method's checks and the data layer's (template, arithmetic task, benchmarks that
    exist); a ConfigError otherwise, which the CLI prints as one line. `policy`: the command loads
    model.policy, so it must exist (a hub id is checked when it loads); `data`: it reads data.source and
    data.eval_source, so they must exist (without it, only when eval.benchmarks has the heldout set)."""
    cfg = load_config(preset, overrides or [])
    resolve_method(cfg)
    check_template(cfg.data.template)
    check_arith(cfg)
    sources = {f"eval.benchmarks[{i}]": name for i, name in enumerate(cfg.eval.benchmarks) if name != HELDOUT}
    if data or HELDOUT in cfg.eval.benchmarks:
        sources = {"data.source": cfg.data.source, "data.eval_source": cfg.data.eval_source, **sources}
    check_sources(sources)
    if policy:
        check_policy(cfg.model.policy)
    return cfg


def check_policy(spec: str) -> None:
    """An embedded policy that ships, a folder with config.json, or a hub id (which only loading can check)."""
    path = resolve_model_path(spec)  # an embedded name that does not ship is an error naming those that do
    if not looks_like_folder(path):
        return
    if not Path(path).is_dir():
        raise missing_model_error(path, FileNotFoundError(path))
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"model.policy={spec!r} is a folder without config.json; pass a save_pretrained folder "
                          "(config.json, the weights, the tokenizer), embedded:NAME or a hub id")
