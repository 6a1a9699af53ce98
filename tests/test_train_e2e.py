import json
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from caspo.config import load_config
from caspo.data.build import load_task_data
from caspo.eval.heldout import EVAL_RUN_SEED, EVAL_SEED_STEP
from caspo.methods import get_method
from caspo.models.policy import load_policy, resolve_model_path
from caspo.models.tokenizer import load_tokenizer
from caspo.reward import score
from caspo.rollout.hf import cache_kwarg
from caspo.rollout.sampling import sample_seed, uniform_noise
from caspo.train import loop
from caspo.train.advantages import compute_advantages

pytestmark = pytest.mark.timeout(240)


@torch.no_grad()
def accuracy_by_hand(policy: str, cfg, samples: int = 0) -> float:
    """The held-out accuracy of `policy`, decoded by a plain loop over its forward (not the run's engine) and
    scored by the verifier: greedy, or with `samples` the Gumbel-max trick at temperature 1 (token t of sample s
    of problem i is argmax(logits + G), G = -log(-log(U)) for the uniform noise U of seed
    sample_seed(EVAL_RUN_SEED, EVAL_SEED_STEP, i, s) at t). A response that does not stop within
    eval.max_new_tokens scores 0."""
    model = load_policy(policy).eval()
    tokenizer = load_tokenizer(resolve_model_path(policy))
    data = load_task_data(cfg, tokenizer)
    stops = {model.generation_config.eos_token_id, tokenizer.eos_token_id} - {None}
    copies = max(samples, 1)
    prompts = [p for p in data.eval_prompts for _ in range(copies)]
    labels = [e.label for e in data.eval for _ in range(copies)]
    seeds = torch.tensor([sample_seed(EVAL_RUN_SEED, EVAL_SEED_STEP, i, s)
                          for i in range(len(data.eval)) for s in range(samples)])
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])  # left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = {cache_kwarg(model): DynamicCache()}
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache)
    responses, stopped = [[] for _ in prompts], [False] * len(prompts)
    for t in range(cfg.eval.max_new_tokens):
        logits = out.logits[:, -1].double()
        if samples:
            logits -= torch.log(-torch.log(uniform_noise(seeds, torch.full_like(seeds, t), logits.shape[-1])))
        tokens = logits.argmax(-1)
        for i, token in enumerate(tokens.tolist()):
            if not stopped[i]:
                responses[i].append(token)
                stopped[i] = token in stops
        if all(stopped):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # a stopped row's later tokens are not read
        positions = positions[:, -1:] + 1
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions, use_cache=True, **cache)
    rewards = [score(tokenizer.decode(r, skip_special_tokens=True), label) if stop else 0.0
               for r, label, stop in zip(responses, labels, stopped)]
    return sum(rewards) / len(rewards)


def test_three_step_grpo_run(tmp_path):
    cfg = load_config("tests", [f"train.output_dir={tmp_path}", "eval.samples=2", "train.curves=true"])
    summary = loop.train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "t_step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        for key in ("t_roll", "t_reward", "t_old", "t_ref", "t_pol", "t_sync", "reward_mean", "clipfrac", "kl"):
            assert key in r, key
        assert r["t_step"] >= r["t_roll"] + r["t_pol"]
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * cfg.responses_per_step
    assert {s["policy_version"] for s in samples} == {0, 1, 2}  # generated before each update
    assert set(samples[0]) >= {"prompt_id", "sample_seed", "policy_version", "finish_reason", "length", "reward",
                               "text"}
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert (tmp_path / "curves.png").stat().st_size > 1000 and summary["curves"] == str(tmp_path / "curves.png")
    timing = json.loads((tmp_path / "timing.json").read_text())  # the run's timing report, from its rows
    assert timing["steps"] == 3 and summary["timing"] == str(tmp_path / "timing.md")
    assert timing["seconds"]["rollout"] == pytest.approx(sum(r["t_roll"] for r in steps), abs=1e-2)
    evals = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3]
    assert summary["after"] == {k: v for k, v in evals[-1].items() if k.startswith("eval_")}
    assert all(r["eval_n"] == cfg.eval.heldout_size and r["eval_sampled_n"] == 2 * r["eval_n"] for r in evals)
    # the accuracies are those of the base policy and of the saved step-3 policy, decoded without the engine
    for r, policy in zip(evals, [cfg.model.policy, str(tmp_path / "checkpoints" / "step_000003" / "policy")]):
        assert r["eval_accuracy"] == pytest.approx(accuracy_by_hand(policy, cfg), abs=1e-12), r["step"]
        assert r["eval_sampled_accuracy"] == pytest.approx(accuracy_by_hand(policy, cfg, samples=2), abs=1e-12)


def test_checkpoint_reloads_identical_logits(tmp_path):
    cfg = load_config("tests", [f"train.output_dir={tmp_path}", "eval.before=false"])
    tr = loop.build_trainer(cfg)
    with tr.pool:
        loop.outer_step(tr)
    folder = loop.save(tr)
    reloaded = load_policy(str(folder / "policy"))
    tokenizer = load_tokenizer(folder / "policy")
    ids = torch.tensor([tokenizer.encode("Ada has 3 pens.\nSolution:\n", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, tr.policy(ids).logits)
    # the update really changed the weights, so the check above is not vacuous
    base = load_policy(cfg.model.policy)
    with torch.no_grad():
        assert not torch.equal(base(ids).logits, tr.policy(ids).logits)


def test_grpo_advantages_in_the_step():
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 4)
    batch = SimpleNamespace(rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]), group_ids=torch.tensor([0, 0, 1, 1]),
                            response_mask=mask, response_lengths=mask.sum(-1).long(), size=4)
    cfg = load_config("tests")
    adv = compute_advantages(batch, cfg, get_method(cfg.method.name))[0]
    # group 0: mean 0.5, unbiased std sqrt(0.5) -> ±0.5/0.7071; group 1 all equal -> 0
    a = 0.5 / 0.5 ** 0.5
    expected = torch.tensor([[a, a, 0.0], [-a, -a, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(adv, expected, atol=1e-5)


def test_native_backend_trains_like_the_hf_backend(tmp_path):
    """The backend is a preset choice: on the same seeds both engines sample the same tokens."""
    digests = {}
    for backend in ("hf", "native"):
        cfg = load_config("tests", [f"train.output_dir={tmp_path / backend}", f"rollout.backend={backend}",
                                    "train.steps=2", "eval.before=false", "eval.after=false"])
        loop.train(cfg)
        samples = [json.loads(x) for x in (tmp_path / backend / "samples.jsonl").read_text().splitlines()]
        digests[backend] = [s["tokens_digest"] for s in samples]
        # after an update (and the engine's sleep), the engine serves the trainer's weights: its behaviour
        # log-probs are the trainer's recomputed ones
        rows = [json.loads(x) for x in (tmp_path / backend / "metrics.jsonl").read_text().splitlines()]
        assert all(r["behaviour_vs_old_logp_absdiff"] < 1e-5 for r in rows), backend
    assert digests["native"] == digests["hf"]


@pytest.mark.parametrize("backend", ["hf", "native"])
@pytest.mark.parametrize("sleep", [True, False])
def test_the_engine_sleeps_while_the_trainer_updates(tmp_path, monkeypatch, backend, sleep):
    cfg = load_config("tests", [f"train.output_dir={tmp_path}", "train.steps=1", f"rollout.backend={backend}",
                                f"rollout.sleep_during_update={str(sleep).lower()}"])
    tr = loop.build_trainer(cfg)
    seen = []
    real_update = loop.update

    def watched(*args, **kwargs):
        seen.append(tr.engine.asleep)
        return real_update(*args, **kwargs)

    monkeypatch.setattr(loop, "update", watched)
    with tr.pool:
        loop.outer_step(tr)
    assert seen == [sleep]  # asleep during the update exactly when asked
    assert not tr.engine.asleep  # and awake for the next rollout


def test_a_run_evaluates_its_benchmarks_at_every_checkpoint(tmp_path):
    cfg = load_config("tests", [f"train.output_dir={tmp_path}", "train.steps=2", "train.save_every=1",
                                "eval.benchmarks=[heldout, arith]", "eval.limit=4", "eval.after=false"])
    loop.train(cfg)
    written = sorted(p.name for p in (tmp_path / "eval").glob("*.json"))
    assert written == ["base.json", "step_000001.json", "step_000002.json"]  # the base policy, then each save
    result = json.loads((tmp_path / "eval" / "step_000002.json").read_text())
    assert result["step"] == 2 and set(result["benchmarks"]) == {"heldout", "arith"}
    assert result["policy"].endswith("checkpoints/step_000002/policy")
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r["bench_heldout_greedy"] for r in rows if "bench_heldout_greedy" in r]
    assert len(logged) == 3 and logged[-1] == result["benchmarks"]["heldout"]["metrics"]["greedy"]
    assert (tmp_path / "eval" / "accuracy.png").exists()


def test_save_last_false_writes_no_final_checkpoint_but_a_stopped_process_still_does(tmp_path):
    base = ["train.save_last=false", "eval.before=false", "eval.after=false"]
    loop.train(load_config("tests", [f"train.output_dir={tmp_path / 'whole'}", "train.steps=1", *base]))
    rows = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "t_step" in r] == [1] and not any("t_ckpt" in r for r in rows)
    assert not list((tmp_path / "whole").glob("checkpoints/step_*"))
    loop.train(load_config("tests", [f"train.output_dir={tmp_path / 'stopped'}", "train.steps=2", "train.stop_after=1",
                                     *base]))
    assert (tmp_path / "stopped" / "checkpoints" / "latest").read_text().strip() == "step_000001"  # to resume


def test_save_last_false_with_benchmarks_is_refused():
    from caspo.config import ConfigError

    with pytest.raises(ConfigError, match="eval.benchmarks=\\[\\]"):
        load_config("tests", ["train.save_last=false", "eval.benchmarks=[arith]"])
