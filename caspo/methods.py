"""The method table: each method is one row that holds what it does.

    advantages  fn(batch, token_rewards, method config) -> (advantages, returns)   caspo.train.advantages
    loss        the policy loss of one micro-batch                                 caspo.train.policy_losses
    whiten      token whitening when method.adv_whiten=auto: "batch" or "none"
    step_whiten what method.step_adv_scope (batch | group | off) standardises, for step methods:
                "tokens" (each response token once, as VinePPO's PPO trainer whitens) or "steps"
                (each valid step once: the seed's CASPO standardize_step_advantage); "none" otherwise
    schedule    "minibatches": train.epochs_per_rollout × minibatches of train.minibatch_size;
                "halves": one epoch of two optimizer steps, each on half the completions
    state       the method-owned state and its hooks (caspo.train.method_state): a critic, a
                Monte Carlo value source, a prefix value model, a frozen old policy
    reads       the method.* settings it reads beyond COMMON, those every method reads ("caspo.online"
                for method.caspo.online); a command-line override of any other is refused
                (check_unread_overrides), and the config file's are noted at start (unread_note)

Adding a method is one row here (or `register(Method(...))` from anywhere) plus, at
most, one new pure function.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Literal

from caspo.config import Config, ConfigError, MethodConfig, config_changes, leaves, parse_override
from caspo.train import advantages as adv
from caspo.train import policy_losses as losses
from caspo.train.critic import Critic, CriticAndFrozenOld
from caspo.train.method_state import MethodState
from caspo.train.policy_losses import PolicyLoss
from caspo.train.step_values import MonteCarloValues, PrefixValues


@dataclass(frozen=True)
class Method:
    name: str
    advantages: Callable[..., adv.Advantages]
    loss: PolicyLoss
    whiten: Literal["none", "batch"] = "none"
    step_whiten: Literal["none", "tokens", "steps"] = "none"
    schedule: Literal["minibatches", "halves"] = "minibatches"
    state: type[MethodState] = MethodState
    group_baseline: bool = False  # compares samples within a prompt group: needs G >= 2
    reads: frozenset[str] = frozenset()  # method.* keys read beyond COMMON (method.caspo.x as "caspo.x")
    doc: str = ""


METHODS: dict[str, Method] = {}
ALIASES = {"flow-dppo": "flow_dppo"}  # the looped recipe's spelling


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


# The method.* settings every method reads: the loss's token aggregation, the KL terms, the ±adv_clip σ clip,
# the high-ratio micro-batch skip, and the step splitter (each run logs its steps per response; train.health's
# length alarm counts them).
COMMON = frozenset({"loss_agg", "kl_coef", "kl_estimator", "kl_loss_agg", "kl_reward_coef", "adv_clip",
                    "ratio_skip", "step_splitter", "max_steps", "after_final_box"})
# what each part of a row reads: PPO's ratio clip, GAE and its critic, the step methods' TD
CLIP = frozenset({"clip_low", "clip_high", "dual_clip"})
GAE = frozenset({"adv_whiten", "gamma", "lam", "critic_lr", "critic_weight_decay", "critic_grad_clip", "value_clip"})
GROUP = frozenset({"adv_whiten", "std_normalize"})
DPPO_MASK = GROUP | {"dppo_delta_low", "dppo_delta_high", "dppo_ratio_cap"}
STEP_TD = CLIP | {"gamma", "step_adv_scope"}
# CASPO's prefix value model: frozen or online (φ's step takes the critic's weight decay and clip), refreshed
CASPO = frozenset({"adv_whiten", "critic_weight_decay", "critic_grad_clip"}) | {
    f"caspo.{name}" for name in ("value_model", "transform", "online", "online_value_lr", "use_adb", "use_dlw",
                                 "refresh_every", "refresh_prompts", "refresh_k", "refresh_j", "refresh_boundaries",
                                 "refresh_state_temperature", "refresh_lr", "refresh_epochs", "refresh_batch_size",
                                 "refresh_val_fraction", "refresh_pairing", "refresh_max_train_prefix_len",
                                 "step_adv_clip", "allow_provenance_mismatch", "shuffle_values")}

for _row in [
    Method("grpo", adv.group_relative, losses.PPO_CLIP, group_baseline=True, reads=CLIP | GROUP,
           doc="group-relative terminal reward (DeepSeekMath); no second batch-wide whitening"),
    Method("ppo", adv.terminal, losses.PPO_CLIP, reads=CLIP | GROUP | {"terminal_scope"},
           doc="PPO with the terminal reward standardised over batch, group or not at all"),
    Method("ppo_critic", adv.gae, losses.PPO_CLIP, whiten="batch", state=Critic, reads=CLIP | GAE,
           doc="PPO with a learned scalar critic and GAE (Schulman et al. 2017)"),
    Method("dppo", adv.gae, losses.DECOUPLED, whiten="batch", state=Critic, reads=CLIP | GAE | {"iw_low", "iw_high"},
           doc="decoupled PPO: behaviour log-probs from the engine, proximal ones recomputed, bounded weight"),
    Method("flow_dppo", adv.gae, losses.DIVERGENCE_GATE, whiten="batch", schedule="halves", state=CriticAndFrozenOld,
           reads=GAE | {"gate_threshold"},
           doc="categorical divergence gate against frozen old-policy distributions; two steps on halves"),
    Method("vineppo", adv.mc_step_td, losses.PPO_CLIP, step_whiten="tokens", state=MonteCarloValues,
           reads=STEP_TD | {"vineppo_k", "vineppo_context_tokens"},
           doc="VinePPO: step values = mean reward of K Monte Carlo continuations from each step boundary"),
    Method("caspo", adv.prefix_step_td, losses.PPO_CLIP, step_whiten="steps", state=PrefixValues,
           reads=STEP_TD | CASPO,
           doc="step TD on values from a learned prefix value model (IPVRM-style), frozen or online"),
    Method("dppo_tv", adv.group_relative, losses.DPPO_TV, group_baseline=True, reads=DPPO_MASK,
           doc="Divergence-PPO binary total-variation mask, group-relative advantages"),
    Method("dppo_kl", adv.group_relative, losses.DPPO_KL, group_baseline=True, reads=DPPO_MASK,
           doc="Divergence-PPO binary KL mask, group-relative advantages"),
]:
    register(_row)


def method_keys(method: Method) -> frozenset[str]:
    """The method.* settings `method` reads, as keys under method ("critic_lr", "caspo.online")."""
    return COMMON | method.reads


def readers(key: str) -> list[str]:
    """The methods that read method.`key`."""
    return [name for name, row in METHODS.items() if key in method_keys(row)]


def check_unread_overrides(cfg: Config, overrides: list[str]) -> None:
    """Refuse a command-line override of a method.* setting that cfg's method does not read: it would run
    without effect. Run after resolve_method, whose refusals of such values name a more specific fix."""
    method = get_method(cfg.method.name)
    for item in overrides:
        key, value = parse_override(item)
        for key, _ in leaves(value, key):  # method.caspo={online: true} sets method.caspo.online
            if not key.startswith("method.") or key == "method.name":
                continue
            setting = key.removeprefix("method.")
            if setting not in method_keys(method):
                by = readers(setting)
                read = f"is read by {', '.join(by)}" if by else "is read by no method"
                raise ConfigError(f"{key} {read}; method.name={method.name} does not read it: drop it"
                                  + (" or choose that method" if len(by) == 1 else
                                     " or choose one of those methods" if by else ""))


def unread_settings(cfg: Config) -> list[str]:
    """The method.* settings of `cfg` that differ from their defaults and that its method does not read (a
    config carrying every method's settings, to switch among them with method.name)."""
    keys = method_keys(get_method(cfg.method.name))
    now = dataclasses.asdict(cfg.method)
    changed = config_changes(dataclasses.asdict(MethodConfig()), now)
    return [f"method.{key}" for key, _ in leaves(now) if key in changed and key != "name" and key not in keys]


def unread_note(cfg: Config) -> str | None:
    """One start-up line naming `unread_settings`, or None."""
    unread = unread_settings(cfg)
    if not unread:
        return None
    return f"note: {cfg.method.name} does not read {', '.join(unread)} (set in the config for other methods)"


def get_method(name: str) -> Method:
    name = ALIASES.get(name, name)
    if name not in METHODS:
        raise ConfigError(f"method.name: unknown method {name!r}; methods: {', '.join(METHODS)}")
    return METHODS[name]


def resolve_method(cfg: Config) -> Method:
    """The row of `cfg.method.name`, after the checks that depend on it; raises ConfigError naming the fix."""
    r, t, m = cfg.rollout, cfg.train, cfg.method
    method = get_method(m.name)
    m.name = method.name
    n = cfg.responses_per_step
    if method.schedule == "halves" and (t.epochs_per_rollout != 1 or 2 * t.minibatch_size != n):
        raise ConfigError(
            f"{m.name} takes two optimizer steps per rollout, each on half the completions, in one epoch: "
            f"set train.minibatch_size={n // 2} and train.epochs_per_rollout=1 "
            f"(got {t.minibatch_size} and {t.epochs_per_rollout})"
        )
    if method.step_whiten != "none" and m.adv_whiten != "auto":
        raise ConfigError(f"method {m.name} whitens its step advantages by method.step_adv_scope (batch | group | "
                          f"off); leave method.adv_whiten=auto (got {m.adv_whiten})")
    if method.step_whiten == "none" and m.step_adv_scope != "batch":
        raise ConfigError(f"method.step_adv_scope={m.step_adv_scope} scopes the step advantages of vineppo and caspo; "
                          f"method {m.name} has none (its whitening is method.adv_whiten): leave it batch")
    if m.step_adv_scope == "minibatch" and method.step_whiten != "tokens":
        raise ConfigError(f"method.step_adv_scope=minibatch whitens VinePPO's token advantages in the update, one "
                          f"optimizer minibatch at a time; {m.name} takes batch, group or off")
    if not m.std_normalize and not (method.group_baseline or (method.advantages is adv.terminal
                                                              and m.terminal_scope != "off")):
        raise ConfigError(f"method.std_normalize=false centres group-relative scores (grpo, dppo_tv, dppo_kl) and "
                          f"ppo's batch or group scores; {m.name} with these settings has none: leave it true")
    if t.old_logprobs == "behaviour":
        if method.loss is losses.DECOUPLED:
            raise ConfigError(f"train.old_logprobs=behaviour makes π_old the engine's scores, and {m.name} keeps them "
                              "apart from the proximal policy by design: use auto or recompute")
        if method.loss.full_vocab:
            raise ConfigError(f"train.old_logprobs=behaviour sets π_old, and {m.name}'s loss reads its frozen old "
                              "policy's distributions instead: use auto or recompute")
        if r.top_p < 1.0 or r.top_k > 0:
            raise ConfigError(f"train.old_logprobs=behaviour reads the engine's log-probs, which are of the truncated "
                              f"sampling distribution (rollout.top_p={r.top_p}, top_k={r.top_k}): a ratio to them is "
                              "not π_θ/π_old; sample the full vocabulary, or use auto or recompute")
    if m.dual_clip is not None and method.loss not in (losses.PPO_CLIP, losses.DECOUPLED):
        raise ConfigError(f"method.dual_clip={m.dual_clip} bounds PPO's clipped ratio loss; {m.name}'s loss has no "
                          "such clip: leave it null")
    groups = (method.group_baseline or (method.advantages is adv.terminal and m.terminal_scope == "group")
              or (method.step_whiten != "none" and m.step_adv_scope == "group"))
    if groups and r.samples_per_prompt < 2:
        raise ConfigError(
            f"method {m.name} compares samples within a prompt group: rollout.samples_per_prompt must be >= 2, "
            f"got {r.samples_per_prompt}"
        )
    if method.state is PrefixValues and not m.caspo.value_model and not m.caspo.refresh_every:
        raise ConfigError(f"method {m.name} needs method.caspo.value_model=PATH (a folder from `caspo value train`), "
                          "or method.caspo.refresh_every=N to train the first one before step 1")
    balanced = [k for k in ("use_adb", "use_dlw") if getattr(m.caspo, k)]
    if balanced and not (method.state is PrefixValues and m.caspo.online and r.samples_per_prompt >= 2):
        raise ConfigError(f"method.caspo.{'/'.join(balanced)} balance CASPO's online value update over prompt "
                          "groups: they need method.name=caspo, method.caspo.online=true and "
                          f"rollout.samples_per_prompt >= 2 (got {m.name}, online={str(m.caspo.online).lower()}, "
                          f"{r.samples_per_prompt}); or leave them false")
    if cfg.reward.synthetic and (method.state is MonteCarloValues or m.caspo.refresh_every):
        raise ConfigError(f"reward.synthetic scores the training batch only, but {m.name}'s Monte Carlo "
                          f"{'values' if method.state is MonteCarloValues else 'refresh labels'} use the verifier: "
                          "set reward.synthetic=false")
    if m.caspo.refresh_every and method.state is not PrefixValues:
        raise ConfigError(f"method.caspo.refresh_every refreshes CASPO's prefix value model; it needs "
                          f"method.name=caspo, got {m.name}")
    return method
