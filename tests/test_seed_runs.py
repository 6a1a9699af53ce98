"""The seed's runs, shrunk to the CPU: its presets with the BPE fixtures (tests/bpe_fixtures.py) as the policy,
on dsr_sub rows, with the seed's template and with the chat template.

The caspo runs use a value model made here by phase 1 as `caspo value collect` and `caspo value train` make it
(caspo.value.collect.collect, caspo.value.train.train_value). Phase 1 labels only prompts with mixed outcomes,
and the random fixture has none: nearly uniform over 151,936 tokens, it writes no box and no digit and rarely
stops, so every response scores 0. Phase 1 and the caspo run therefore use the fixture with planted answer
tokens (`plant_tokens`): at every position it writes "6" with probability 1/4, a newline 1/4 and
<|endoftext|> 1/8, and is as random as before otherwise. Its prompts are the dsr_sub rows whose gold is 6,
scored by the real verifier with reward.fallback=last_number (no box, so the response's last number is its
answer): a response is right when it stops within the budget and its last number is a lone 6.
"""

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from caspo.config import load_config
from caspo.data.registry import SHIPPED
from caspo.methods import resolve_method
from caspo.models.provenance import model_identity
from caspo.train import loop
from caspo.value.collect import CollectSpec, collect
from caspo.value.labels import read_label_file
from caspo.value.refresh import train as train_run
from caspo.value.train import TrainSpec, train_value

pytestmark = pytest.mark.timeout(300)

SHRUNK = ["model.device=cpu", "model.threads=1", "rollout.backend=hf", "rollout.cuda_graphs=false",
          "rollout.shared_prefix_attention=false", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
          "rollout.max_new_tokens=12", "train.minibatch_size=4", "train.micro_batch_size=2", "train.steps=2",
          "reward.workers=1", "eval.before=false", "eval.heldout_size=2", "eval.max_new_tokens=12", "optim.lr=1e-4"]

PLANTED = {"6": 1 / 4, "\n": 1 / 4, "<|endoftext|>": 1 / 8}  # next-token probabilities at every position
PHASE1 = CollectSpec(prompts=6, k=4, j=2, boundaries=2)  # K rollouts of 6 prompts, J continuations, S boundaries


def plant_tokens(fixture: Path, folder: Path, rates: dict[str, float]) -> dict[int, float]:
    """Save in `folder` a copy of the `fixture` folder (tied embeddings) that writes each one-token text t with
    probability ~rates[t] at every position; returns {token id: rate}.

    Every embedding row gets SHIFT in column 0, which then dominates the residual stream: after the final
    RMSNorm h ≈ √d·e_0 whatever the context, so logit_t ≈ √d·E[t, 0] plus near-equal noise. A planted row gets
    SHIFT + log(p_t·V / (1 − Σp))/√d: weight p_t against V near-equal rows sharing the remaining mass 1 − Σp.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shift = 1.0  # against ~0.02 for the random entries
    shutil.copytree(fixture, folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    embeddings = model.get_input_embeddings().weight
    vocab, width = embeddings.shape
    rest = 1 - sum(rates.values())
    planted = {}
    with torch.no_grad():
        embeddings[:, 0] = shift
        for text, p in rates.items():
            (token,) = tokenizer.encode(text, add_special_tokens=False)
            embeddings[token, 0] = shift + math.log(p * vocab / rest) / math.sqrt(width)
            planted[token] = p
    model.save_pretrained(folder)
    return planted


@dataclass(frozen=True)
class Phase1:
    policy: Path  # the planted fixture
    planted: dict[int, float]  # its planted token ids and their probabilities
    overrides: list[str]  # its run: the policy, the rows, the verifier and splitter, the template
    labels: Path  # the label file of `caspo value collect`
    value: Path  # the value model folder of `caspo value train`


@pytest.fixture(scope="module")
def phase1(real_models, tmp_path_factory):
    """phase1(template) -> Phase1: the planted fixture on the dsr_sub rows whose gold is 6, labelled and its
    value model trained once per template (the template is part of the provenance, so the seed's and the chat
    template need a collection each)."""
    root = tmp_path_factory.mktemp("phase1")
    policy = root / "planted"
    planted = plant_tokens(real_models.qwen, policy, PLANTED)
    rows = [json.loads(line) for line in SHIPPED["dsr_sub"].path.read_text().splitlines()]
    (root / "dsr_sub_6.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["answer"] == "6"))
    made = {}

    def make(template: str) -> Phase1:
        if template not in made:
            # the planted policy writes lines, not LaTeX: the newline splitter cuts them into steps (the LaTeX
            # splitter glues lines under 20 characters, and few of these reach 20)
            overrides = [f"model.policy={policy}", *SHRUNK, f"data.source={root / 'dsr_sub_6.jsonl'}",
                         "data.id_field=id", "data.eval_source=math500", "reward.fallback=last_number",
                         "method.step_splitter=newline", "method.max_steps=4", *TEMPLATES[template]]
            labels = root / f"labels-{template}.jsonl"
            collect(load_config("qwen-math-dsr", overrides), PHASE1, labels)
            value = root / f"value-{template}"
            train_value(labels, str(policy), value, TrainSpec(val_split="row", val_fraction=0.5, epochs=2,
                                                              batch_size=4, micro_batch_size=4, lr=1e-3))
            made[template] = Phase1(policy, planted, overrides, labels, value)
        return made[template]

    return make


TEMPLATES = {"seed": [], "chat": ["data.template=chat"]}  # the preset's template is the seed's


def two_steps(run_dir: Path, overrides: list[str]) -> tuple[list[dict], list[dict]]:
    """Two steps of the qwen-math-dsr preset shrunk: (metrics.jsonl rows, samples.jsonl rows)."""
    cfg = load_config("qwen-math-dsr", [f"train.output_dir={run_dir}", *overrides])
    resolve_method(cfg)
    summary = loop.train(cfg)
    assert summary["run_dir"] == str(run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2]
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert {s["prompt_id"].split("-")[0] for s in samples} == {"dsr_sub"}
    assert all(s["length"] > 0 for s in samples)
    return rows, samples


RUN = [*SHRUNK, "eval.after=false", "eval.benchmarks=[]", "method.vineppo_k=2", "method.max_steps=4"]
# -m slow, about 9 s each; the default run has grpo on the seed's template in
# test_the_seed_preset_runs_two_steps_and_evaluates_its_benchmarks


@pytest.mark.slow
@pytest.mark.parametrize("method, template", [(m, t) for m in ("grpo", "ppo_critic", "vineppo") for t in TEMPLATES])
def test_two_steps_of_each_method_on_dsr_sub_with_the_bpe_fixture(tmp_path, real_models, method, template):
    rows, _ = two_steps(tmp_path / "run", [f"model.policy={real_models.qwen}", *RUN, f"method.name={method}",
                                           *TEMPLATES[template]])
    if method == "vineppo":
        assert all(1 <= r["steps_mean"] <= 4 for r in rows if "steps_mean" in r)


@pytest.mark.slow  # phase 1 and the run: 20-40 s for each template
@pytest.mark.parametrize("template", TEMPLATES)
def test_two_caspo_steps_with_a_value_model_collected_and_trained_on_the_fixture(tmp_path, phase1, template):
    from caspo.models.policy import load_policy

    made = phase1(template)
    labels = read_label_file(made.labels)
    policy = load_policy(str(made.policy))
    with torch.no_grad():  # the plant: these next-token probabilities after any prompt
        probs = policy(torch.tensor([labels.rows[0].prompt_tokens])).logits[0, -1].softmax(-1)
    for token, p in made.planted.items():
        assert probs[token].item() == pytest.approx(p, rel=0.2)

    stats = labels.header["stats"]
    assert stats["base_rollouts"] == PHASE1.prompts * PHASE1.k and stats["mixed_prompts"] >= 2
    assert stats["labelled_rollouts"] == PHASE1.k * stats["mixed_prompts"]  # pairing "all"
    assert 8 <= len(labels.rows) <= PHASE1.boundaries * stats["labelled_rollouts"]
    assert all(0 < r.boundary < len(r.response_tokens) for r in labels.rows)
    assert {r.base_reward for r in labels.rows} == {0.0, 1.0}
    p_hats = {r.p_hat for r in labels.rows}
    assert len(p_hats) > 1 and all((p * PHASE1.j).is_integer() for p in p_hats)  # means of J 0/1 rewards

    provenance = json.loads((made.value / "value_config.json").read_text())["provenance"]
    identity = model_identity(policy)
    assert provenance["label_policy"] == provenance["reference"] == labels.provenance.label_policy == identity
    if template == "seed":
        assert provenance["prompt_template"] == load_config("qwen-math-dsr").data.template
    else:
        assert "<|im_start|>" in provenance["prompt_template"]  # the tokenizer's chat template

    rows, _ = two_steps(tmp_path / "run", [*RUN, *made.overrides, "method.name=caspo",
                                           f"method.caspo.value_model={made.value}"])
    steps = [r for r in rows if "reward_mean" in r]
    assert all(1 <= r["steps_mean"] <= 4 for r in steps)
    assert any(r["reward_mean"] > 0 for r in steps)  # the planted policy is right on some of these rows
    # a fresh value model (φ = reference) reads V = 0 at every step: this one was trained
    assert any(r["step_value_mean"] != 0 for r in steps)


def test_the_seed_preset_runs_two_steps_and_evaluates_its_benchmarks(tmp_path, real_models):
    cfg = load_config("qwen-math-dsr", [f"model.policy={real_models.qwen}", f"train.output_dir={tmp_path}",
                                        *SHRUNK, "train.save_every=2", "eval.limit=2"])
    train_run(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2]
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert {s["prompt_id"].split("-")[0] for s in samples} == {"dsr_sub"} and all(s["length"] > 0 for s in samples)
    result = json.loads((tmp_path / "eval" / "step_000002.json").read_text())
    assert set(result["benchmarks"]) == {"math500", "gsm8k", "olympiadbench"}
    assert all(b["n"] == 2 for b in result["benchmarks"].values())
    assert (tmp_path / "eval" / "base.json").exists() is False  # eval.before=false in the shrunk run
