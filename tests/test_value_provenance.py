"""Label provenance read off a config: what it records, and that it notices a changed tokenizer."""

import copy

import torch

from caspo.config import load_config
from caspo.models.policy import resolve_model_path
from caspo.models.provenance import label_provenance, model_identity, tokenizer_hash
from caspo.models.tokenizer import load_tokenizer
from caspo.reward import VERIFIER_VERSION


def test_label_provenance_records_the_sampler_prompt_and_verifier(tiny_model):
    cfg = load_config("tests", ["rollout.temperature=0.6", "data.add_bos=true"])
    tokenizer = load_tokenizer(resolve_model_path(cfg.model.policy))
    p = label_provenance(cfg, tokenizer, tiny_model)
    assert p.prompt_template == "{query}\nSolution:\n" and p.add_bos
    assert p.verifier_version == VERIFIER_VERSION
    assert (p.temperature, p.max_new_tokens) == (0.6, cfg.rollout.max_new_tokens)
    assert p.label_policy == model_identity(tiny_model) and p.reference is None


def test_tokenizer_hash_changes_with_the_vocabulary():
    tokenizer = load_tokenizer(resolve_model_path("embedded:tiny-arith"))
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<step>"])
    assert tokenizer_hash(tokenizer) == tokenizer_hash(copy.deepcopy(tokenizer)) != tokenizer_hash(other)


def test_model_identity_follows_the_weights(tiny_model):
    twin = copy.deepcopy(tiny_model)
    assert model_identity(twin) == model_identity(tiny_model)
    with torch.no_grad():
        next(twin.parameters())[0, 0] += 1e-3
    assert model_identity(twin) != model_identity(tiny_model)


def test_the_verifier_record_names_the_reward_settings_off_their_defaults(tiny_model):
    tokenizer = load_tokenizer(resolve_model_path("embedded:tiny-arith"))
    default = label_provenance(load_config("tests"), tokenizer, tiny_model)
    lenient = label_provenance(load_config("tests", ["reward.fallback=last_number", "reward.extractor=minerva"]),
                               tokenizer, tiny_model)
    assert default.verifier_version == VERIFIER_VERSION  # values made under the defaults keep their record
    assert lenient.verifier_version == f"{VERIFIER_VERSION}/extractor=minerva/fallback=last_number"


def test_the_shipped_slips_value_model_fits_the_arith_slips_preset():
    """embedded:tiny-arith-slips-value loads by name and was labelled under arith-slips' conditions (a change
    of prompt, sampler, verifier or policy weights would make every CASPO run of that preset refuse it)."""
    from caspo.models.policy import load_policy
    from caspo.models.prefix_value import load_prefix_value

    cfg = load_config("arith-slips")
    policy = load_policy(cfg.model.policy)
    expected = label_provenance(cfg, load_tokenizer(resolve_model_path(cfg.model.policy)), policy)
    model = load_prefix_value("embedded:tiny-arith-slips-value", expected)
    assert model.provenance.reference == model.provenance.label_policy == model_identity(policy)
    assert model.beta == 10.0
