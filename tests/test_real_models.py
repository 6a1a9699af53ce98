"""Models and tokenizers as users have them: hub ids and folders, every EOS id, BOS as the tokenizer adds it,
the chat template, and the public configs of the recipes' base policies in the native runner."""

import json
from pathlib import Path

import huggingface_hub
import pytest
import torch
from bpe_fixtures import ENDOFTEXT, IM_END, IM_START
from transformers import AutoConfig

from caspo.config import ConfigError, load_config
from caspo.data.build import encode
from caspo.data.examples import Example
from caspo.models.policy import load_policy, stop_token_ids
from caspo.models.tokenizer import build_char_tokenizer, load_tokenizer
from caspo.rollout.base import Request, SamplingParams
from caspo.rollout.factory import sampling_params
from caspo.rollout.hf import HFEngine
from caspo.rollout.native import NativeEngine, UnsupportedModelError, decoder_spec

CONFIGS = Path(__file__).parent / "model_configs"
QUERY = "What is $\\frac{1}{2} + 1$?"


@pytest.fixture(scope="module")
def tokenizers(real_models):
    return {"qwen": load_tokenizer(real_models.qwen), "llama": load_tokenizer(real_models.llama)}


# ---------------------------------------------------------------- hub ids and folders


def test_fixture_folders_load_as_policies(real_models, tokenizers):
    for name in ("qwen", "llama"):
        model = load_policy(str(getattr(real_models, name)))
        assert model.config.vocab_size >= len(tokenizers[name]) and model.config.hidden_size == 32
        assert model.generation_config.eos_token_id in ([IM_END, ENDOFTEXT], [ENDOFTEXT, IM_END])
    assert load_policy(str(real_models.qwen)).config.tie_word_embeddings


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_a_missing_hub_model_names_the_download_command(offline):
    spec = "caspo-tests/no-such-model"
    for load in (load_policy, load_tokenizer):  # through from_pretrained, offline
        with pytest.raises(OSError, match=f"`hf download {spec} --local-dir DIR`") as err:
            load(spec)
        assert "did not load from the Hugging Face hub" in str(err.value) and "\n" not in str(err.value)


def test_a_missing_folder_says_so(tmp_path, offline):
    for spec in (str(tmp_path / "nope"), "./runs/nope/export"):
        with pytest.raises(FileNotFoundError, match="no such folder"):
            load_policy(spec)


# ---------------------------------------------------------------- stop ids


def test_stop_ids_are_every_eos_of_the_generation_config(real_models, tokenizers):
    for name in ("qwen", "llama"):
        folder, tok = getattr(real_models, name), tokenizers[name]
        assert tok.eos_token_id == ENDOFTEXT
        assert stop_token_ids(folder, tok) == stop_token_ids(load_policy(str(folder)), tok) == [ENDOFTEXT, IM_END]
        cfg = load_config("tests", [f"model.policy={folder}"])
        assert sampling_params(cfg, tok).stop_token_ids == [ENDOFTEXT, IM_END]
    char = build_char_tokenizer()
    assert sampling_params(load_config("tests"), char).stop_token_ids == [char.eos_token_id]  # embedded: one EOS


def test_a_chat_prompt_stops_at_the_end_of_the_assistants_turn(real_models, tokenizers, tmp_path):
    """A base model's generation config names only <|endoftext|> (Qwen2.5-Math-1.5B's does); its completions of
    chat prompts still end at the <|im_end|> the chat template writes after an assistant's message."""
    import shutil

    base = shutil.copytree(real_models.qwen, tmp_path / "base")
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": ENDOFTEXT}))
    tok = tokenizers["qwen"]
    plain = load_config("tests", [f"model.policy={base}", "data.template=qwen-boxed"])
    assert sampling_params(plain, tok).stop_token_ids == [ENDOFTEXT]
    chat = load_config("tests", [f"model.policy={base}", "data.template=chat"])
    assert sampling_params(chat, tok).stop_token_ids == [ENDOFTEXT, IM_END]
    char = build_char_tokenizer()  # no chat template: its EOS and the folder's
    assert sampling_params(chat, char).stop_token_ids == [char.eos_token_id, ENDOFTEXT]


def test_a_folder_without_a_config_has_no_stop_ids_to_guess(tmp_path, tokenizers):
    (tmp_path / "weights").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        stop_token_ids(tmp_path / "weights", tokenizers["qwen"])


def always_im_end(model):
    """The Llama fixture rewired so that greedy decoding emits <|im_end|> at every step."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()  # the residual stream is the token's embedding
        model.model.embed_tokens.weight[:, 0] = model.model.embed_tokens.weight[:, 0].abs() + 0.1
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[IM_END, 0] = 10.0
    return model.eval()


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_generation_stops_on_the_second_eos(real_models, tokenizers, backend):
    tok = tokenizers["llama"]
    model = always_im_end(load_policy(str(real_models.llama)))
    engine = HFEngine(model, pad_token_id=tok.pad_token_id) if backend == "hf" else \
        NativeEngine(model, max_seq_len=32, capacity_tokens=128)
    prompts = [Request(tok.encode("Hello world"), seed=0, max_new_tokens=6)]
    only_tokenizer_eos = engine.generate(prompts, SamplingParams(temperature=0.0, stop_token_ids=[tok.eos_token_id]))
    assert (only_tokenizer_eos[0].tokens, only_tokenizer_eos[0].finish_reason) == ([IM_END] * 6, "length")
    every_eos = engine.generate(prompts, SamplingParams(temperature=0.0,
                                                        stop_token_ids=stop_token_ids(real_models.llama, tok)))
    assert (every_eos[0].tokens, every_eos[0].finish_reason) == ([IM_END], "stop")


# ---------------------------------------------------------------- BOS and the chat template


def encoded(folder, tok, *overrides):
    cfg = load_config("tests", [f"model.policy={folder}", "data.max_prompt_tokens=128", *overrides])
    return encode(cfg, tok, [Example(id="q", query=QUERY, label="3/2")])[0]


def test_bos_follows_the_tokenizer(real_models, tokenizers):
    qwen, llama = tokenizers["qwen"], tokenizers["llama"]
    body = qwen.encode(f"{QUERY}\nSolution:\n", add_special_tokens=False)
    assert encoded(real_models.qwen, qwen) == body  # Qwen adds no BOS
    assert encoded(real_models.llama, llama) == [llama.bos_token_id] + body  # Llama adds one
    assert encoded(real_models.llama, llama, "data.add_bos=false") == body
    assert encoded(real_models.llama, llama, "data.add_bos=true") == [llama.bos_token_id] + body
    with pytest.raises(ValueError, match="no BOS token"):
        encoded(real_models.qwen, qwen, "data.add_bos=true")


def test_chat_template_prompts(real_models, tokenizers):
    qwen, llama = tokenizers["qwen"], tokenizers["llama"]
    rendered = qwen.apply_chat_template([{"role": "user", "content": QUERY}], add_generation_prompt=True,
                                        tokenize=False)
    assert rendered.endswith(f"<|im_start|>user\n{QUERY}<|im_end|>\n<|im_start|>assistant\n")
    ids = encoded(real_models.qwen, qwen, "data.template=chat")
    assert ids == qwen.encode(rendered, add_special_tokens=False)
    assert ids[0] == IM_START and ids.count(IM_START) == 3 and ids.count(IM_END) == 2
    assert encoded(real_models.llama, llama, "data.template=chat") == [llama.bos_token_id] + ids
    llama.chat_template = "{{ bos_token }}" + llama.chat_template  # a template that writes BOS itself
    try:
        assert encoded(real_models.llama, llama, "data.template=chat") == [llama.bos_token_id] + ids
    finally:
        llama.chat_template = qwen.chat_template


def test_chat_template_needs_a_tokenizer_that_has_one(real_models):
    with pytest.raises(ValueError, match="has no chat template"):
        encoded(real_models.qwen, build_char_tokenizer(), "data.template=chat")


# ---------------------------------------------------------------- the native runner and public configs


def public_config(name: str, tmp_path: Path, **changes):
    raw = {**json.loads((CONFIGS / f"{name}.json").read_text()), **changes}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return AutoConfig.from_pretrained(tmp_path)  # as the engine reads a checkpoint folder


def test_public_configs_load_into_the_spec(tmp_path):
    qwen = decoder_spec(public_config("Qwen2.5-Math-1.5B", tmp_path))
    assert (qwen.family, qwen.num_layers, qwen.num_heads, qwen.num_kv_heads, qwen.head_dim) == ("qwen2", 28, 12, 2, 128)
    assert qwen.tie_word_embeddings and qwen.qkv_bias and qwen.rope_type == "default"
    assert float(qwen.rope_inv_freq[1]) == pytest.approx(10000 ** (-2 / 128))
    rho = decoder_spec(public_config("rho-1b-sft-MATH", tmp_path))
    assert (rho.family, rho.num_layers, rho.num_heads, rho.num_kv_heads, rho.head_dim) == ("llama", 22, 32, 4, 64)
    assert not rho.tie_word_embeddings and not rho.qkv_bias and rho.rms_norm_eps == 1e-5


@pytest.mark.parametrize("name, changes, key", [
    ("Qwen2.5-Math-1.5B", {"use_sliding_window": True}, "use_sliding_window"),
    ("Qwen2.5-Math-1.5B", {"use_mrope": True}, "use_mrope"),
    ("Qwen2.5-Math-1.5B", {"hidden_act": "gelu"}, "hidden_act"),
    ("rho-1b-sft-MATH", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ("rho-1b-sft-MATH", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 32,
                                          "long_factor": [1.0] * 32}}, "rope_type='longrope'"),
    ("rho-1b-sft-MATH", {"attention_bias": True}, "attention_bias"),
])
def test_an_unsupported_public_config_value_names_the_field(tmp_path, name, changes, key):
    with pytest.raises(UnsupportedModelError, match=key):
        decoder_spec(public_config(name, tmp_path, **changes))


def test_a_config_key_the_runner_does_not_read_is_refused(monkeypatch, tmp_path):
    from caspo.rollout.native import spec

    monkeypatch.setattr(spec, "INERT", spec.INERT - {"pretraining_tp"})
    with pytest.raises(UnsupportedModelError, match="pretraining_tp=1 .* does not read"):
        decoder_spec(public_config("rho-1b-sft-MATH", tmp_path))


def test_a_tokenizer_without_pad_pads_with_eos(real_models, tmp_path):
    import shutil

    folder = shutil.copytree(real_models.llama, tmp_path / "nopad")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    special = folder / "special_tokens_map.json"
    if special.exists():
        special.write_text(json.dumps({k: v for k, v in json.loads(special.read_text()).items() if k != "pad_token"}))
    tok = load_tokenizer(folder)
    assert tok.pad_token_id == tok.eos_token_id == ENDOFTEXT


def test_a_model_folder_without_tokenizer_files_says_so(real_models, tmp_path):
    import shutil

    folder = tmp_path / "weights_only"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(real_models.qwen / name, folder / name)
    with pytest.raises(ConfigError, match="holds no tokenizer .*tokenizer.save_pretrained"):
        load_tokenizer(folder)


def test_a_model_that_is_not_a_causal_lm_says_so(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 8, "num_layers": 1,
                                                      "num_heads": 1, "d_kv": 8, "d_ff": 8, "vocab_size": 10}))
    with pytest.raises(ConfigError, match="is a 't5' model, not a causal LM"):
        load_policy(str(tmp_path))
