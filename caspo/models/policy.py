"""Load policies and the ids that end their completions; build the tiny Qwen2-architecture policy.

A model spec is a checkpoint folder, a hub id, or "embedded:<name>" for a policy that
ships inside the package (`caspo/assets/<name>`), so the default job needs nothing
downloaded or trained first. A hub id that is neither cached nor reachable is an error
naming the download command (docs/models.md). `model.revision` pins a hub id to a commit's
snapshot and checks a folder's recorded commit (`caspo.models.hub`). An upstream Ouro or
Nanbeige4.2 folder is converted to the looped model on load (`caspo.models.looped_upstream`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig, Qwen2Config

import caspo.models.looped  # noqa: F401  registers the looped LM with the Auto classes
from caspo.config import ConfigError
from caspo.models.forward import compile_head
from caspo.models.hub import check_revision, hub_errors, hub_snapshot, looks_like_folder
from caspo.models.looped_upstream import load_upstream, upstream_config

ASSETS = Path(__file__).resolve().parent.parent / "assets"
EMBEDDED = "embedded:"


def resolve_model_path(spec: str, revision: str | None = None) -> str:
    """The folder or hub id to load `spec` from. With `revision`: a hub id becomes the local snapshot of that
    commit, and a folder must record it (`caspo.models.hub.check_revision`)."""
    if revision and spec.startswith(EMBEDDED):
        raise ConfigError(f"model.revision={revision} pins a hub commit, and {spec} ships with caspo; "
                          "set model.revision=null")
    if revision:
        if looks_like_folder(spec):
            check_revision(spec, revision)
            return spec
        return hub_snapshot(spec, revision)
    if spec.startswith(EMBEDDED):
        name = spec[len(EMBEDDED):]
        path = ASSETS / name
        if not (path / "config.json").exists():
            shipped = sorted(p.name for p in ASSETS.iterdir() if (p / "config.json").exists()) \
                if ASSETS.exists() else []
            raise FileNotFoundError(
                f"no embedded policy {name!r} (shipped: {', '.join(shipped) or 'none'}); "
                "`caspo sft` creates one, see the README"
            )
        return str(path)
    return spec


def load_policy(spec: str, device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32):
    """A causal LM from `spec`; an upstream Ouro / Nanbeige4.2 folder is converted to the looped model.
    On CUDA, attention then runs without cuDNN (`attention_without_cudnn`). On the meta device: the model's
    skeleton, no weights read (a rank of a sharded run other than the one that reads them, `fsdp.read_device`)."""
    device = torch.device(device)
    if device.type == "cuda":
        attention_without_cudnn()
    path = resolve_model_path(spec)
    if upstream_config(path) is not None:
        if isinstance(dtype, str):  # as from_pretrained: "auto" keeps the checkpoint's dtypes
            dtype = None if dtype == "auto" else getattr(torch, dtype)
        return load_upstream(path, dtype=dtype, weights=device.type != "meta").to(device)
    if device.type == "meta":
        return skeleton(path, dtype)
    with hub_errors(path):
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except ValueError as err:
            if "Unrecognized configuration class" not in str(err):
                raise
            kind = PretrainedConfig.get_config_dict(path)[0].get("model_type")
            raise ConfigError(f"model {spec!r} is a {kind!r} model, not a causal LM; pass a checkpoint that "
                              "AutoModelForCausalLM loads (a *ForCausalLM architecture)") from None
    return model.to(device)


def skeleton(path: str, dtype: torch.dtype | str = torch.float32) -> torch.nn.Module:
    """The causal LM of folder `path` as `from_pretrained` builds it, on the meta device: its parameters'
    names, shapes and dtypes and its generation config (its EOS ids end completions), no weights."""
    with hub_errors(path):
        config = AutoConfig.from_pretrained(path)
    if isinstance(dtype, str):
        dtype = config.dtype if dtype == "auto" else getattr(torch, dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    try:
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:  # none saved: from_pretrained derives it from the config too
        pass
    return model


def is_skeleton(model: torch.nn.Module) -> bool:
    """Whether `model` was built on the meta device: it has a structure and no weights."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The model with its parameters, not its buffers, in `dtype`, as `from_pretrained(..., dtype=dtype)` loads
    it: `model.to(dtype)` would also round RoPE's float32 `inv_freq` (0.56234 -> 0.5625), moving every position's
    rotation away from the policy the trainer computes."""
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


def attention_without_cudnn() -> None:
    """Leave cuDNN out of the backends of PyTorch's scaled_dot_product_attention, for the whole process: padded
    batches then take the memory-efficient kernel, unpadded ones (the trainer's, `forward.response_states`) flash.
    cuDNN builds an execution graph for every new input shape, and each micro-batch, scoring pass and prefill
    brings new shapes: on an H200 the builds took 1.0 ms of host time per forward call and 1.7 ms per backward,
    8 s of a 29 s step."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def stop_token_ids(source: str | Path | torch.nn.Module, tokenizer) -> list[int]:
    """Every id that ends a completion: the EOS ids of the model's generation config (Qwen's chat models
    have two), else of its config, and the tokenizer's EOS. `source` is a loaded model or a model spec."""
    if isinstance(source, torch.nn.Module):
        config = getattr(source, "generation_config", None) or source.config
        found = config.eos_token_id
    else:
        found = _eos_of_folder(resolve_model_path(str(source)))
    ids = found if isinstance(found, (list, tuple)) else [found]
    return sorted({int(i) for i in [*ids, tokenizer.eos_token_id] if i is not None})


def _eos_of_folder(path: str):
    """generation_config.json's eos_token_id, else config.json's; read from the folder or the hub cache."""
    try:
        return GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
    except OSError:
        pass
    try:
        config = PretrainedConfig.get_config_dict(path, local_files_only=True)[0]
    except OSError:
        config = {}
    if not config:  # transformers reads a folder without config.json as {}
        raise ConfigError(f"no config.json for {path}, so its EOS ids are unknown: download the model "
                          "(`hf download ID --local-dir DIR`) and set model.policy=DIR")
    return config.get("eos_token_id")


def tiny_qwen2_config(vocab_size: int, *, hidden: int = 128, layers: int = 4, heads: int = 4,
                      kv_heads: int = 4, intermediate: int = 256, max_positions: int = 512,
                      bos_token_id: int | None = None, eos_token_id: int | None = None,
                      pad_token_id: int | None = None) -> Qwen2Config:
    """A Qwen2 causal LM of about 0.5–1 M parameters with tied embeddings."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def enable_recompute(model: torch.nn.Module, every: int = 1) -> None:
    """Checkpoint every block (every block of every loop, for a looped model), non-reentrant. With every = n > 1,
    only blocks 0, n, 2n, ... of a causal LM's `layers` (torchtitan's selective layer checkpointing): a block left
    out keeps its activations and is not run again in the backward."""
    from caspo.models.looped import LoopedPreTrainedModel

    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"{type(model).__name__} does not support train.activation_checkpointing=true; "
                          "set it to false")
    enable = getattr(model, "activation_checkpointing_enable", None)  # the newer transformers name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if every == 1:
        return
    layers = getattr(model.base_model, "layers", None)
    if (isinstance(model, LoopedPreTrainedModel) or not isinstance(layers, torch.nn.ModuleList)
            or not all(getattr(layer, "gradient_checkpointing", False) for layer in layers)):
        raise ConfigError(f"train.activation_checkpointing_every={every} needs a causal LM whose `layers` are "
                          f"checkpointed block by block; {type(model).__name__} is not: set it to 1")
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index % every == 0


def recompute_if_asked(train_cfg, model: torch.nn.Module) -> None:
    """enable_recompute(model, train.activation_checkpointing_every) when train.activation_checkpointing is set."""
    if train_cfg.activation_checkpointing:
        enable_recompute(model, train_cfg.activation_checkpointing_every)


# Graphs dynamo may build for one code object before it runs new shapes of it eagerly, with only a logged
# warning. Every model's blocks share one (policy, reference, critic, φ; each in two grad modes, with a
# one-row micro-batch's graph and, on CUDA, inductor's graphs per length alignment): more than the default 8.
BLOCK_GRAPH_LIMIT = 64


MIX_ORDER_AT_ANY_SIZE = "triton.mix_order_reduction_non_strict_mode"  # the inductor option compile_blocks sets


def compile_blocks(model: torch.nn.Module, **options) -> None:
    """torch.compile each decoder block in place (`options` go to `nn.Module.compile`), so the element-wise
    work between its GEMMs (RMSNorm, SiLU · up, residual adds, autocast's casts) runs fused, and the softmax
    math of the chunked LM head (`caspo.models.forward.compile_head`) with the same backend. Parameter
    names and the state dict are unchanged. Called without a KV cache (as the trainer calls them), the blocks
    share one compiled graph per grad mode; a cache's per-layer state would make a graph per block.

    The blocks compile with dynamic shapes from their first call: micro-batches of other row counts and
    lengths reuse the graph. (Left to dynamo's default, the first graph is specialised to its shapes and
    the first new length, then the first new row count, each compile the block again, mid-run.) Sizes are
    not unified ("duck sizing", off for the whole process): it would take a first micro-batch whose row count
    or length equals one of the model's sizes (a length of 1,536 at Qwen2.5-1.5B's width) as that fixed size,
    and compile again at the next. A micro-batch of one row still gets a graph of its own; the trainer's
    micro-batches avoid one where they can (`caspo.batch.plan_micro_batches`). Inductor adds guards of its
    own on CUDA: whether the norms' backward reductions are large enough to fuse (rows × length against a
    threshold; the blocks compile with `mix_order_reduction_non_strict_mode`, which fuses at any size and tests
    nothing), and whether the length is a multiple of 8 (which `forward.response_states` makes every length).
    Dynamo may build up to BLOCK_GRAPH_LIMIT graphs of one code object, for the whole process too (its
    default is 8)."""
    from torch._inductor import config as inductor_config
    from torch.fx.experimental import _config as shapes_config

    from caspo.models.looped import LoopedPreTrainedModel

    if isinstance(model, LoopedPreTrainedModel):  # a block's call takes its loop index: one graph per index
        raise ConfigError(f"train.compile=true does not support looped models ({type(model).__name__}); set it "
                          "to false")
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(f"{type(model).__name__} has no `layers` list of decoder blocks to compile; set "
                          "train.compile=false")
    shapes_config.use_duck_shape = False  # read when a graph is compiled, at its first call
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, BLOCK_GRAPH_LIMIT)
    if options.get("backend", "inductor") == "inductor" and hasattr(inductor_config.triton,
                                                                    MIX_ORDER_AT_ANY_SIZE.split(".")[1]):
        # fuse the norms' backward reductions at any size: their size test is a guard, a graph per side of it
        options = {**options, "options": {MIX_ORDER_AT_ANY_SIZE: True, **options.get("options", {})}}
    for block in layers:
        block.compile(**{"dynamic": True, **options})
    compile_head(model, options.get("backend", "inductor"))


def compile_if_asked(train_cfg, *models: torch.nn.Module | None) -> None:
    """compile_blocks of each model given (None skipped) when train.compile is set, with train.compile_backend."""
    if train_cfg.compile:
        for model in models:
            if model is not None:
                compile_blocks(model, backend=train_cfg.compile_backend)


def tiny_looped_config(vocab_size: int, *, layout: str, depth: int, hidden: int = 128, layers: int = 2,
                       heads: int = 4, intermediate: int = 256, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None):
    from caspo.models.looped import LoopedConfig

    return LoopedConfig(layout=layout, depth=depth, vocab_size=vocab_size, hidden_size=hidden,
                        intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=heads, max_position_embeddings=512, tie_word_embeddings=True,
                        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)


def resolve_device(device: str, setting: str = "model.device") -> torch.device:
    """The torch device of a device string (cpu, cuda, cuda:N, or auto: cuda when one is visible). `setting`
    names where the string came from in the messages: a config key (model.device) or a flag (--device)."""
    from caspo.config.validate import DEVICE  # the config's own rule for model.device

    is_ = " " if setting.startswith("-") else "="  # `--device cuda`, `model.device=cuda`
    if not DEVICE.fullmatch(device):
        raise ConfigError(f"{setting}{is_}{device!r}: use cpu, cuda, cuda:N (a GPU's index) or auto "
                          "(cuda when available)")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{setting}{is_}{device} but no CUDA device is visible; use {setting}{is_}cpu")
    return torch.device(device)
