"""CASPO's periodic refresh: segments of N steps, fresh value models between them, exact resume."""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from caspo.config import ConfigError, load_config
from caspo.methods import resolve_method
from caspo.models.policy import load_policy
from caspo.models.prefix_value import load_prefix_value
from caspo.models.provenance import check_provenance, label_provenance, model_identity
from caspo.train import checkpoint as ckpt
from caspo.train import loop
from caspo.train.verify_resume import digest
from caspo.value import refresh

pytestmark = pytest.mark.timeout(300)

# small enough for seconds per refresh on 2 cores, large enough for a held-out prompt in both refreshes
SMALL = ["method.caspo.refresh_prompts=24", "method.caspo.refresh_k=4", "method.caspo.refresh_j=2",
         "method.caspo.refresh_boundaries=2", "method.caspo.refresh_epochs=1"]


def checked_config(preset, overrides=()):
    """load_config, then the checks of the method's row (as the CLI and the trainer run them)."""
    cfg = load_config(preset, overrides)
    resolve_method(cfg)
    return cfg


def caspo_config(run_dir, value_model, *overrides):
    return load_config("tests", [f"train.output_dir={run_dir}", "train.steps=3", "eval.before=false",
                                 "eval.after=false", "reward.workers=0", "model.threads=1", "method.name=caspo",
                                 f"method.caspo.value_model={value_model}", *SMALL, *overrides])


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def refreshed_run(tmp_path_factory, value_model_folder):
    """Three steps with a refresh after steps 1 and 2."""
    run_dir = tmp_path_factory.mktemp("refreshed")
    cfg = caspo_config(run_dir, value_model_folder, "method.caspo.refresh_every=1")
    refresh.train(cfg)
    return cfg, run_dir


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, value_model_folder):
    """The same three steps without refreshes."""
    run_dir = tmp_path_factory.mktemp("plain")
    cfg = caspo_config(run_dir, value_model_folder)
    loop.train(cfg)
    return cfg, run_dir


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize("overrides, message", [
    (["method.caspo.refresh_every=-1"], "refresh_every must be >= 0"),
    (["method.name=grpo", "method.caspo.refresh_every=2"], "needs method.name=caspo, got grpo"),
    (["method.caspo.refresh_every=2", "method.caspo.online=true"], "alternatives"),
    (["method.caspo.refresh_every=2", "method.caspo.refresh_prompts=0"], "refresh_prompts must be >= 1"),
    (["method.caspo.refresh_every=2", "method.caspo.refresh_j=0"], "refresh_j must be >= 1"),
    (["method.caspo.refresh_every=2", "method.caspo.refresh_boundaries=0"], "refresh_boundaries must be >= 1"),
    (["method.caspo.refresh_every=2", "method.caspo.refresh_k=1"], "refresh_k must be >= 2"),
    (["method.caspo.refresh_every=2", "method.caspo.refresh_epochs=0"], "refresh_epochs must be >= 1"),
    (["method.caspo.refresh_every=2", "method.caspo.refresh_lr=0"], "refresh_lr must be > 0"),
    (["method.caspo.refresh_every=2", "method.caspo.refresh_val_fraction=1"], "refresh_val_fraction"),
    (["method.caspo.refresh_every=2", "method.caspo.refresh_state_temperature=-1"], "refresh_state_temperature"),
])
def test_refresh_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        checked_config("tests", ["method.name=caspo", "method.caspo.value_model=v", *overrides])


def test_refresh_config_accepts_a_caspo_run():
    cfg = load_config("tests", ["method.name=caspo", "method.caspo.value_model=v", "method.caspo.refresh_every=2"])
    assert cfg.method.caspo.refresh_every == 2
    # sizes are only checked when refreshes happen: refresh_k=0 loads, and no step of the run refreshes
    off = load_config("tests", ["method.name=caspo", "method.caspo.value_model=v", "method.caspo.refresh_k=0"])
    assert off.method.caspo.refresh_k == 0 and off.method.caspo.refresh_every == 0
    assert not any(refresh.due(off, step) for step in range(off.train.steps + 1))


def test_refresh_collects_at_the_state_temperature_it_is_given():
    base = ["method.name=caspo", "method.caspo.value_model=v", "method.caspo.refresh_every=2"]
    assert refresh.collect_spec(load_config("tests", base)).state_temperature is None  # 0: the run's
    hot = refresh.collect_spec(load_config("tests", [*base, "method.caspo.refresh_state_temperature=2.0"]))
    assert hot.state_temperature == 2.0 and hot.k == 4


def test_labels_are_reused_only_from_rollouts_at_the_same_state_temperature():
    base = ["method.name=caspo", "method.caspo.value_model=v", "method.caspo.refresh_every=2"]
    want = refresh.conditions(load_config("tests", base), 10.0, 2, {"policy": "p"})
    header = {**want["collect"], **{k: want[k] for k in ("splitter", "seed", "seed_step", "provenance")}}
    assert refresh.labels_match(header, want)
    assert not refresh.labels_match({**header, "state_temperature": 1.5}, want)  # states drawn at another T


def test_refresh_is_due_every_n_steps_but_never_after_the_last():
    cfg = load_config("tests", ["method.name=caspo", "method.caspo.value_model=v", "method.caspo.refresh_every=2",
                                "train.steps=6"])
    assert [s for s in range(7) if refresh.due(cfg, s)] == [2, 4]
    cfg.method.caspo.refresh_every = 0
    assert not any(refresh.due(cfg, s) for s in range(7))


# ---------------------------------------------------------------- the pipeline


def test_refreshes_write_labels_and_a_value_model_of_the_current_policy(refreshed_run, value_model_folder):
    cfg, run_dir = refreshed_run
    from caspo.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(run_dir / "checkpoints" / "step_000001" / "policy"))
    base = load_policy(cfg.model.policy)
    assert not (run_dir / "refresh" / "step_000003").exists()  # never after the last step
    for step in (1, 2):
        folder = run_dir / "refresh" / f"step_{step:06d}"
        labels = read_jsonl(folder / "labels.jsonl")
        assert labels[0]["header"]["rows"] == len(labels) - 1 > 0
        policy = load_policy(str(run_dir / "checkpoints" / f"step_{step:06d}" / "policy"))
        expected = label_provenance(cfg, tokenizer, policy)
        model = load_prefix_value(folder / "value", expected)  # raises on any provenance mismatch
        check_provenance(expected, model.provenance, "refreshed value model", ignore=("reference",))
        # labelled by the checkpoint's policy, which is also φ₀ and the frozen reference; not the base
        assert model.provenance.label_policy == model.provenance.reference == model_identity(policy)
        assert model.provenance.label_policy != model_identity(base)
        assert digest(dict(model.policy.named_parameters())) != \
            digest(dict(model.reference.named_parameters()))  # φ was trained

    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "refresh_value_model" in r]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["refresh_label_rows"] > 0 and -1 <= r["refresh_val_spearman"] <= 1 and r["t_refresh"] > 0
               and r["refresh_reused"] == "none" for r in records)
    for r in records:  # the labelling's generated tokens, counted for the report's compute
        stats = read_jsonl(run_dir / "refresh" / f"step_{r['step']:06d}" / "labels.jsonl")[0]["header"]["stats"]
        assert r["refresh_tokens"] == stats["base_tokens"] + stats["mc_tokens"] and stats["mc_tokens"] > 0
        assert stats["base_rollouts"] <= stats["base_tokens"] <= stats["base_rollouts"] * cfg.rollout.max_new_tokens
    state = ckpt.load_trainer_state(run_dir / "checkpoints" / "step_000003")
    assert state["value_source"] == {"path": str(run_dir.resolve() / "refresh" / "step_000002" / "value"),
                                     "label_policy": str(run_dir.resolve() / "checkpoints" / "step_000002" / "policy")}
    first = ckpt.load_trainer_state(run_dir / "checkpoints" / "step_000001")
    assert first["value_source"]["path"] == str(value_model_folder)  # segment 1 used the configured model


def test_steps_after_a_refresh_use_the_new_value_model(refreshed_run, plain_run):
    steps = {r["step"]: r for r in read_jsonl(refreshed_run[1] / "metrics.jsonl") if "reward_mean" in r}
    plain = {r["step"]: r for r in read_jsonl(plain_run[1] / "metrics.jsonl") if "reward_mean" in r}
    # the configured model is φ = reference: V = 0; refreshed models give values
    assert steps[1]["step_value_mean"] == plain[1]["step_value_mean"] == 0.0
    assert all(steps[s]["step_value_mean"] != 0.0 for s in (2, 3))
    assert all(plain[s]["step_value_mean"] == 0.0 for s in (2, 3))

    # a trainer resumed after the refreshes holds the last refreshed model, and its step advantages differ
    cfg, run_dir = refreshed_run
    tr = loop.build_trainer(cfg)
    configured = tr.method_state.model
    loop.restore(tr, run_dir / "checkpoints" / "step_000003")
    refreshed = load_prefix_value(run_dir / "refresh" / "step_000002" / "value", None)
    assert digest(dict(tr.method_state.model.policy.named_parameters())) == \
        digest(dict(refreshed.policy.named_parameters())) != digest(dict(configured.policy.named_parameters()))
    with tr.pool:
        batch = loop.generate(tr, tr.cursor.take(cfg.rollout.prompts_per_step))
        batch.rewards = loop.reward(tr, batch)
        batch.old_logprobs = loop.score(tr.policy, batch, cfg)
        advantages = []
        for model in (tr.method_state.model, configured):
            tr.method_state.model = model
            tr.method_state.values(tr, batch)
            advantages.append(loop.compute_advantages(batch, cfg, tr.method)[0])
    assert not torch.allclose(*advantages)


def test_a_value_model_named_anew_on_resume_wins_over_the_recorded_one(tmp_path, refreshed_run, value_model_folder):
    cfg, run_dir = refreshed_run
    other = tmp_path / "v_other"
    shutil.copytree(value_model_folder, other)
    tr = loop.build_trainer(caspo_config(run_dir, other))
    loop.restore(tr, run_dir / "checkpoints" / "step_000003")
    assert tr.method_state.source.path == str(other)


def test_an_online_value_model_cannot_continue_as_another(tmp_path, value_model_folder):
    """Online, the checkpoint holds φ's trained weights: loading them into another model (its reference, β and
    provenance) would run neither; a frozen run may name a new model (above)."""
    cfg = caspo_config(tmp_path / "run", value_model_folder, "method.caspo.online=true")
    tr = loop.build_trainer(cfg)
    with tr.pool:
        loop.outer_step(tr)
        folder = loop.save(tr)
    other = tmp_path / "v_other"
    shutil.copytree(value_model_folder, other)
    with pytest.raises(ConfigError, match=f"trained its value model online from {value_model_folder}"):
        loop.restore(loop.build_trainer(caspo_config(tmp_path / "run", other, "method.caspo.online=true")), folder)


def test_an_online_value_model_exports_as_a_value_model(tmp_path, value_model_folder):
    """<checkpoint>/value holds φ as trained, with its value_config.json: it loads on its own (a probe, a frozen
    run from it), saying it was trained online from the value model the run started with."""
    from caspo.models.prefix_value import load_prefix_value, read_value_config
    from caspo.rollout.publication import weights_digest

    tr = loop.build_trainer(caspo_config(tmp_path / "run", value_model_folder, "method.caspo.online=true"))
    with tr.pool:
        loop.outer_step(tr)
        folder = loop.save(tr)
    exported = load_prefix_value(folder / "value", None)
    trained = tr.method_state.model
    assert weights_digest(dict(exported.policy.named_parameters())) == \
        weights_digest(dict(trained.policy.named_parameters()))
    assert exported.beta == trained.beta and exported.provenance == trained.provenance
    assert read_value_config(folder / "value")["trained_online"] == {"from": str(value_model_folder)}
    ckpt.verify_checkpoint(folder)  # the manifest covers it


def test_state_continues_across_a_refresh_as_without_one(refreshed_run, plain_run):
    cfg = plain_run[0]
    a = ckpt.load_trainer_state(refreshed_run[1] / "checkpoints" / "step_000003")
    b = ckpt.load_trainer_state(plain_run[1] / "checkpoints" / "step_000003")
    assert (a["step"], a["version"]) == (b["step"], b["version"]) == (3, 3)
    assert digest(a["schedulers"]) == digest(b["schedulers"])
    assert a["optimizers"]["policy"]["param_groups"] == b["optimizers"]["policy"]["param_groups"]
    updates = 3 * cfg.responses_per_step // cfg.train.minibatch_size
    for state in (a, b):  # Adam counted every update, none twice
        assert {float(s["step"]) for s in state["optimizers"]["policy"]["state"].values()} == {float(updates)}
    assert a["cursor"] == b["cursor"]
    assert torch.equal(a["update_rng"], b["update_rng"])
    # the policy after step 1 is the same in both runs, so step 2 samples the same tokens
    samples_a, samples_b = (read_jsonl(run[1] / "samples.jsonl") for run in (refreshed_run, plain_run))
    assert [s["tokens_digest"] for s in samples_a if s["step"] <= 2] == \
        [s["tokens_digest"] for s in samples_b if s["step"] <= 2]
    # and the KL reference of a resumed refreshed run is the base policy
    tr = loop.build_trainer(refreshed_run[0])
    loop.restore(tr, refreshed_run[1] / "checkpoints" / "step_000003")
    assert digest(dict(tr.ref.named_parameters())) == digest(dict(load_policy(cfg.model.policy).named_parameters()))


def test_a_refresh_resumes_exactly_from_its_checkpoint(tmp_path, value_model_folder):
    cfg = caspo_config(tmp_path, value_model_folder, "method.caspo.refresh_every=1")
    tr = loop.build_trainer(cfg)
    base = digest(dict(tr.ref.named_parameters()))
    with tr.pool:
        loop.outer_step(tr)
        folder = loop.save(tr)
        before = {"policy": digest(dict(tr.policy.named_parameters())),
                  "optimizer": digest(tr.actor.optimizer.state_dict()),
                  "scheduler": digest(tr.actor.scheduler.state_dict()), "cursor": tr.cursor.state_dict(),
                  "update_rng": tr.update_rng.get_state(), "torch_rng": torch.get_rng_state(),
                  "counters": (tr.step, tr.version)}
        configured = tr.method_state.model
        torch.rand(7)  # whatever ran in between, the refresh resumes with the checkpoint's RNG
        record = refresh.refresh(tr, folder)
    assert tr.method_state.model is not configured and tr.method_state.source.path == record["refresh_value_model"]
    assert digest(dict(tr.policy.named_parameters())) == before["policy"]
    assert tr.engine.version == tr.version  # the restored weights were published again
    assert digest(dict(tr.ref.named_parameters())) == base  # the KL anchor stays the original base
    assert (tr.step, tr.version) == before["counters"]
    assert digest(tr.actor.optimizer.state_dict()) == before["optimizer"]
    assert digest(tr.actor.scheduler.state_dict()) == before["scheduler"]
    assert tr.cursor.state_dict() == before["cursor"]
    assert torch.equal(tr.update_rng.get_state(), before["update_rng"])
    assert torch.equal(torch.get_rng_state(), before["torch_rng"])
    tr.step = 2
    with pytest.raises(ValueError, match="holds step 1"):
        refresh.refresh(tr, folder)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_engine_sleeps_while_a_refresh_labels_and_trains(tmp_path, value_model_folder, monkeypatch, device):
    """The trainer's engine gives its cache and weights to the refresh (whose labelling engine and value training
    take memory of their own), then wakes to serve the restored checkpoint; on a card, the native engine with its
    decode graphs."""
    on_card = ["model.device=cuda", "rollout.backend=native", "rollout.cuda_graphs=true"] if device == "cuda" else []
    tr = loop.build_trainer(caspo_config(tmp_path, value_model_folder, "method.caspo.refresh_every=1", *on_card))
    asleep, artifacts = [], refresh.artifacts
    monkeypatch.setattr(refresh, "artifacts", lambda *a, **k: (asleep.append(tr.engine.asleep), artifacts(*a, **k))[1])
    with tr.pool:
        loop.outer_step(tr)
        record = refresh.refresh(tr, loop.save(tr))
        assert asleep == [True] and not tr.engine.asleep and tr.engine.version == tr.version
        batch, _ = loop.outer_step(tr)  # generated by the woken engine, from the published restored weights
    assert batch.size == 8 and tr.method_state.source.path == record["refresh_value_model"]


def test_a_resumed_pipeline_redoes_or_reuses_the_refresh_of_its_checkpoint(tmp_path, refreshed_run):
    """Resumed at step 2 (a refresh step): with no artifacts, with labels only, with finished ones."""
    cfg, original = refreshed_run
    final = digest(load_file(original / "checkpoints" / "step_000003" / "policy" / "model.safetensors"))
    run_dir = tmp_path / "run"
    shutil.copytree(original, run_dir)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=str(run_dir)))
    folder = run_dir / "refresh" / "step_000002"
    for cut, reused in [(lambda: shutil.rmtree(folder), "none"),  # stopped before the refresh
                        (lambda: (folder / "refresh.json").unlink(), "labels"),  # stopped while training φ
                        (lambda: None, "all")]:  # stopped after it
        cut()
        refresh.train(cfg, resume=str(run_dir / "checkpoints" / "step_000002"))
        metrics = read_jsonl(run_dir / "metrics.jsonl")
        assert [(r["step"], r["refresh_reused"]) for r in metrics if "refresh_value_model" in r] == \
            [(1, "none"), (2, reused)]  # each refresh logged once
        assert [r["step"] for r in metrics if "reward_mean" in r] == [1, 2, 3]
        # the same labels, value model and final policy as the uninterrupted run
        labels, labels_before = (read_jsonl(run / "refresh" / "step_000002" / "labels.jsonl")
                                 for run in (run_dir, original))
        assert labels[1:] == labels_before[1:]
        assert labels[0]["header"]["provenance"] == labels_before[0]["header"]["provenance"]
        assert digest(load_file(folder / "value" / "model.safetensors")) == \
            digest(load_file(original / "refresh" / "step_000002" / "value" / "model.safetensors"))
        assert digest(load_file(run_dir / "checkpoints" / "step_000003" / "policy" / "model.safetensors")) == final


# ---------------------------------------------------------------- phase 0


def test_without_a_value_model_phase_0_trains_the_first_one_from_the_base_policy(tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config("tests", [f"train.output_dir={run_dir}", "train.steps=2", "eval.before=false",
                                "eval.after=false", "reward.workers=0", "model.threads=1", "method.name=caspo",
                                "method.caspo.refresh_every=5", *SMALL, "method.caspo.refresh_val_fraction=0.5"])
    resolve_method(cfg)  # accepted: refresh_every makes the value model
    with pytest.raises(ConfigError, match="refresh_every=N to train the first one"):
        resolve_method(dataclasses.replace(cfg, method=dataclasses.replace(
            cfg.method, caspo=dataclasses.replace(cfg.method.caspo, refresh_every=0))))
    refresh.train(cfg)
    folder = run_dir.resolve() / "refresh" / "step_000000"
    labels = read_jsonl(folder / "labels.jsonl")
    assert labels[0]["header"]["rows"] == len(labels) - 1 > 0
    from caspo.models.policy import resolve_model_path
    from caspo.models.tokenizer import load_tokenizer

    base = load_policy(cfg.model.policy)
    tokenizer = load_tokenizer(resolve_model_path(cfg.model.policy))
    model = load_prefix_value(folder / "value", label_provenance(cfg, tokenizer, base))
    assert model.provenance.label_policy == model_identity(base)  # labelled by the base policy
    assert digest(dict(model.policy.named_parameters())) != digest(dict(model.reference.named_parameters()))
    state = ckpt.load_trainer_state(run_dir / "checkpoints" / "step_000002")
    assert state["value_source"]["path"] == str(folder / "value")  # both steps used it (no refresh due)
    assert "value_model: " + str(folder / "value") in (run_dir / "config.yaml").read_text()
    # resumed, the run reuses phase 0 instead of labelling again
    stamp = (folder / "refresh.json").stat().st_mtime_ns
    refresh.train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=3)), resume="latest")
    assert (folder / "refresh.json").stat().st_mtime_ns == stamp
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "reward_mean" in r] == [1, 2, 3]
