"""Arguments every `caspo` command shares: a preset and dotted overrides, loaded or a clean exit."""

from __future__ import annotations

from typing import List, Optional

import typer

from caspo.config import Config, ConfigError, load_config
from caspo.methods import resolve_method

PRESET = typer.Argument(..., help="preset name (e.g. arith-tiny) or path to a YAML file")
OVERRIDES = typer.Argument(None, help="dotted overrides, e.g. train.steps=50 method.name=grpo")


def config_or_exit(preset: str, overrides: Optional[List[str]]) -> Config:
    """The config, with its method's checks too, or one red line naming the problem and exit status 2."""
    try:
        cfg = load_config(preset, overrides or [])
        resolve_method(cfg)
        return cfg
    except ConfigError as err:
        typer.secho(f"config error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
