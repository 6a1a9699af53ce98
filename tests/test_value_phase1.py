"""Phase 1: boundary choice, splits, label files and shards, and collect -> train -> probe end to end."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from caspo.models.prefix_value import load_prefix_value
from caspo.models.provenance import Provenance
from caspo.models.tokenizer import load_tokenizer
from caspo.value.cli import value_app
from caspo.value.collect import choose_boundaries, parse_shard
from caspo.value.labels import LabelFileError, LabelRow, merge_label_files, read_label_file, write_label_file
from caspo.value.probe import predict
from caspo.value.train import split_rows

PROVENANCE = Provenance(prompt_template="{query}", add_bos=False, tokenizer_hash="t:x", verifier_version="v",
                        temperature=1.0, top_p=1.0, top_k=0, stop_strings=(), max_new_tokens=40,
                        label_policy="w:p").to_dict()


def spearman_by_hand(x, y) -> float:
    """Pearson correlation of average ranks, a value's rank counted as #smaller + (#equal + 1) / 2."""
    def ranks(v):
        v = np.asarray(v, dtype=np.float64)
        return np.array([(v < a).sum() + ((v == a).sum() + 1) / 2 for a in v])

    return float(np.corrcoef(ranks(x), ranks(y))[0, 1])


def row(prompt_index, sample=0, boundary=1, p_hat=0.5):
    return LabelRow(prompt_id=f"p{prompt_index}", prompt_index=prompt_index, sample=sample, prompt_tokens=[5, 6],
                    response_tokens=[7, 8, 9], boundary=boundary, step=1, p_hat=p_hat, j=4, base_reward=1.0,
                    label="3", provenance=PROVENANCE)


def header(shard, **extra):
    return {"shard": shard, "k": 4, "j": 4, "provenance": PROVENANCE,
            "stats": {"base_rollouts": 8, "mixed_prompts": 1}, **extra}


def test_choose_boundaries_spreads_over_interior_steps():
    starts = [0, 3, 7, 12, 20, 25]  # interior: 3 7 12 20 25
    assert choose_boundaries(starts, 3) == [3, 12, 25]
    assert choose_boundaries(starts, 1) == [12]
    assert choose_boundaries(starts, 5) == choose_boundaries(starts, 9) == [3, 7, 12, 20, 25]
    assert choose_boundaries([0], 3) == []  # one step: nothing between prompt and end


def test_parse_shard():
    assert parse_shard("1/4") == (1, 4)
    with pytest.raises(ValueError, match="shard 4/4: need 0 <= i < n"):
        parse_shard("4/4")
    for bad in ("1", "a/b"):
        with pytest.raises(ValueError, match=f"shard must look like i/n \\(e.g. 0/4\\), got '{bad}'"):
            parse_shard(bad)


def test_prompt_split_keeps_each_prompt_on_one_side():
    rows = [row(p, s, b) for p in range(40) for s in range(2) for b in (1, 2)]
    train, val = split_rows(rows, "prompt", 0.3, seed=0)
    assert {r.prompt_id for r in train}.isdisjoint({r.prompt_id for r in val})
    assert len(train) + len(val) == len(rows) and 0 < len(val) < len(rows)
    assert split_rows(rows, "prompt", 0.3, seed=0) == (train, val)  # reproducible
    row_train, row_val = split_rows(rows, "row", 0.3, seed=0)
    assert not {r.prompt_id for r in row_train}.isdisjoint({r.prompt_id for r in row_val})
    with pytest.raises(ValueError, match="choose row, prompt"):
        split_rows(rows, "random", 0.3, seed=0)


def test_merge_refuses_missing_shards_and_other_collections(tmp_path):
    a = write_label_file(tmp_path / "a.jsonl", header("0/2"), [row(2), row(0)])
    b = write_label_file(tmp_path / "b.jsonl", header("1/2"), [row(1)])
    merged = merge_label_files([b, a], tmp_path / "m.jsonl")
    assert [r.prompt_index for r in merged.rows] == [0, 1, 2]
    assert merged.header["stats"] == {"base_rollouts": 16, "mixed_prompts": 2}
    with pytest.raises(LabelFileError, match="every shard"):
        merge_label_files([a], tmp_path / "m2.jsonl")
    c = write_label_file(tmp_path / "c.jsonl", header("1/2", j=8), [row(1)])
    with pytest.raises(LabelFileError, match="another collection.*j"):
        merge_label_files([a, c], tmp_path / "m3.jsonl")
    hot = write_label_file(tmp_path / "hot.jsonl", header("1/2", state_temperature=2.0), [row(1)])
    with pytest.raises(LabelFileError, match="another collection.*state_temperature"):
        merge_label_files([a, hot], tmp_path / "m4.jsonl")


def test_a_truncated_label_file_is_refused(tmp_path):
    path = write_label_file(tmp_path / "a.jsonl", header("0/1"), [row(0), row(1)])
    path.write_text("\n".join(path.read_text().splitlines()[:2]) + "\n")
    with pytest.raises(LabelFileError, match="header says 2 rows, found 1"):
        read_label_file(path)


def invoke(*args):
    result = CliRunner().invoke(value_app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.timeout(120)
def test_collect_train_probe_end_to_end(tmp_path):
    small = ["reward.workers=0", "model.threads=1", "--prompts", 12, "--k", 4, "--j", 2, "--boundaries", 2]
    invoke("collect", "tests", *small, "--out", tmp_path / "labels.jsonl")
    invoke("collect", "tests", *small, "--out", tmp_path / "merged.jsonl", "--nproc", 2)  # shards 0/2 and 1/2
    shards = [tmp_path / f"s{i}.jsonl" for i in (0, 1)]
    for i, shard in enumerate(shards):
        invoke("collect", "tests", *small, "--shard", f"{i}/2", "--out", shard)
    invoke("merge", tmp_path / "again.jsonl", *reversed(shards))
    whole, merged = read_label_file(tmp_path / "labels.jsonl"), read_label_file(tmp_path / "merged.jsonl")
    assert merged.rows == whole.rows and len(whole.rows) >= 8  # shards rebuild the unsharded collection
    assert not list(tmp_path.glob("merged.shard*"))  # --nproc removes its shards once merged
    assert read_label_file(tmp_path / "again.jsonl").rows == whole.rows
    assert [read_label_file(shard).header["shard"] for shard in shards] == ["0/2", "1/2"]
    assert {r.j for r in whole.rows} == {2} and all(0 <= r.boundary < len(r.response_tokens) for r in whole.rows)

    out = tmp_path / "value"
    invoke("train", tmp_path / "labels.jsonl", "--policy", "embedded:tiny-arith", "--out", out,
           "--val-split", "prompt", "--val-fraction", 0.5, "--epochs", 1, "--batch-size", 8)
    metrics = json.loads((out / "metrics.json").read_text())
    assert {"spearman", "within_response_spearman", "auc_outcome", "above_ceiling", "calibration",
            "history"} <= set(metrics)
    assert (out / "calibration.png").stat().st_size > 1000
    assert json.loads((out / "value_config.json").read_text())["provenance"]["reference"].startswith("w:")

    probed = json.loads(invoke("probe", out, tmp_path / "labels.jsonl"))
    values = predict(load_prefix_value(out, None), whole.rows, load_tokenizer(out).pad_token_id)
    assert probed["n"] == len(whole.rows) == len(values)
    assert probed["spearman"] == pytest.approx(spearman_by_hand(values, [r.p_hat for r in whole.rows]), abs=1e-12)
    assert probed["mean_p_hat"] == pytest.approx(np.mean([r.p_hat for r in whole.rows]), abs=1e-12)


def test_merged_copies_give_the_same_loss_gradient_and_values(tiny_model):
    import torch

    from caspo.models.prefix_value import PrefixValueModel
    from caspo.value.labels import group_responses, merge_duplicates
    from caspo.value.probe import predict
    from caspo.value.train import TrainSpec, train_step

    def labelled(prompt_index, sample, response, boundaries, p_hats):
        return [LabelRow(prompt_id=f"p{prompt_index}", prompt_index=prompt_index, sample=sample, prompt_tokens=[5, 6],
                         response_tokens=response, boundary=b, step=i + 1, p_hat=p, j=4, base_reward=0.0, label="3",
                         provenance=PROVENANCE) for i, (b, p) in enumerate(zip(boundaries, p_hats))]

    rows = (labelled(0, 0, [7, 8, 9, 10], [1, 3], [0.25, 0.5]) + labelled(0, 1, [7, 8, 9, 10], [1, 3], [0.25, 0.5])
            + labelled(0, 2, [7, 8, 11], [1, 2], [0.25, 1.0]) + labelled(0, 3, [7, 8, 9, 10], [1, 3], [0.25, 0.5]))
    responses = group_responses(rows)
    merged = merge_duplicates(responses)
    assert [r.weight for r in merged] == [3, 1] and merged[0].duplicate_rows == [[2, 3], [6, 7]]

    def loss_and_grad(batch):
        model = PrefixValueModel.from_reference(tiny_model)
        with torch.no_grad():  # move φ off the reference so values and gradients are not trivial
            for p in model.policy.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        optimizer = torch.optim.SGD(model.policy.parameters(), lr=0.0)
        loss = train_step(model, optimizer, batch, 0, TrainSpec(micro_batch_size=2, grad_clip=1e9), "cpu")
        grads = torch.cat([p.grad.flatten() for p in model.policy.parameters() if p.grad is not None])
        return loss, grads, predict(model, rows, 0, batch_size=2)

    loss, grads, values = loss_and_grad(responses)
    merged_loss, merged_grads, _ = loss_and_grad(merged)
    assert merged_loss == pytest.approx(loss, rel=1e-5) and torch.allclose(merged_grads, grads, rtol=1e-4, atol=1e-7)
    assert not any(v != v for v in values)  # every copy's rows got its value
    assert values[0] == values[2] == values[6] and values[1] == values[3] == values[7] and values[1] != values[5]


def test_state_temperature_changes_only_the_base_rollouts_sampler():
    from types import SimpleNamespace

    from caspo.config import load_config
    from caspo.rollout.base import Completion, SamplingParams
    from caspo.value.collect import base_rollouts

    seen = []

    class RecordingEngine:
        def generate(self, requests, sampling):
            seen.append(sampling)
            return [Completion(tokens=[1, 2], logprobs=[-1.0, -1.0], finish_reason="stop", policy_version=0)
                    for _ in requests]

    run_sampling = SamplingParams(temperature=1.0, top_p=0.9, stop_token_ids=[0])
    setup = SimpleNamespace(engine=RecordingEngine(), sampling=run_sampling, decode=lambda t: "x")
    data = SimpleNamespace(train_prompts=[[5], [6]], train=[SimpleNamespace(label="1")] * 2)
    scorer = lambda texts, labels, finished: [0.0] * len(texts)  # noqa: E731
    cfg = load_config("tests")
    base_rollouts(cfg, setup, data, [0, 1], 2, scorer)
    base_rollouts(cfg, setup, data, [0, 1], 2, scorer, temperature=2.0)
    assert seen[0] is run_sampling
    assert seen[1].temperature == 2.0 and seen[1].top_p == 0.9 and seen[1].stop_token_ids == [0]
    assert run_sampling.temperature == 1.0  # the run's sampler (continuations, labels) is untouched


def test_collect_refuses_a_non_positive_state_temperature(tmp_path):
    from caspo.config import load_config
    from caspo.value.collect import CollectSpec, collect

    with pytest.raises(ValueError, match="state temperature must be > 0"):
        collect(load_config("tests"), CollectSpec(prompts=2, k=2, j=2, boundaries=1, state_temperature=0.0),
                tmp_path / "labels.jsonl")


def test_probability_ceiling_by_hand():
    import math

    import torch

    from caspo.models.prefix_value import probability_ceiling
    from caspo.value.probe import ceiling_metrics

    ceiling = probability_ceiling(torch.tensor([math.log(0.25), 0.0, math.log(1e-6)]))
    assert torch.allclose(ceiling, torch.tensor([1 / 1.25, 0.5, 1 / (1 + 1e-6)]))
    m = ceiling_metrics([0.5, 0.9], [1.0, 0.5])
    assert m["above_ceiling"] == 0.5 and m["mean_ceiling_sure"] == 0.5


def test_a_sure_phi_reaches_the_ceiling_and_no_phi_passes_it(tiny_model):
    """π_φ(y_i) = 1 on every response token gives V = −β log π_ref(prefix) exactly: the ceiling."""
    from types import SimpleNamespace

    import torch

    from caspo.models.prefix_value import PrefixValueModel
    from caspo.value.labels import group_responses
    from caspo.value.probe import boundary_values

    class SureOfEveryNextToken(torch.nn.Module):
        def get_decoder(self):
            def decoder(input_ids, **_):
                hidden = torch.zeros(*input_ids.shape, 100)
                hidden[:, :-1] = 60.0 * torch.nn.functional.one_hot(input_ids[:, 1:], 100)
                return SimpleNamespace(last_hidden_state=hidden)
            return decoder

        def get_output_embeddings(self):  # the identity as a bias-free linear head: logits = hidden states
            head = torch.nn.Linear(100, 100, bias=False)
            with torch.no_grad():
                head.weight.copy_(torch.eye(100))
            return head

    rows = [LabelRow(prompt_id="p0", prompt_index=0, sample=0, prompt_tokens=[5, 6], response_tokens=[7, 8, 9, 10],
                     boundary=b, step=b, p_hat=1.0, j=4, base_reward=1.0, label="3", provenance=PROVENANCE)
            for b in (1, 2, 3)]
    responses = group_responses(rows)
    sure = PrefixValueModel(SureOfEveryNextToken(), tiny_model)
    values, _, ceiling = boundary_values(sure, responses, 0)
    assert torch.allclose(torch.sigmoid(values / sure.beta), ceiling, atol=1e-5)
    assert ceiling[0, 0] > 0.5 and (ceiling[0, 1:] > ceiling[0, :-1]).all()  # longer prefixes: less likely, higher

    perturbed = PrefixValueModel.from_reference(tiny_model)
    with torch.no_grad():
        for p in perturbed.policy.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    values, _, ceiling = boundary_values(perturbed, responses, 0)
    assert (torch.sigmoid(values / perturbed.beta) <= ceiling + 1e-6).all()


@pytest.mark.timeout(120)
def test_collect_splits_steps_as_training_does(tmp_path):
    """method.step_splitter and method.max_steps reach phase 1: the labelled boundaries are training's."""
    from caspo.config import load_config
    from caspo.value.collect import CollectSpec, collect

    spec = CollectSpec(prompts=8, k=4, j=2, boundaries=3)
    base = ["reward.workers=0", "model.threads=1"]
    free = collect(load_config("tests", base), spec, tmp_path / "free.jsonl")
    capped = collect(load_config("tests", [*base, "method.max_steps=2"]), spec, tmp_path / "capped.jsonl")
    assert free["splitter"] == capped["splitter"] == "newline"  # auto: the arithmetic task's lines
    free_steps = {r.step for r in read_label_file(tmp_path / "free.jsonl").rows}
    capped_steps = {r.step for r in read_label_file(tmp_path / "capped.jsonl").rows}
    assert max(free_steps) > 1 and capped_steps == {1}  # two steps leave one interior boundary
    latex = collect(load_config("tests", [*base, "method.step_splitter=latex"]), spec, tmp_path / "latex.jsonl")
    assert latex["splitter"] == "latex"


# ---------------------------------------------------------------- the seed's phase-1 knobs


def test_pairings_by_hand():
    from caspo.value.collect import paired_samples

    outcomes = [0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # right: 1 2 5; wrong: 0 3 4 6 7
    assert paired_samples(outcomes, "all") == list(range(8))
    assert paired_samples(outcomes, "paper") == [0, 1]  # the first right and the first wrong
    assert paired_samples(outcomes, "paper_multi") == [0, 1, 2, 3, 4, 5]  # min(3, 5) = 3 disjoint pairs
    assert paired_samples([1.0, 0.0, 1.0, 1.0], "paper_multi") == [0, 1]
    with pytest.raises(ValueError, match="choose from all, paper, paper_multi"):
        paired_samples(outcomes, "pairs")
    with pytest.raises(ValueError, match="needs a right and a wrong sample"):
        paired_samples([1.0, 1.0], "paper")


def test_the_config_offers_the_pairings_collect_knows():
    import typing
    from dataclasses import fields

    from caspo.config.schema import CaspoConfig
    from caspo.value.collect import PAIRINGS

    hints = typing.get_type_hints(CaspoConfig)
    assert {f.name for f in fields(CaspoConfig)} >= {"refresh_pairing", "refresh_max_train_prefix_len"}
    assert typing.get_args(hints["refresh_pairing"]) == PAIRINGS


@pytest.mark.timeout(120)
def test_collect_labels_balanced_pairs(tmp_path):
    from collections import defaultdict

    from caspo.config import load_config
    from caspo.value.collect import CollectSpec, collect

    cfg = load_config("tests", ["reward.workers=0", "model.threads=1"])
    header = collect(cfg, CollectSpec(prompts=8, k=4, j=1, boundaries=1, pairing="paper_multi"),
                     tmp_path / "labels.jsonl")
    rows = read_label_file(tmp_path / "labels.jsonl").rows
    assert header["pairing"] == "paper_multi" and rows
    outcomes = defaultdict(dict)  # prompt -> sample -> reward, of the labelled rollouts
    for r in rows:
        outcomes[r.prompt_index][r.sample] = r.base_reward
    for samples in outcomes.values():
        right = sum(1 for v in samples.values() if v > 0.5)
        assert right == len(samples) - right  # as many right as wrong rollouts, each used once
    # every labelled rollout with an interior boundary got a row: the count of labelled rollouts bounds them
    assert sum(len(s) for s in outcomes.values()) <= header["stats"]["labelled_rollouts"]
    assert header["stats"]["labelled_rollouts"] % 2 == 0


def labelled_response(prompt_index, sample, response, boundaries, p_hats, provenance=PROVENANCE):
    return [LabelRow(prompt_id=f"p{prompt_index}", prompt_index=prompt_index, sample=sample, prompt_tokens=[5, 6],
                     response_tokens=response, boundary=b, step=i + 1, p_hat=p, j=4, base_reward=float(p > 0.5),
                     label="3", provenance=provenance) for i, (b, p) in enumerate(zip(boundaries, p_hats))]


def test_long_prefixes_are_dropped_and_counted():
    from caspo.value.train import drop_long_prefixes

    rows = labelled_response(0, 0, [7, 8, 9, 10, 11], [1, 3, 5], [0.2, 0.5, 0.9])
    kept, dropped = drop_long_prefixes(rows, 3)
    assert [r.boundary for r in kept] == [1, 3] and dropped == 1
    assert drop_long_prefixes(rows, 0) == (rows, 0)  # 0: no cap
    with pytest.raises(ValueError, match="drops all 1 training prefixes"):
        drop_long_prefixes(rows[2:], 4)


def test_truncated_rollouts_give_the_same_loss_and_gradient(tiny_model):
    """Cutting rollouts at max_train_prefix_len changes no kept prefix's value: the model is causal."""
    import torch

    from caspo.models.prefix_value import PrefixValueModel
    from caspo.value.labels import group_responses
    from caspo.value.train import TrainSpec, drop_long_prefixes, train_step, truncate_responses

    rows = (labelled_response(0, 0, [7, 8, 9, 10, 11, 12], [1, 3, 6], [0.25, 0.5, 1.0])
            + labelled_response(0, 1, [7, 13, 14, 15], [2, 4], [0.25, 0.0]))
    kept, dropped = drop_long_prefixes(rows, 3)
    assert dropped == 2

    def loss_and_grad(responses):
        model = PrefixValueModel.from_reference(tiny_model)
        with torch.no_grad():  # φ off the reference, so values and gradients are not trivial
            for p in model.policy.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        optimizer = torch.optim.SGD(model.policy.parameters(), lr=0.0)
        loss = train_step(model, optimizer, responses, 0, TrainSpec(micro_batch_size=2, grad_clip=1e9), "cpu")
        return loss, torch.cat([p.grad.flatten() for p in model.policy.parameters() if p.grad is not None])

    whole = group_responses(kept)
    cut = truncate_responses(whole, 3)
    assert [len(r.response_tokens) for r in cut] == [3, 3] and [len(r.response_tokens) for r in whole] == [6, 4]
    loss, grads = loss_and_grad(whole)
    cut_loss, cut_grads = loss_and_grad(cut)
    assert cut_loss == pytest.approx(loss, rel=1e-5) and torch.allclose(cut_grads, grads, rtol=1e-4, atol=1e-7)


@pytest.mark.timeout(120)
def test_value_training_drops_long_prefixes_and_saves_every_epoch(tmp_path):
    from caspo.config import load_config
    from caspo.models.policy import load_policy, resolve_model_path
    from caspo.models.prefix_value import load_prefix_value
    from caspo.models.provenance import label_provenance
    from caspo.models.tokenizer import load_tokenizer
    from caspo.value.train import TrainSpec, train_value

    cfg = load_config("tests")
    tokenizer = load_tokenizer(resolve_model_path(cfg.model.policy))
    provenance = label_provenance(cfg, tokenizer, load_policy(cfg.model.policy)).to_dict()
    rows = []
    for p in range(8):
        response = [20 + (p + i) % 9 for i in range(8)]
        rows += labelled_response(p, 0, response, [2, 4, 7], [0.1 * (p % 4), 0.2 + 0.1 * (p % 3), 0.9],
                                  provenance)
    labels = write_label_file(tmp_path / "labels.jsonl", {**header("0/1"), "provenance": provenance}, rows)
    spec = TrainSpec(epochs=2, batch_size=4, micro_batch_size=4, val_split="row", val_fraction=0.3,
                     max_train_prefix_len=5, save_every=1)
    summary = train_value(labels, cfg.model.policy, tmp_path / "value", spec)
    training, held_out = split_rows(rows, "row", 0.3, seed=0)  # the split train_value made
    long = sum(1 for r in training if r.boundary > 5)
    assert summary["dropped_long_prefixes"] == long > 0 and summary["train_rows"] == len(training) - long
    assert summary["val_rows"] == len(held_out)  # validation keeps its long prefixes
    assert len(summary["epoch_checkpoints"]) == 2
    for epoch, folder in enumerate(summary["epoch_checkpoints"], start=1):
        metrics = json.loads((tmp_path / "value" / folder.split("/")[-1] / "metrics.json").read_text())
        assert metrics["epoch"] == epoch and "auc_outcome" in metrics
        load_prefix_value(folder, None)  # a whole value model
    report = json.loads((tmp_path / "value" / "metrics.json").read_text())
    assert report["dropped_long_prefixes"] == summary["dropped_long_prefixes"]


def test_outcome_gate_by_hand():
    from caspo.value.metrics import outcome_gate

    # β = 10: σ(2) = .88 says right (R = 1, correct); σ(−2) wrong (R = 0, correct); σ(0) = 1/2 is not > 1/2,
    # so wrong (R = 0, correct); σ(.5) = .62 right (R = 0, wrong)  -> v_acc 3/4
    gate = outcome_gate([20.0, -20.0, 0.0, 5.0], [1.0, 0.0, 0.0, 0.0], beta=10.0)
    assert gate["v_acc"] == 0.75 and gate["majority_baseline"] == 0.75 and gate["positive_rate"] == 0.25
    assert gate["auc"] == 1.0  # the one right response has the highest value
    assert gate["passed"] and not gate["beats_majority"]  # passes 0.7, yet no better than guessing "wrong"
    # the seed's warning: 80% wrong rollouts and a value model that says "wrong" everywhere
    flat = outcome_gate([-1.0] * 10, [1.0, 1.0] + [0.0] * 8, beta=10.0)
    assert flat["v_acc"] == pytest.approx(0.8) and flat["passed"] and not flat["beats_majority"]
    assert flat["auc"] == 0.5
    assert not outcome_gate([1.0, -1.0], [0.0, 1.0], beta=1.0)["passed"]
    with pytest.raises(ValueError, match="one value per outcome"):
        outcome_gate([1.0], [1.0, 0.0], beta=1.0)


@pytest.mark.timeout(120)
def test_smoke_gate_on_the_first_rollout(value_model_folder):
    from caspo.config import load_config
    from caspo.value.smoke import smoke_gate

    cfg = load_config("tests", ["method.name=caspo", f"method.caspo.value_model={value_model_folder}",
                                "reward.workers=0"])
    gate = smoke_gate(cfg)
    # φ = reference: V = 0 on every response, σ = 1/2 says "wrong" everywhere: v_acc is the wrong share
    assert gate["n"] == cfg.responses_per_step
    assert gate["v_acc"] == pytest.approx(1 - gate["positive_rate"])
    assert gate["passed"] == (gate["v_acc"] >= 0.7) and not gate["beats_majority"]
    assert gate["auc"] == 0.5 or gate["auc"] != gate["auc"]  # all tied (NaN with one outcome class)
    with pytest.raises(ValueError, match="set method.name=caspo"):
        smoke_gate(load_config("tests"))
