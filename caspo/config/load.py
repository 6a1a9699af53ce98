"""From a preset and dotted overrides to a checked `Config`, and back to YAML.

The preset's YAML and the overrides (each value read as YAML) merge into one tree, which `build`
walks against the schema's field types: an unknown key or a value of the wrong type is an error
naming its key path and what was expected. Then `validate` runs.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from caspo.config.schema import Config, ConfigError
from caspo.config.validate import validate

FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
PRESET_DIR = Path(__file__).parent.parent / "presets"
# the settings that name a file or folder: a leading ~ is the home folder, expanded when the config loads
PATH_SETTINGS = ("model.policy", "data.source", "data.eval_source", "train.output_dir", "method.caspo.value_model")
# YAML 1.1 reads these words, unquoted, as booleans (any capitalisation PyYAML accepts).
YAML_BOOL_WORDS = {True: ("true", "yes", "on"), False: ("false", "no", "off")}


def resolve_preset(preset: str | Path) -> Path:
    """A preset name ("arith-tiny") or a path to a YAML file."""
    path = Path(preset).expanduser()
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        return path
    named = PRESET_DIR / f"{preset}.yaml"
    if not named.exists():
        names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown preset {preset!r}; presets: {', '.join(names)} (or pass a .yaml path)")
    return named


def load_config(preset: str | Path | None = None, overrides: list[str] = ()) -> Config:
    raw: dict = {}
    if preset is not None:
        path = resolve_preset(preset)
        raw = read_yaml(read_text_checked(path), str(path)) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    cfg = build(Config, raw, "")
    expand_home(cfg)
    validate(cfg)
    return cfg


def read_text_checked(path: str | Path, error: type[Exception] = ConfigError) -> str:
    """The text of a file that must be UTF-8; otherwise `error` naming the file."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{path} is not UTF-8 text (byte {err.start}: {err.reason}); re-save it as UTF-8") from None


def expand_home(cfg: Config) -> None:
    """A leading ~ of each path setting (PATH_SETTINGS) made the home folder, so that every reader, and the
    run's config.yaml, sees the path itself."""
    for key in PATH_SETTINGS:
        *sections, name = key.split(".")
        node = cfg
        for section in sections:
            node = getattr(node, section)
        value = getattr(node, name)
        if isinstance(value, str) and value.startswith("~"):
            setattr(node, name, os.path.expanduser(value))


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key.path=value")
    key, text = item.split("=", 1)
    return key.strip(), read_yaml(text, f"override {item!r}") if text.strip() else ""


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that gives a key twice (safe_load keeps the last silently)."""

    where = "YAML"

    def construct_document(self, node):
        refuse_duplicate_keys(node, "", self.where)
        return super().construct_document(node)


def refuse_duplicate_keys(node: yaml.Node, prefix: str, where: str, seen_nodes: set | None = None) -> None:
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if id(node) in seen_nodes:  # an alias of a node already walked
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key, line = (key_node.tag, key_node.value), key_node.start_mark.line + 1
                name = f"{prefix}{key_node.value}"
                if key_node.value != "<<" and key in lines:
                    raise ConfigError(f"{where} line {line}: {name} given twice (also at line {lines[key]}); "
                                      "keep one")
                lines[key] = line
                refuse_duplicate_keys(value_node, f"{name}.", where, seen_nodes)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            refuse_duplicate_keys(item, f"{prefix.rstrip('.')}[{i}].", where, seen_nodes)


def read_yaml(text: str, where: str) -> Any:
    loader = UniqueKeyLoader(text)
    loader.where = where
    try:
        return loader.get_single_data()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"{where}: not valid YAML ({problem}{at}); quote a value that holds "
                          "':', '[' or '{'") from None
    finally:
        loader.dispose()


def set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {key}: {part} is not a section")
    node[parts[-1]] = value


def build(cls, raw: Any, path: str):
    """Instantiate dataclass `cls` from `raw`, checking keys and types."""
    if raw is None and path:
        raise ConfigError(f"{path}: the section is empty (`{path.rsplit('.', 1)[-1]}:` with nothing under it); "
                          "indent its settings under it, or remove that line")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"unknown key {where}{unknown[0]}; valid keys here: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = coerce(hints[name], value, f"{path}.{name}" if path else name)
    return cls(**kwargs)


def coerce(tp, value: Any, path: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce(inner[0], value, path)
    if origin is Literal:
        if isinstance(value, bool) and all(isinstance(a, str) for a in args):
            value = literal_from_yaml_bool(value, args)
        if value not in args:
            raise ConfigError(f"{path}: expected one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected bool (true/false), got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected int, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and FLOAT_RE.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads "1e-4" (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected float, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected str, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported config type {tp}")


def literal_from_yaml_bool(value: bool, choices: tuple[str, ...]) -> str | bool:
    """The one choice a YAML boolean may have been spelled as (`off` read as False -> "off"), else
    `value` unchanged: a choice list with none of its spellings, or with two, is left to reject it."""
    spelled = [c for c in choices if c in YAML_BOOL_WORDS[value]]
    return spelled[0] if len(spelled) == 1 else value


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


ABSENT = "(absent)"  # a key one of two configs lacks


def leaves(value: Any, key: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of each leaf of a nested dict under `key`: an override train={steps: 5} sets train.steps."""
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in leaves(v, f"{key}.{k}" if key else k)]
    return [(key, value)]


def config_changes(saved: dict, now: dict, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """dotted key -> (saved, now) for every setting whose value differs between two config dicts (sorted; a
    key only one of them has is ABSENT in the other)."""
    changes = {}
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key, ABSENT), now.get(key, ABSENT)
        if isinstance(a, dict) and isinstance(b, dict):
            changes |= config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changes[f"{prefix}{key}"] = (a, b)
    return changes


def describe_changes(changes: dict[str, tuple[Any, Any]]) -> list[str]:
    """`config_changes` as "key: saved -> now" lines."""
    return [f"{key}: {a} -> {b}" for key, (a, b) in changes.items()]


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
