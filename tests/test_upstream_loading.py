"""Upstream looped checkpoints as users have them: a folder in Ouro's layout loads as model.policy (policy,
critic, tokenizer) and trains; `caspo convert` writes a caspo-looped folder; model.revision pins hub commits."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from caspo.config import ConfigError, load_config
from caspo.models.critic import load_critic
from caspo.models.hub import SOURCE_RECORD, recorded_revision
from caspo.models.looped import LoopedForCausalLM, LoopedForValue
from caspo.models.policy import ASSETS, load_policy, resolve_model_path, stop_token_ids
from caspo.models.tokenizer import load_tokenizer

TINY = ASSETS / "tiny-looped"
COMMIT = "574fa66cb8bf5abdc979642d01cf2b79b16bfab1"
OTHER = "1" * 40


def ouro_folder(path: Path) -> Path:
    """The shipped tiny looped policy re-written as an upstream Ouro folder: Ouro's config.json keys and
    remote-code pointers, the same tensors (whose names are upstream's), tokenizer and generation config."""
    ours = json.loads((TINY / "config.json").read_text())
    path.mkdir(parents=True)
    config = {"architectures": ["OuroForCausalLM"], "model_type": "ouro",
              "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig",
                           "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
              **{k: ours[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                      "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                                      "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
                                      "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range")},
              "rope_scaling": None, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2,
              "layer_types": ["full_attention"] * 2, "attention_dropout": 0.0, "total_ut_steps": ours["depth"],
              "early_exit_threshold": 1.0, "torch_dtype": "float32", "transformers_version": "4.54.1",
              "use_cache": True}
    (path / "config.json").write_text(json.dumps(config))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TINY / name, path / name)
    return path


def hf_download_record(folder: Path, commit: str) -> None:
    """The per-file metadata `hf download --local-dir` leaves: commit, etag, timestamp."""
    meta = folder / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (meta / f"{name}.metadata").write_text(f"{commit}\netag\n{(folder / name).stat().st_mtime + 5}\n")


@pytest.fixture
def ouro(tmp_path) -> Path:
    return ouro_folder(tmp_path / "Ouro-tiny")


def convert(*args):
    from typer.testing import CliRunner

    from caspo.cli import app

    return CliRunner().invoke(app, ["convert", *map(str, args)])


IDS = torch.tensor([[2, 30, 45, 17, 60, 9]])


def test_an_upstream_folder_loads_as_the_policy_it_holds(ouro):
    shipped = AutoModelForCausalLM.from_pretrained(TINY).eval()
    model = load_policy(str(ouro)).eval()
    assert isinstance(model, LoopedForCausalLM) and (model.config.layout, model.config.depth) == ("ouro", 4)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as the config says
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, shipped(IDS).logits, atol=0, rtol=0)
    assert load_policy(str(ouro), dtype="auto").dtype == torch.float32  # the stored dtype
    assert load_policy(str(ouro), dtype="bfloat16").dtype == torch.bfloat16
    tok = load_tokenizer(ouro)
    assert stop_token_ids(ouro, tok) == stop_token_ids(model, tok) == [1]


def test_an_upstream_folder_gives_the_looped_critic(ouro):
    critic = load_critic(str(ouro)).eval()
    shipped = load_critic(str(TINY)).eval()
    assert isinstance(critic, LoopedForValue) and not critic.score.weight.any()
    with torch.no_grad():  # the same trunk: equal hidden states, so equal values once the heads agree
        torch.testing.assert_close(critic.model(IDS).last_hidden_state, shipped.model(IDS).last_hidden_state,
                                   atol=0, rtol=0)


def test_convert_writes_a_folder_that_loads_with_plain_transformers(ouro, tmp_path):
    hf_download_record(ouro, COMMIT)
    dst = tmp_path / "ouro-looped"
    result = convert(ouro, dst)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{"):])  # after the progress bar of the write
    assert (summary["layout"], summary["depth"], summary["layers"]) == ("ouro", 4, 2)
    assert json.loads((dst / "config.json").read_text())["model_type"] == "caspo_looped"
    record = json.loads((dst / SOURCE_RECORD).read_text())
    assert (record["source"], record["revision"]) == (str(ouro.resolve()), COMMIT)
    converted = AutoModelForCausalLM.from_pretrained(dst).eval()
    with torch.no_grad():
        torch.testing.assert_close(converted(IDS).logits, load_policy(str(ouro)).eval()(IDS).logits, atol=0, rtol=0)
    assert load_tokenizer(dst).encode("7+5=12") == load_tokenizer(ouro).encode("7+5=12")
    assert converted.generation_config.eos_token_id == 1
    assert not (tmp_path / "ouro-looped.partial").exists()
    again = convert(ouro, dst)
    assert again.exit_code == 2 and "exists" in again.output


def test_convert_refuses_unknown_keys_unless_told_and_names_them(ouro, tmp_path):
    config = json.loads((ouro / "config.json").read_text())
    (ouro / "config.json").write_text(json.dumps({**config, "ut_gate_mode": "x"}))
    refused = convert(ouro, tmp_path / "a")
    assert refused.exit_code == 2 and "ut_gate_mode" in refused.output and not (tmp_path / "a").exists()
    told = convert(ouro, tmp_path / "b", "--ignore-key", "ut_gate_mode")
    assert told.exit_code == 0, told.output
    not_upstream = convert(TINY, tmp_path / "c")
    assert not_upstream.exit_code == 2 and "not an upstream" in not_upstream.output


# ---------------------------------------------------------------- model.revision


def test_a_folder_is_checked_against_the_revision_it_records(ouro, tmp_path):
    with pytest.raises(ConfigError, match="records no hub revision.*model.revision=null"):
        resolve_model_path(str(ouro), COMMIT)
    assert resolve_model_path(str(ouro)) == str(ouro)  # not pinned: as it is
    hf_download_record(ouro, COMMIT)
    assert recorded_revision(ouro) == COMMIT
    assert resolve_model_path(str(ouro), COMMIT) == resolve_model_path(str(ouro), COMMIT[:12]) == str(ouro)
    with pytest.raises(ConfigError, match=f"holds hub revision {COMMIT}, but model.revision={OTHER}"):
        resolve_model_path(str(ouro), OTHER)
    snapshot = tmp_path / "models--org--m" / "snapshots" / COMMIT  # a hub-cache snapshot names its commit
    shutil.copytree(TINY, snapshot)
    assert resolve_model_path(str(snapshot), COMMIT) == str(snapshot)
    with pytest.raises(ConfigError, match="ships with caspo"):
        resolve_model_path("embedded:tiny-looped", COMMIT)


def test_mixed_commits_in_one_folder_are_refused(ouro):
    hf_download_record(ouro, COMMIT)
    (ouro / ".cache/huggingface/download/model.safetensors.metadata").write_text(f"{OTHER}\netag\n1e12\n")
    with pytest.raises(ConfigError, match="several hub commits"):
        recorded_revision(ouro)


def test_a_hub_id_resolves_to_the_pinned_snapshot(tmp_path, monkeypatch):
    import huggingface_hub

    cache = tmp_path / "hub"
    snapshot = cache / "models--caspo-tests--tiny" / "snapshots" / COMMIT
    shutil.copytree(TINY, snapshot)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert Path(resolve_model_path("caspo-tests/tiny", COMMIT)) == snapshot
    with pytest.raises(OSError, match=f"hf download caspo-tests/tiny --revision {OTHER} --local-dir DIR"):
        resolve_model_path("caspo-tests/tiny", OTHER)


def test_the_looped_recipe_pins_seed_002s_revision():
    cfg = load_config("looped-recipe")
    assert (cfg.model.policy, cfg.model.revision) == ("/models/Ouro-1.4B", COMMIT)


@pytest.mark.slow
def test_ppo_critic_trains_on_an_upstream_ouro_folder_pinned_at_its_revision(ouro, tmp_path):
    from caspo.train import loop

    hf_download_record(ouro, COMMIT)
    cfg = load_config("tests", [f"model.policy={ouro}", f"model.revision={COMMIT}", "rollout.backend=native",
                                "method.name=ppo_critic", "train.steps=2", f"train.output_dir={tmp_path / 'run'}",
                                "eval.before=false", "eval.after=false", "optim.name=sgd", "optim.lr=1e-3"])
    loop.train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "t_step" in r] == [1, 2]
