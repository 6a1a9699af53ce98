"""The run configuration's schema: one dataclass per section, with the defaults.

A field's type is what loading checks (`caspo.config.load`): `int`, `float`, `bool`, `str`,
`Optional[...]`, `list[...]`, a nested section, or a `Literal[...]` of its choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from caspo.config.train_schema import TrainConfig


class ConfigError(ValueError):
    """A configuration problem, with the key path and the fix in the message."""


# How a per-token loss reduces to a scalar: the modes of `caspo.algo.stats.AGG_MODES` (a test
# checks they agree; the config layer imports nothing else from caspo).
LossAgg = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@dataclass
class ModelConfig:
    # Policy checkpoint: an HF folder, a hub id, or "embedded:<name>" for one that ships with caspo.
    policy: str = "embedded:tiny-arith"
    # The hub commit the policy's files must come from (null = not pinned): a hub id loads that commit's
    # snapshot, a folder must record it (hf download --revision, caspo convert); caspo.models.hub.
    revision: Optional[str] = None
    # Where training runs: "cpu", "cuda", "cuda:1", ... ("auto" = cuda when available).
    device: str = "cpu"
    # CPU threads for torch (0 = leave torch's default).
    threads: int = 2
    # The most this process may allocate on its CUDA device, in GiB (0 = the whole card): the run then
    # behaves as on a card of that size (the allocator frees its cache and retries at the cap, then fails),
    # and rollout.gpu_memory_fraction is a share of the cap. E.g. 76 on a 141 GB card checks an 80 GB fit.
    device_memory_gib: float = 0.0


@dataclass
class ArithConfig:
    seed: int = 1234
    min_ops: int = 2
    max_ops: int = 5
    max_start: int = 50
    max_addend: int = 30
    mul_factors: list[int] = field(default_factory=lambda: [2, 3])
    max_value: int = 200
    # Problems in the task's held-out split (eval.heldout_size of them are evaluated).
    heldout_pool_size: int = 1000
    train_size: int = 20_000


@dataclass
class DataConfig:
    # "arith" (the procedural task), a shipped benchmark (dsr_sub, math500, gsm8k, olympiadbench, math),
    # a .jsonl / .parquet file, a `datasets` folder, or hf:NAME[:CONFIG][@SPLIT] (caspo.data.rows).
    source: str = "arith"
    # Held-out prompts, in the same forms. A source other than arith needs this or heldout_fraction
    # when the run evaluates; arith uses its own held-out split.
    eval_source: Optional[str] = None
    # Hold out this fraction of the source's distinct prompts (by a hash of split_seed and the prompt).
    heldout_fraction: float = 0.0
    split_seed: int = 0
    # Training examples used (0 = all).
    train_size: int = 0
    query_field: str = "problem"
    label_field: str = "answer"  # boxed:FIELD: the content of the last \boxed{} of FIELD (a worked solution)
    id_field: Optional[str] = None  # None: ids are <file stem>-<line>; dotted paths reach nested fields
    # Skip invalid rows (empty query or answer, a label the verifier rejects, a duplicate id) instead of
    # failing; they are counted and named either way.
    skip_invalid: bool = False
    # A name from caspo.data.templates.TEMPLATES, "chat" (the tokenizer's chat template), or a literal
    # template text containing {query}.
    template: str = "arith"
    # Prefix BOS to prompts: "auto" = as the tokenizer does (Llama's add one, Qwen's none); never twice.
    add_bos: Literal["auto", True, False] = "auto"
    max_prompt_tokens: int = 256
    # A prompt over max_prompt_tokens: "error", "skip" (left out, counted and named), or "truncate_left"; the same
    # for a benchmark's problems (a skipped one is not in its n, and its JSON's data.skipped_long counts it)
    long_prompts: Literal["error", "skip", "truncate_left"] = "error"
    arith: ArithConfig = field(default_factory=ArithConfig)


@dataclass
class RolloutConfig:
    # "hf": transformers models (any architecture); "native": caspo's engine (Qwen2/Llama families, looped LMs)
    backend: Literal["hf", "native"] = "hf"
    # native engine: KV cache size in tokens on any device, or (capacity_tokens 0) its share of
    # device memory on CUDA (of model.device_memory_gib where that caps it) / one step's requests on the CPU
    gpu_memory_fraction: float = 0.3
    capacity_tokens: int = 0
    cuda_graphs: bool = False
    # native engine on CUDA: sequences holding one prompt's K/V (a Monte Carlo prefix's K continuations, a
    # prompt's samples) read it once per decode step instead of once each, in the steps where that pays
    shared_prefix_attention: bool = False
    prompts_per_step: int = 32
    samples_per_prompt: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # Stop strings: a response ends on the token whose text completes one (vLLM's rule; the token is kept whole)
    stop: list[str] = field(default_factory=list)
    # Sequences decoded together; 0 = all requests of a step at once.
    max_batch: int = 0
    # native engine: waiting requests are admitted once this many slots are free (or all of them fit, or nothing
    # runs), one prefill round per batch of finished sequences; 0 = an eighth of the running slots, at most 64
    admit_batch: int = 0
    # Generate with the policy of `staleness` updates ago, as asynchronous RL does (0 = on-policy).
    staleness: int = 0
    # Put the engine to sleep (KV cache, CUDA graphs and its copy of the weights freed) while the trainer
    # updates, so the update has that memory; it wakes for the next rollout (the native engine
    # re-allocates and recaptures), and the publication after the update refills the weights.
    sleep_during_update: bool = True
    # The engine's compute dtype; "auto" = the training precision's compute dtype.
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"


@dataclass
class RewardConfig:
    # The verifier's limits and rules: docs/reliability.md, "Verifier" (caspo.reward.pool, a test checks
    # these defaults agree with the pool's).
    workers: int = 2
    timeout_s: float = 5.0  # per call; a worker still busy 1 s later is killed and replaced
    # Each worker's address-space limit in MB: null = 2048 where the platform can limit it, 0 = none.
    worker_memory_mb: Optional[int] = None
    # Replace a worker after this many calls, or when its resident set passes recycle_rss_mb (0 = never).
    recycle_after: int = 1000
    recycle_rss_mb: int = 512
    # Time budget of one batch of rewards: calls unfinished when it runs out score 0 (0 = none).
    batch_budget_s: float = 300.0
    # The final answer: the last \boxed{} ("boxed") or what follows the last "final answer is" ("minerva").
    extractor: Literal["boxed", "minerva"] = "boxed"
    # When the extractor finds no candidate at all: "none" scores 0, "last_number" takes the text's last
    # number (for tasks whose answers are bare numbers; never for math benchmarks).
    fallback: Literal["none", "last_number"] = "none"
    # Answers longer than this score 0 before math-verify sees them (with the pre-filter's other rules).
    max_answer_chars: int = 300
    # Control experiments: shuffle rewards within each batch before advantages.
    shuffle_within_batch: bool = False
    # Timing runs only (random-init models): reward 1 when the response's token ids sum to an
    # even number, instead of the verifier, so that advantages are non-zero.
    synthetic: bool = False


@dataclass
class CaspoConfig:
    # the prefix value model folder (from `caspo value train`)
    value_model: str = ""
    transform: Literal["value", "prob", "logprob"] = "prob"
    # online: one optimizer step of the value model per batch on BCE(σ(V(s_k)/β), R): optim.name's optimizer
    # (AdamW by default), with the critic's weight decay and gradient clip (method.critic_weight_decay, _grad_clip)
    online: bool = False
    online_value_lr: float = 1e-6
    # IPVRM's balancing of the online update (arXiv 2604.13197 Eq. 15, caspo.algo.ipvrm), over each prompt's
    # group of samples: use_adb adds logit(μ(x)), the prompt's mean reward, to the BCE's logits; use_dlw
    # weighs a correct sample 1 − μ(x), a wrong one μ(x). The seed's online config sets both true.
    use_adb: bool = False
    use_dlw: bool = False
    # periodic refresh (caspo.value.refresh): every refresh_every steps (0 = never), checkpoint, label
    # prefixes of the current policy by Monte Carlo, train a fresh value model on them, resume with it.
    # The sizes are small enough for the `tests` preset; a real run wants phase 1's (`caspo value collect`).
    refresh_every: int = 0
    refresh_prompts: int = 64  # training prompts labelled (the first ones of the split)
    refresh_k: int = 4  # base rollouts per prompt
    refresh_j: int = 4  # continuations per labelled prefix
    refresh_boundaries: int = 2  # labelled step boundaries per rollout
    refresh_state_temperature: float = 0.0  # base rollouts' temperature (0: the run's; labels keep the run's)
    refresh_lr: float = 3e-4  # value training: AdamW learning rate (1.5B full fine-tunes want ~5e-6)
    refresh_epochs: int = 2
    refresh_batch_size: int = 16  # rollouts per value-model optimizer step
    refresh_val_fraction: float = 0.25  # prompts held out to pick the best checkpoint by Spearman ρ
    # the seed's phase-1 modes: label every rollout of a mixed-outcome prompt ("all"), one right/wrong pair
    # per prompt ("paper", PAPER_PAIRING) or min(n_right, n_wrong) disjoint pairs ("paper_multi", PAPER_PAIRING_MULTI)
    refresh_pairing: Literal["all", "paper", "paper_multi"] = "all"
    # drop labelled prefixes longer than this many response tokens from value training (the seed's
    # max_train_prefix_len; 0 = keep all, the seed's default: match the collection cap)
    refresh_max_train_prefix_len: int = 0
    # clip whitened step advantages at ±step_adv_clip σ (0 = off)
    step_adv_clip: float = 3.0
    allow_provenance_mismatch: bool = False
    # the control: the value model's step values shuffled over all valid steps of each batch
    shuffle_values: bool = False


@dataclass
class MethodConfig:
    # A row of the method table, caspo.methods (which checks the name and its aliases).
    name: str = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    # drop (multiply by 0) a micro-batch's policy and KL terms when its mean ratio π/π_old over its response
    # tokens exceeds this: upstream VinePPO's ratio_threshold (10 by default there); null = off
    ratio_skip: Optional[float] = None
    # how token losses are summed (caspo.algo.aggregate); seq-mean-token-sum-norm (Dr. GRPO) divides by
    # rows × rollout.max_new_tokens
    loss_agg: LossAgg = "token-mean"
    # group advantages (grpo, dppo_tv, dppo_kl; ppo's batch or group scope): divide by the std (false = Dr. GRPO's
    # s - mean); refused where nothing reads it
    std_normalize: bool = True
    # ppo (terminal reward): standardise over "batch", "group", or "off"
    terminal_scope: Literal["batch", "group", "off"] = "batch"
    # advantage whitening over all valid tokens; "auto" = batch for GAE methods, none otherwise; "minibatch": over
    # each optimizer minibatch's tokens as the update reads it (upstream VinePPO's PPO baseline), then clipped
    adv_whiten: Literal["auto", "none", "batch", "minibatch"] = "auto"
    # clip advantages at ±adv_clip σ; 0 = off. σ = 1 for advantages in σ units (whitened, or scores divided by their
    # group's or batch's std: grpo, dppo_tv/_kl, ppo's scopes), else the batch's std
    adv_clip: float = 0.0
    # KL to the reference: a loss term (kl_coef × kl_estimator) and/or k1 folded into the reward: per token for
    # the GAE methods, per step for vineppo and caspo (each step its own tokens' penalties), and summed over the
    # response into the one sequence advantage of grpo, ppo and dppo_tv/_kl
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3", "abs"] = "k3"
    # how the KL loss term sums its tokens; null = loss_agg (verl's). Upstream VinePPO sums each response's tokens
    # and averages over responses (seq-mean-token-sum): at the same kl_coef, a response of L tokens is anchored
    # L times as strongly as under token-mean
    kl_loss_agg: Optional[LossAgg] = None
    kl_reward_coef: float = 0.0
    # GAE and the critic
    gamma: float = 1.0
    lam: float = 1.0
    # the critic's own settings for optim.name's optimizer (AdamW by default; SGD in the looped recipe, as
    # upstream's one optimizer over actor and critic); optim.* holds the policy's. The seed's PPO+critic recipe:
    # critic_lr=1e-6 (= policy lr, matches VinePPO), critic_weight_decay=0.0, critic_grad_clip=1.0
    critic_lr: float = 1e-6
    critic_weight_decay: float = 0.0
    critic_grad_clip: float = 1.0
    value_clip: float = 0.2
    # decoupled PPO: bounds of the behaviour importance weight π_prox/μ
    iw_low: float = 0.5
    iw_high: float = 2.0
    # flow_dppo: gate threshold on KL(old‖new) over the vocabulary
    gate_threshold: float = 0.01
    # step-level methods (vineppo, caspo): how responses split into steps
    step_splitter: Literal["auto", "newline", "latex"] = "auto"  # auto: newline for arith, latex otherwise
    max_steps: int = 0  # 0 = no cap
    after_final_box: Literal["keep", "merge"] = "keep"
    vineppo_k: int = 9  # Monte Carlo continuations per step boundary
    # vineppo: a continuation's token budget. 0: what the response had left (rollout.max_new_tokens − prefix),
    # so it ends where the sampled response would have been cut. N > 0: upstream VinePPO's
    # min(rollout.max_new_tokens, N − prompt − prefix), N its model context (2048 for Rho-1B)
    vineppo_context_tokens: int = 0
    # vineppo / caspo: step advantages standardised over the "batch" (the seed's standardize_advantage_scope:
    # batch), within each prompt's "group" of samples, or "off"; vineppo over tokens, caspo over valid steps.
    # vineppo also takes "minibatch": each optimizer minibatch's tokens, in the update (upstream VinePPO's trainer)
    step_adv_scope: Literal["batch", "group", "off", "minibatch"] = "batch"
    caspo: CaspoConfig = field(default_factory=CaspoConfig)
    # dppo_tv / dppo_kl: the trust region's δ for moves down (A ≤ 0) and up (A > 0); null: the paper's default
    # for the method's divergence, 0.15 for dppo_tv and 0.05 for dppo_kl (caspo.algo.losses.DPPO_DELTA)
    dppo_delta_low: Optional[float] = None
    dppo_delta_high: Optional[float] = None
    # the loss's sg(min(r, C)) with r = π/π_old, the trainer's recomputed π_old (Stable-RL's `_recompute` variants,
    # C = 10; verl anchors on π_old too, with C = 20)
    dppo_ratio_cap: float = 10.0


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-4
    momentum: float = 0.0  # sgd only
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    # warmup as a fraction of the run's optimizer updates, ceil(ratio × updates) (VinePPO's 0.03); or warmup_steps
    warmup_ratio: float = 0.0
    # the warmup's rise: linear, (k + 1) / W at update k; or log, DeepSpeed WarmupDecayLR's default (upstream
    # VinePPO's trainer sets no warmup_type): log(k + 1) / log(W), so the first update's rate is 0 (DeepSpeed's
    # engine applies iteration k's rate one update later, after a first update at its minimum, 0)
    warmup_shape: Literal["linear", "log"] = "linear"
    schedule: Literal["constant", "linear", "cosine"] = "constant"


@dataclass
class EvalConfig:
    # Held-out problems evaluated: the first ones of the held-out split (data.arith.heldout_pool_size
    # of the arithmetic task, or data.eval_source).
    heldout_size: int = 500
    max_new_tokens: int = 96
    # > 0: also this many samples per problem: avg@k, and for benchmarks pass@k (k <= samples) and maj@k
    samples: int = 0
    # The samples' sampler: null = the run's (rollout.temperature, rollout.top_p); rollout.top_k always.
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    # Benchmarks (caspo.data.registry names, arith, heldout, or data files) that `caspo eval` runs by
    # default and a run evaluates at its checkpoints; their first `limit` problems (0 = all).
    benchmarks: list[str] = field(default_factory=list)
    limit: int = 0
    every: int = 0
    before: bool = True
    after: bool = True


@dataclass
class SftConfig:
    # The tiny policy built from scratch: a Qwen2 causal LM, or a looped LM in either layout.
    architecture: Literal["qwen2", "looped-ouro", "looped-nanbeige"] = "qwen2"
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    intermediate: int = 256
    depth: int = 4  # loops of a looped architecture
    steps: int = 1200
    batch_size: int = 32
    lr: float = 2e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    skip_last_prob: float = 0.5
    # "any", or "last_op_" + operation names (add, sub, mul) joined by "_": a small grammar that
    # caspo.data.tasks.arith.ArithSpec checks, so a str
    skip_last_when: str = "any"
    slip_prob: float = 0.0
    seed: int = 0
    eval_every: int = 200
    # Sequences decoded together in the held-out evaluation every eval_every steps.
    eval_batch_size: int = 250


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SftConfig = field(default_factory=SftConfig)

    @property
    def responses_per_step(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.samples_per_prompt
