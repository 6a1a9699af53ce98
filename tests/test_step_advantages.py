"""From rewards and values to token advantages, by hand: step_adv_scope (vineppo, caspo), the ±k σ clips
(method.caspo.step_adv_clip, method.adv_clip) and the KL folded into the reward (method.kl_reward_coef)."""

import dataclasses
import math

import pytest
import torch

from caspo.batch import RolloutBatch
from caspo.config import ConfigError, load_config
from caspo.methods import get_method, resolve_method
from caspo.train.advantages import compute_advantages, token_rewards


def make_batch(mask, group_ids, rewards, step_ids=None, step_values=None, old=None, ref=None) -> RolloutBatch:
    mask = torch.tensor(mask, dtype=torch.float32)
    B, R = mask.shape
    batch = RolloutBatch(
        input_ids=torch.zeros(B, R + 1, dtype=torch.long), attention_mask=torch.ones(B, R + 1, dtype=torch.long),
        position_ids=torch.arange(R + 1).expand(B, -1), prompt_width=1, responses=torch.zeros(B, R, dtype=torch.long),
        response_mask=mask, behaviour_logprobs=torch.zeros(B, R), group_ids=torch.tensor(group_ids),
        finished=torch.ones(B, dtype=torch.bool), example_ids=[str(g) for g in group_ids], sample_seeds=[0] * B,
        policy_versions=[0] * B, finish_reasons=["stop"] * B, texts=[""] * B,
        rewards=torch.tensor(rewards, dtype=torch.float32))
    if step_ids is not None:
        batch.step_ids = torch.tensor(step_ids)
        batch.step_values = torch.tensor(step_values, dtype=torch.float32)
        batch.step_mask = torch.ones_like(batch.step_values)
    batch.old_logprobs = torch.tensor(old) if old is not None else torch.zeros(B, R)
    batch.ref_logprobs = torch.tensor(ref) if ref is not None else torch.zeros(B, R)
    return batch


def advantages(batch, method, *overrides):
    cfg = load_config("tests", [f"method.name={method}", "method.caspo.value_model=unused", *overrides])
    resolve_method(cfg)
    return compute_advantages(batch, cfg, get_method(method))[0]


# Two prompts × two samples, two steps each. V(s_0), V(s_1) and the outcome R per row; step TD (γ = 1):
#   A_0 = V(s_1) − V(s_0),  A_1 = R − V(s_1)
#   row 0: .8 − .5 = .3,    1 − .8 = .2          group 0
#   row 1: .2 − .5 = −.3,   0 − .2 = −.2         group 0
#   row 2: .6 − .4 = .2,    1 − .6 = .4          group 1
#   row 3: .1 − .4 = −.3,   0 − .1 = −.1         group 1
MASK = [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
STEP_IDS = [[0, 0, 1, 1], [0, 1, 1, -1], [0, 1, -1, -1], [0, 0, 0, 1]]
VALUES = [[0.5, 0.8], [0.5, 0.2], [0.4, 0.6], [0.4, 0.1]]
STEP_TD = [[0.3, 0.2], [-0.3, -0.2], [0.2, 0.4], [-0.3, -0.1]]


def steps_batch():
    return make_batch(MASK, [0, 0, 1, 1], [1.0, 0.0, 1.0, 0.0], STEP_IDS, VALUES)


def tokens_of(step_adv):
    """Each token takes its step's advantage (0 on padding)."""
    return torch.tensor([[step_adv[b][k] if k >= 0 else 0.0 for k in row] for b, row in enumerate(STEP_IDS)])


# ---------------------------------------------------------------- caspo: each valid step once


def caspo(scope, clip=0.0):
    batch = steps_batch()
    adv = advantages(batch, "caspo", f"method.step_adv_scope={scope}", f"method.caspo.step_adv_clip={clip}")
    return batch.step_advantages, adv


def test_caspo_steps_whitened_over_the_batch_by_hand():
    # the eight steps: sum .2, mean .025; Σd² = .555, var = .555/7
    s = math.sqrt(0.555 / 7 + 1e-8)
    expected = [[(a - 0.025) / s for a in row] for row in STEP_TD]
    step_adv, adv = caspo("batch")
    torch.testing.assert_close(step_adv, torch.tensor(expected))
    torch.testing.assert_close(adv, tokens_of(expected))


def test_caspo_steps_whitened_within_each_group_by_hand():
    # group 0: .3 .2 −.3 −.2, mean 0, Σd² = .26;   group 1: .2 .4 −.3 −.1, mean .05, Σd² = .29
    s0, s1 = math.sqrt(0.26 / 3 + 1e-8), math.sqrt(0.29 / 3 + 1e-8)
    expected = [[a / s0 for a in STEP_TD[0]], [a / s0 for a in STEP_TD[1]],
                [(a - 0.05) / s1 for a in STEP_TD[2]], [(a - 0.05) / s1 for a in STEP_TD[3]]]
    step_adv, adv = caspo("group")
    torch.testing.assert_close(step_adv, torch.tensor(expected))
    torch.testing.assert_close(adv, tokens_of(expected))


def test_caspo_steps_off_are_the_raw_step_td():
    step_adv, adv = caspo("off")
    torch.testing.assert_close(step_adv, torch.tensor(STEP_TD))
    torch.testing.assert_close(adv, tokens_of(STEP_TD))


def test_caspo_step_clip_in_sigma_units():
    # batch: z = (A − .025)/.28158; only .4 (z = 1.332) passes 1 σ  -> 1
    step_adv, _ = caspo("batch", clip=1.0)
    s = math.sqrt(0.555 / 7 + 1e-8)
    expected = [[min(max((a - 0.025) / s, -1.0), 1.0) for a in row] for row in STEP_TD]
    assert expected[2][1] == 1.0
    torch.testing.assert_close(step_adv, torch.tensor(expected))
    # off: σ is the raw steps' std, .28158: ±.3 and .4 are cut to ±σ
    step_adv, _ = caspo("off", clip=1.0)
    expected = [[min(max(a, -s), s) for a in row] for row in STEP_TD]
    torch.testing.assert_close(step_adv, torch.tensor(expected))


def test_caspo_default_clip_is_three_sigma_after_whitening():
    # sixteen one-step responses, V(s_0) = 0, so A = R: one outlier 10 among fifteen 0s
    # mean .625; Σd² = 9.375² + 15·.625² = 93.75, var = 6.25, σ = 2.5: z = 3.75 -> 3, the rest −.25
    n = 16
    batch = make_batch([[1.0]] * n, list(range(n // 2)) * 2, [10.0] + [0.0] * (n - 1), [[0]] * n, [[0.0]] * n)
    cfg = load_config("tests", ["method.name=caspo", "method.caspo.value_model=unused"])
    assert cfg.method.caspo.step_adv_clip == 3.0 and cfg.method.step_adv_scope == "batch"
    compute_advantages(batch, cfg, get_method("caspo"))
    expected = torch.tensor([[3.0]] + [[-0.625 / math.sqrt(6.25 + 1e-8)]] * (n - 1))
    torch.testing.assert_close(batch.step_advantages, expected)
    batch = make_batch([[1.0]] * n, list(range(n // 2)) * 2, [10.0] + [0.0] * (n - 1), [[0]] * n, [[0.0]] * n)
    advantages(batch, "caspo", "method.caspo.step_adv_clip=0")
    assert batch.step_advantages[0, 0].item() == pytest.approx(9.375 / 2.5)  # off: the outlier keeps 3.75


def test_caspo_adv_clip_is_in_the_units_of_its_whitened_steps():
    # two responses of 101 tokens: one short step of ±2.5 (after the step whitening) and 100 tokens of 0. The token
    # σ of such advantages is about .25, so a clip at ±3 token σ would cut ±2.5 to ±.75; in the units the steps were
    # whitened in, ±2.5 is inside ±3 and stays.
    step_ids = [[0] + [1] * 100, [0] + [1] * 100]
    batch = make_batch([[1] * 101] * 2, [0, 0], [0.0, 0.0], step_ids, [[0.0, 0.0], [0.0, 0.0]])
    raw = torch.tensor([[2.5, 0.0], [-2.5, 0.0]])
    cfg = load_config("tests", ["method.name=caspo", "method.caspo.value_model=unused", "method.adv_clip=3.0"])
    resolve_method(cfg)
    # the row with its step advantages already whitened, as prefix_step_td leaves them
    method = dataclasses.replace(get_method("caspo"), advantages=lambda b, r, m: (tokens_from(step_ids, raw), None))
    adv = compute_advantages(batch, cfg, method)[0]
    torch.testing.assert_close(adv[:, 0], torch.tensor([2.5, -2.5]))
    cfg.method.adv_clip = 2.0  # a tighter clip still acts, at ±2
    adv = compute_advantages(batch, cfg, method)[0]
    torch.testing.assert_close(adv[:, 0], torch.tensor([2.0, -2.0]))


def tokens_from(step_ids, step_adv):
    return step_adv.gather(1, torch.tensor(step_ids))


# ---------------------------------------------------------------- vineppo: each response token once


def token_whitened(values_by_token, mask, rows):
    """(x − mean)/sqrt(var + 1e-8) over the valid tokens of `rows`, var unbiased: a hand reference."""
    entries = [values_by_token[b][t] for b in rows for t in range(len(mask[b])) if mask[b][t]]
    mean = sum(entries) / len(entries)
    var = sum((e - mean) ** 2 for e in entries) / (len(entries) - 1)
    return {b: [(values_by_token[b][t] - mean) / math.sqrt(var + 1e-8) if mask[b][t] else 0.0
                for t in range(len(mask[b]))] for b in rows}


@pytest.mark.parametrize("scope", ["batch", "group", "off"])
def test_vineppo_tokens_whitened_over_the_scope(scope):
    raw = tokens_of(STEP_TD).tolist()
    if scope == "batch":
        by_row = token_whitened(raw, MASK, [0, 1, 2, 3])
    elif scope == "group":
        by_row = {**token_whitened(raw, MASK, [0, 1]), **token_whitened(raw, MASK, [2, 3])}
    else:
        by_row = dict(enumerate(raw))
    expected = torch.tensor([by_row[b] for b in range(4)])
    adv = advantages(steps_batch(), "vineppo", f"method.step_adv_scope={scope}")
    torch.testing.assert_close(adv, expected)


def test_vineppo_batch_scope_is_the_token_whitening_it_always_had():
    from caspo import algo

    batch = steps_batch()
    cfg = load_config("tests", ["method.name=vineppo"])
    raw, _ = get_method("vineppo").advantages(batch, token_rewards(batch, cfg), cfg.method)
    adv = compute_advantages(batch, cfg, get_method("vineppo"))[0]
    torch.testing.assert_close(adv, algo.masked_whiten(raw, batch.response_mask), rtol=0, atol=0)  # bit for bit


# ---------------------------------------------------------------- method.adv_clip on tokens


def test_adv_clip_on_whitened_and_raw_token_advantages():
    # ppo, terminal scope off: A_i = R_i on each token; tokens 2, 2, 2, −1, −1, 0 (rows of 3, 2 and 1 tokens)
    batch = make_batch([[1, 1, 1], [1, 1, 0], [1, 0, 0]], [0, 1, 2], [2.0, -1.0, 0.0])
    adv = advantages(batch, "ppo", "method.terminal_scope=off", "method.adv_clip=1.0")
    # σ of the raw tokens: mean 2/3, Σd² = 3·(4/3)² + 2·(5/3)² + (2/3)² = 34/3, var = 34/15: only 2 passes σ
    sigma = math.sqrt(34 / 15)
    torch.testing.assert_close(adv, torch.tensor([[sigma] * 3, [-1.0, -1.0, 0.0], [0.0, 0.0, 0.0]]))
    # ppo_critic whitens its tokens (batch): the clip is at ±1 itself. V = 0, γ = λ = 1: A_t = R on every token
    batch = make_batch([[1, 1, 1], [1, 1, 0], [1, 0, 0]], [0, 1, 2], [2.0, -1.0, 0.0])
    batch.values = torch.zeros(3, 3)
    adv = advantages(batch, "ppo_critic", "method.adv_clip=1.0")
    z = [(x - 2 / 3) / math.sqrt(34 / 15 + 1e-8) for x in (2.0, -1.0, 0.0)]  # .8856, −1.1070 -> −1, −.4428
    torch.testing.assert_close(adv, torch.tensor([[z[0]] * 3, [-1.0, -1.0, 0.0], [z[2], 0.0, 0.0]]))


def test_adv_clip_on_group_normalised_scores_is_in_their_own_sigma_units():
    """grpo's scores are each group's standardised ones: ±adv_clip σ is ±adv_clip itself, not the batch's pooled std,
    which groups whose samples all score alike pull below 1 (here 0.52: a clip at ±1.2 would cut the lone success
    from 1.5 to 0.63). Dr. GRPO's centred scores keep the batch's std."""
    mask = [[1]] * 12
    groups = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    rewards = [1.0, 0.0, 0.0, 0.0] + [0.0] * 8  # one success of 4: mean 1/4, unbiased std 1/2
    adv = advantages(make_batch(mask, groups, rewards), "grpo", "method.adv_clip=1.2")[:, 0]
    lone = 0.75 / (0.5 + 1e-6)  # 1.5, above the clip
    assert lone > 1.2
    torch.testing.assert_close(adv, torch.tensor([1.2] + [-0.25 / (0.5 + 1e-6)] * 3 + [0.0] * 8))
    # Dr. GRPO: 0.75, −0.25 ×3, zeros; pooled std over 12 tokens: sqrt((0.5625 + 3·0.0625)/11) = 0.2611
    adv = advantages(make_batch(mask, groups, rewards), "grpo", "method.std_normalize=false", "method.adv_clip=1.2")
    sigma = math.sqrt(0.75 / 11)
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.2 * sigma] + [-0.25] * 3 + [0.0] * 8))


# ---------------------------------------------------------------- method.kl_reward_coef


OLD = [[-1.0, -2.0, -0.5], [-0.2, -0.4, 0.0]]
REF = [[-1.5, -1.0, -0.5], [-0.3, -0.1, 0.0]]


def test_kl_folded_into_the_token_rewards_by_hand():
    # k1 = log π_old − log π_ref:  row 0: .5, −1, 0;  row 1 (2 tokens): .1, −.3
    batch = make_batch([[1, 1, 1], [1, 1, 0]], [0, 0], [1.0, 0.0], old=OLD, ref=REF)
    cfg = load_config("tests", ["method.kl_reward_coef=0.1"])
    expected = torch.tensor([[-0.05, 0.1, 1.0], [-0.01, 0.03, 0.0]])  # −β·k1, the score on the last token
    torch.testing.assert_close(token_rewards(batch, cfg), expected)
    cfg = load_config("tests", ["method.kl_reward_coef=0"])
    torch.testing.assert_close(token_rewards(batch, cfg), torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))


def test_kl_reward_reaches_the_sequence_score_and_gae():
    # sequence scores R − β Σ k1: row 0: 1 − .1·(−.5) = 1.05;  row 1: 0 − .1·(−.2) = .02
    batch = make_batch([[1, 1, 1], [1, 1, 0]], [0, 0], [1.0, 0.0], old=OLD, ref=REF)
    adv = advantages(batch, "ppo", "method.terminal_scope=off", "method.kl_reward_coef=0.1")
    torch.testing.assert_close(adv, torch.tensor([[1.05] * 3, [0.02, 0.02, 0.0]]))
    # grpo: one group {1.05, .02}: d = ±.515, std = .515·√2
    adv = advantages(batch, "grpo", "method.kl_reward_coef=0.1")
    a = 0.515 / (0.515 * math.sqrt(2) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([[a] * 3, [-a, -a, 0.0]]))
    # GAE (γ = λ = 1, V = 0, no whitening): reward-to-go of the token rewards
    batch.values = torch.zeros(2, 3)
    cfg = load_config("tests", ["method.name=ppo_critic", "method.adv_whiten=none", "method.kl_reward_coef=0.1"])
    adv, returns = compute_advantages(batch, cfg, get_method("ppo_critic"))
    expected = torch.tensor([[1.05, 1.1, 1.0], [0.02, 0.03, 0.0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns, expected)


def test_kl_reward_is_charged_to_the_step_that_paid_it():
    # token rewards (above): row 0: −.05, .1, 1.0 over steps 0, 1, 1;  row 1: −.01, .03 in its one step
    # step rewards: row 0: r_0 = −.05, r_1 = 1.1;  row 1: r_0 = .02
    # step TD (γ = 1, V(s_n) = 0): row 0: −.05 + .8 − .5 = .25, 1.1 − .8 = .3;  row 1: .02 − .5 = −.48
    for method in ("vineppo", "caspo"):
        batch = make_batch([[1, 1, 1], [1, 1, 0]], [0, 0], [1.0, 0.0], step_ids=[[0, 1, 1], [0, 0, -1]],
                           step_values=[[0.5, 0.8], [0.5, 0.0]], old=OLD, ref=REF)
        batch.step_mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
        adv = advantages(batch, method, "method.step_adv_scope=off", "method.caspo.step_adv_clip=0",
                         "method.kl_reward_coef=0.1")
        mask = batch.step_mask.bool()
        torch.testing.assert_close(batch.step_advantages[mask], torch.tensor([0.25, 0.3, -0.48]))
        torch.testing.assert_close(adv, torch.tensor([[0.25, 0.3, 0.3], [-0.48, -0.48, 0.0]]))


# ---------------------------------------------------------------- the checks of resolve_method


def test_step_adv_scope_is_checked_against_the_method():
    base = ["method.caspo.value_model=unused"]
    with pytest.raises(ConfigError, match="step_adv_scope=group scopes the step advantages of vineppo and caspo"):
        resolve_method(load_config("tests", ["method.name=grpo", "method.step_adv_scope=group"]))
    with pytest.raises(ConfigError, match="leave method.adv_whiten=auto"):
        resolve_method(load_config("tests", [*base, "method.name=caspo", "method.adv_whiten=batch"]))
    with pytest.raises(ConfigError, match="samples_per_prompt must be >= 2"):
        resolve_method(load_config("tests", ["method.name=vineppo", "method.step_adv_scope=group",
                                             "rollout.samples_per_prompt=1", "train.minibatch_size=4"]))
    with pytest.raises(ConfigError, match=r"expected one of \['batch', 'group', 'off', 'minibatch'\]"):
        load_config("tests", ["method.step_adv_scope=prompt"])
    assert load_config("tests", ["method.step_adv_scope=off"]).method.step_adv_scope == "off"  # YAML's off


def test_std_normalize_is_honoured_by_ppo_and_refused_where_nothing_reads_it():
    batch = make_batch([[1, 1], [1, 0], [1, 1], [1, 0]], [0, 0, 1, 1], [3.0, 0.0, 0.0, 1.0])
    adv = advantages(batch, "ppo", "method.terminal_scope=group", "method.std_normalize=false")
    torch.testing.assert_close(adv, torch.tensor([[1.5, 1.5], [-1.5, 0.0], [-0.5, -0.5], [0.5, 0.0]]))
    for method, extra in [("ppo_critic", []), ("vineppo", []), ("ppo", ["method.terminal_scope=off"])]:
        with pytest.raises(ConfigError, match="method.std_normalize=false centres group-relative scores"):
            resolve_method(load_config("tests", [f"method.name={method}", "method.std_normalize=false", *extra]))
    resolve_method(load_config("tests", ["method.name=dppo_tv", "method.std_normalize=false"]))  # read: accepted
