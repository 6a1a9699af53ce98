"""What `caspo eval POLICY_OR_RUN` evaluates: a run's checkpoints, one checkpoint, a policy folder or
`embedded:NAME`, and the config file that came with it.

    <run>/config.yaml, <run>/checkpoints/step_NNNNNN/policy/, <run>/checkpoints/latest

`--checkpoints` picks a run's checkpoints: a comma list of `all`, `latest`, `base` (the run's
model.policy, at step 0) and `step_N`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from caspo.config import read_text_checked
from caspo.config.load import read_yaml
from caspo.models.hub import local_parent, looks_like_folder

STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class Target:
    name: str  # the results' file stem: step_000010, base, or the policy's name
    step: int | None  # the x of the accuracy plot; None for a lone policy
    policy: str  # a policy folder, a hub id or embedded:NAME
    revision: str | None = None  # the hub commit of a run's base policy (its model.revision)


def checkpoint_dirs(run: Path) -> list[Path]:
    """The run's complete checkpoints, by step (a folder still being written has no policy/config.json)."""
    root = run / "checkpoints"
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / "policy" / "config.json").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def resolve(policy_or_run: str, checkpoints: str | None = None) -> tuple[list[Target], Path | None]:
    """(what to evaluate, the config.yaml that came with it, if any)."""
    if policy_or_run.startswith("embedded:"):
        return _lone(Target(policy_or_run.split(":", 1)[1], None, policy_or_run), checkpoints, None)
    path = Path(policy_or_run)
    if (path / "checkpoints").is_dir():
        config = path / "config.yaml"
        return select(path, checkpoints or "all"), config if config.is_file() else None
    if STEP_DIR.match(path.name) and (path / "policy" / "config.json").is_file():
        config = path / "config.yaml"
        return _lone(Target(path.name, _step(path), str(path / "policy")), checkpoints,
                     config if config.is_file() else None)
    if (path / "config.json").is_file():
        parent = path.resolve().parent
        if STEP_DIR.match(parent.name):  # <checkpoint>/policy
            config = parent / "config.yaml"
            return _lone(Target(parent.name, _step(parent), str(path)), checkpoints,
                         config if config.is_file() else None)
        return _lone(Target(path.resolve().name, None, str(path)), checkpoints, None)
    if not looks_like_folder(policy_or_run):  # a hub id (ORG/NAME): loaded from the local hub cache
        return _lone(Target(policy_or_run.rsplit("/", 1)[-1], None, policy_or_run), checkpoints, None)
    org = local_parent(policy_or_run) if not path.exists() else None
    taken = f" (no such folder; {org}/ is a folder here, so this is a path, not a hub id)" if org else ""
    raise FileNotFoundError(f"{policy_or_run}{taken}: not a run folder (with checkpoints/), a checkpoint "
                            "(step_N/policy/), a policy folder (with config.json), a hub id (ORG/NAME) or "
                            "embedded:NAME")


def select(run: Path, spec: str) -> list[Target]:
    dirs = checkpoint_dirs(run)
    by_name = {p.name: p for p in dirs}
    chosen: list[Target] = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        if item == "all":
            picked = [_target(p) for p in dirs]
        elif item == "latest":
            pointer = run / "checkpoints" / "latest"
            name = read_text_checked(pointer).strip() if pointer.is_file() else None
            if name not in by_name:
                raise FileNotFoundError(f"{run}: no latest checkpoint (checkpoints/latest missing or stale)")
            picked = [_target(by_name[name])]
        elif item == "base":
            picked = [Target("base", 0, *_base_policy(run))]
        elif STEP_DIR.match(item):
            name = f"step_{int(STEP_DIR.match(item).group(1)):06d}"
            if name not in by_name:
                raise FileNotFoundError(f"{run}: no checkpoint {item}; it has {', '.join(by_name) or 'none'}")
            picked = [_target(by_name[name])]
        else:
            raise ValueError(f"--checkpoints item {item!r}: use all, latest, base or step_N, comma-separated")
        chosen += [t for t in picked if t not in chosen]
    if not chosen:
        raise FileNotFoundError(f"{run}: no complete checkpoint to evaluate (checkpoints/step_N/policy/)")
    return chosen


def _target(ckpt: Path) -> Target:
    return Target(ckpt.name, _step(ckpt), str(ckpt / "policy"))


def _step(ckpt: Path) -> int:
    return int(STEP_DIR.match(ckpt.name).group(1))


def _base_policy(run: Path) -> tuple[str, str | None]:
    """The run's model.policy and model.revision: the base exactly as the run loaded it."""
    config = run / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(f"{run}: no config.yaml, so no base policy; evaluate model.policy directly")
    raw = read_yaml(read_text_checked(config), str(config)) or {}
    model = (raw.get("model") if isinstance(raw, dict) else None) or {}
    if not isinstance(model, dict) or not model.get("policy"):
        raise ValueError(f"{config}: no model.policy, so no base policy; evaluate the base policy directly")
    return model["policy"], model.get("revision")


def _lone(target: Target, checkpoints: str | None, config: Path | None) -> tuple[list[Target], Path | None]:
    if checkpoints not in (None, "all", "latest"):
        raise ValueError(f"--checkpoints {checkpoints} picks checkpoints of a run folder; {target.policy} is one "
                         "policy: leave --checkpoints out")
    return [target], config
