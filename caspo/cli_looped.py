"""The flags of `caspo looped` (the fixed-depth recurrent policy recipe) as overrides of the looped-recipe preset.

Each flag is a config override, so a run started by `caspo looped` is the run of
`caspo train looped-recipe <the overrides>`, and its ranks (torchrun or Ray) run exactly that command.
"""

from __future__ import annotations

from caspo.config import ConfigError

PRESET = "looped-recipe"
# the setting each override of `recipe_overrides` stands for -> the flag(s) that set it
FLAG_OF = {"method.name": "--algorithm", "rollout.prompts_per_step": "--rollout-batch-size",
           "rollout.samples_per_prompt": "--n-samples-per-prompt",
           "train.minibatch_size": "--rollout-batch-size × --n-samples-per-prompt (and --algorithm)",
           "train.epochs_per_rollout": "--algorithm", "train.precision": "--precision",
           "train.activation_checkpointing": "--recompute", "rollout.cuda_graphs": "--rlt-cuda-graphs",
           "train.stop_after": "--stop-after", "train.old_logprobs": "--algorithm", "model.policy": "--model",
           "data.source": "--data", "train.output_dir": "--output-dir"}
# the recipe's algorithm names -> our method rows: its ppo is actor and critic with GAE
ALGORITHMS = {"ppo": "ppo_critic", "grpo": "grpo", "dppo": "dppo", "flow-dppo": "flow_dppo"}


def recipe_overrides(algorithm: str, rollout_batch_size: int, n_samples_per_prompt: int | None,
                     precision: str, recompute: bool, cuda_graphs: bool, stop_after: int,
                     model: str | None = None, data: str | None = None, output_dir: str | None = None) -> list[str]:
    """The overrides of the looped-recipe preset that the flags stand for.

    One optimizer step per rollout (the whole completion batch), except flow-dppo: two steps, each on half of
    it. Completions per prompt default to 4 for GRPO (which needs at least two) and 1 for the others. PPO and
    GRPO take the engine's scores as π_old (the recipe's rollout log-probs); dppo keeps them apart from its
    recomputed proximal policy, and flow-dppo's gate reads its frozen old policy."""
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"--algorithm {algorithm}: use one of {', '.join(ALGORITHMS)}")
    if n_samples_per_prompt is None:
        n_samples_per_prompt = 4 if algorithm == "grpo" else 1
    if precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"--precision {precision}: use fp32, bf16 or fp16 (fixed loss scale 128)")
    if rollout_batch_size < 1 or n_samples_per_prompt < 1:
        raise ConfigError("--rollout-batch-size and --n-samples-per-prompt must be at least 1")
    if algorithm == "grpo" and n_samples_per_prompt < 2:
        raise ConfigError(f"--algorithm grpo normalises rewards within a prompt's group: --n-samples-per-prompt must "
                          f"be at least 2 (got {n_samples_per_prompt})")
    completions = rollout_batch_size * n_samples_per_prompt
    if algorithm == "flow-dppo" and completions % 2:
        raise ConfigError(f"--algorithm flow-dppo takes two optimizer steps on halves of the {completions} "
                          "completions: make --rollout-batch-size × --n-samples-per-prompt even")
    minibatch = completions // 2 if algorithm == "flow-dppo" else completions
    out = [f"method.name={ALGORITHMS[algorithm]}", f"rollout.prompts_per_step={rollout_batch_size}",
           f"rollout.samples_per_prompt={n_samples_per_prompt}", f"train.minibatch_size={minibatch}",
           "train.epochs_per_rollout=1", f"train.precision={precision}",
           f"train.activation_checkpointing={str(recompute).lower()}",
           f"rollout.cuda_graphs={str(cuda_graphs).lower()}", f"train.stop_after={stop_after}"]
    if algorithm in ("ppo", "grpo"):
        out.append("train.old_logprobs=behaviour")
    for key, value in (("model.policy", model), ("data.source", data), ("train.output_dir", output_dir)):
        if value is not None:
            out.append(f"{key}={value}")
    return out


def check_pass_through(flags: list[str], overrides: list[str]) -> None:
    """Refuse a pass-through override of a setting the flags set (the later one would win without notice)."""
    set_by_flags = {item.split("=", 1)[0] for item in flags}
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if "=" in item and key in set_by_flags:
            flag = FLAG_OF.get(key, "its flag")
            raise ConfigError(f"{item}: caspo looped sets {key} from {flag}; use {flag}, not {key} (or run "
                              f"caspo train {PRESET} with the overrides you want)")
