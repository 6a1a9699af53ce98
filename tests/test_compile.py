"""train.compile: each decoder block compiled in place gives the eager numbers, and the trainer wires it."""

import copy

import pytest
import torch

from caspo.batch import RolloutBatch
from caspo.config import ConfigError, load_config
from caspo.models.forward import head_compile_backend, response_logprobs
from caspo.models.looped import LoopedForCausalLM
from caspo.models.policy import compile_blocks, load_policy, resolve_model_path, tiny_looped_config
from caspo.models.tokenizer import load_tokenizer
from caspo.rollout.base import Completion
from caspo.train import loop
from caspo.train.step_values import ValueSource, load_value_model

pytestmark = pytest.mark.timeout(240)

EAGER_GRAPH = {"backend": "aot_eager"}  # dynamo's capture and autograd's split, without code generation


def logprobs_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    logp = response_logprobs(model, batch)
    (logp * batch.response_mask).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def tiny_batch():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 20, (n,), generator=g).tolist() for n in (5, 3, 7)]
    completions = [Completion(torch.randint(3, 20, (n,), generator=g).tolist(), [-1.0] * n, "length", 0)
                   for n in (4, 6, 2)]
    return RolloutBatch.from_completions(prompts, completions, group_ids=[0, 0, 1], example_ids=["a", "b", "c"],
                                         sample_seeds=[0, 1, 2], texts=[""] * 3, pad_token_id=0)


def blocks_compiled(model) -> list[bool]:
    return [block._compiled_call_impl is not None for block in model.base_model.layers]


def compiled_copy(model, **options):
    twin = copy.deepcopy(model)
    compile_blocks(twin, **options)
    return twin


def check_matches_eager(model, options, atol, rtol=0.0):
    batch = tiny_batch()
    twin = compiled_copy(model, **options)
    assert all(blocks_compiled(twin))
    assert list(twin.state_dict()) == list(model.state_dict())  # checkpoints and the engine's copy see one model
    logp, grads = logprobs_and_grads(model, batch)
    twin_logp, twin_grads = logprobs_and_grads(twin, batch)
    torch.testing.assert_close(twin_logp, logp, atol=atol, rtol=rtol)
    for name, grad in grads.items():
        torch.testing.assert_close(twin_grads[name], grad, atol=atol, rtol=rtol, msg=name)


def test_compiled_blocks_give_the_eager_logprobs_and_gradients():
    check_matches_eager(load_policy("embedded:tiny-arith"), EAGER_GRAPH, atol=1e-6)


@pytest.mark.slow
def test_inductor_blocks_give_the_eager_logprobs_and_gradients():
    # the code torch.compile generates for the CPU (about a minute of compilation on 2 cores)
    check_matches_eager(load_policy("embedded:tiny-arith"), {}, atol=1e-4, rtol=1e-5)  # fp32 sums in another order


def test_looped_models_are_refused():
    model = LoopedForCausalLM(tiny_looped_config(32, layout="ouro", depth=2, hidden=16, layers=1, heads=2))
    with pytest.raises(ConfigError, match="looped"):
        compile_blocks(model)


def test_the_hf_engine_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="rollout.backend=native"):
        load_config("tests", [f"train.output_dir={tmp_path}", "train.compile=true", "rollout.backend=hf"])


def test_the_trainer_compiles_the_policy_and_its_reference(tmp_path):
    cfg = load_config("tests", [f"train.output_dir={tmp_path}", "method.kl_coef=0.01", "rollout.backend=native",
                                "train.compile=true", "train.compile_backend=aot_eager"])
    tr = loop.build_trainer(cfg)
    with tr.pool:
        for model in (tr.policy, tr.ref):
            assert all(blocks_compiled(model))
            assert head_compile_backend(model) == "aot_eager"  # the chunked head's softmax math too


@pytest.mark.slow
def test_a_step_with_compiled_blocks_is_the_eager_step(tmp_path):
    overrides = ["train.minibatch_size=8", "train.micro_batch_size=2", "eval.before=false", "eval.after=false",
                 "method.kl_coef=0.01", "rollout.backend=native", "train.compile_backend=aot_eager"]
    runs = {}
    for flag in ("false", "true"):
        tr = loop.build_trainer(load_config("tests", [f"train.output_dir={tmp_path / flag}", *overrides,
                                                      f"train.compile={flag}"]))
        with tr.pool:
            batch, stats = loop.outer_step(tr)
        runs[flag] = tr, batch, stats
    (eager, eager_batch, eager_stats), (compiled, batch, stats) = runs["false"], runs["true"]
    for model in (compiled.policy, compiled.ref):  # the policy and its reference: the update's two forwards
        assert all(blocks_compiled(model))
    assert not any(blocks_compiled(eager.policy)) and head_compile_backend(eager.policy) is None
    assert torch.equal(batch.responses, eager_batch.responses)
    torch.testing.assert_close(batch.ref_logprobs, eager_batch.ref_logprobs, atol=1e-6, rtol=0)
    for p, q in zip(compiled.policy.parameters(), eager.policy.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    assert stats["kl"] == pytest.approx(eager_stats["kl"], abs=1e-7)


@pytest.mark.gpu
def test_inductor_blocks_on_cuda_under_bf16_autocast():
    from caspo.precision import autocast

    model = load_policy("embedded:tiny-arith", "cuda")
    twin = compiled_copy(model)
    batch = tiny_batch().to("cuda")
    with autocast("bf16", torch.device("cuda")):
        logp, grads = logprobs_and_grads(model, batch)
        twin_logp, twin_grads = logprobs_and_grads(twin, batch)
    torch.testing.assert_close(twin_logp, logp, atol=1e-2, rtol=1.6e-2)  # bf16 rounding, in another order
    flat = torch.cat([g.flatten() for g in grads.values()])
    twin_flat = torch.cat([twin_grads[n].flatten() for n in grads])
    assert torch.nn.functional.cosine_similarity(flat, twin_flat, dim=0) > 0.999


def test_caspo_value_model_and_its_reference_are_compiled():
    overrides = ["method.name=caspo", "method.caspo.value_model=embedded:tiny-arith-slips-value",
                 "rollout.backend=native", "train.compile_backend=aot_eager"]
    batch = tiny_batch()
    values = {}
    for flag in ("false", "true"):
        cfg = load_config("arith-slips", [*overrides, f"train.compile={flag}"])
        policy = load_policy(cfg.model.policy)
        source = ValueSource(cfg.method.caspo.value_model, cfg.model.policy)
        model = load_value_model(cfg, load_tokenizer(resolve_model_path(cfg.model.policy)), source, policy, "cpu")
        compiled = blocks_compiled(model.policy) + blocks_compiled(model.reference)
        assert all(compiled) if flag == "true" else not any(compiled)
        with torch.no_grad():
            values[flag] = model.log_ratios(batch)
    torch.testing.assert_close(values["true"], values["false"], atol=1e-6, rtol=0)
    assert values["false"].abs().max() > 0  # φ is not its reference: the ratios compared are not all 0


def tiny_qwen2(hidden: int = 32, layers: int = 2):
    from transformers import Qwen2ForCausalLM

    from caspo.models.policy import tiny_qwen2_config

    return Qwen2ForCausalLM(tiny_qwen2_config(64, hidden=hidden, layers=layers, heads=4))


def counting_backend(graphs: list):
    """A torch.compile backend that records each graph dynamo builds and runs it as captured."""
    def counting(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward
    return counting


def graphs_built(model, rows: int, length: int, padded: bool = False) -> int:
    """The graphs dynamo builds for one forward and backward of a [rows, length] micro-batch (`padded`: two
    columns of left padding in its first row, as padded batches have)."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    mask = None
    if padded:
        mask = torch.ones(rows, length, dtype=torch.long)
        mask[0, :2] = 0
    ids = torch.randint(0, 64, (rows, length))
    model(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum().backward()
    return counters["stats"]["unique_graphs"] - before


def test_the_blocks_share_their_graphs():
    """Twelve blocks, more than dynamo's recompile limit of 8 per code object: were each block a graph of its
    own, the later ones would run eager. Called as the trainer calls them (no KV cache, whose per-layer state
    dynamo would guard on), they compile the graphs one block does: one per grad mode."""
    def graphs_of(layers):
        torch._dynamo.reset()
        graphs = []
        model = tiny_qwen2(layers=layers)
        compile_blocks(model, backend=counting_backend(graphs))
        ids = torch.randint(0, 64, (2, 9))
        with torch.no_grad():
            model.base_model(input_ids=ids, use_cache=False)
        model.base_model(input_ids=ids, use_cache=False).last_hidden_state.sum().backward()
        return len(graphs)

    assert graphs_of(1) == graphs_of(12) == 2


def test_the_blocks_code_compiles_past_dynamos_default_limit():
    """Ten models of other widths share the blocks' code object, each needing a graph of its own: all ten are
    compiled (dynamo's default limit, 8, would run the ninth and tenth eagerly)."""
    torch._dynamo.reset()
    graphs = []
    for width in range(8, 88, 8):
        model = tiny_qwen2(hidden=width, layers=1)
        compile_blocks(model, backend=counting_backend(graphs))
        with torch.no_grad():
            model.base_model(input_ids=torch.randint(0, 64, (2, 9)), use_cache=False)
    assert len(graphs) == 10


def test_new_lengths_and_row_counts_compile_no_new_graph():
    """After the first micro-batch, others of new lengths and row counts run through the same graphs; only a
    micro-batch of one row (a size dynamo always specialises) builds its own."""
    torch._dynamo.reset()
    model = tiny_qwen2()
    compile_blocks(model, **EAGER_GRAPH)
    assert graphs_built(model, 6, 20, padded=True) > 0
    assert [graphs_built(model, rows, length, padded=True) for rows, length in [(6, 31), (5, 17), (3, 40)]] == [0, 0, 0]
    assert graphs_built(model, 1, 12, padded=True) > 0


def test_a_first_micro_batch_at_the_models_own_sizes_is_not_taken_as_fixed():
    """Rows = head_dim (8) and length = hidden size (32) in the first micro-batch: with sizes unified as dynamo
    does by default, they would be compiled as those fixed sizes and the next micro-batch would compile again."""
    torch._dynamo.reset()
    model = tiny_qwen2()
    compile_blocks(model, **EAGER_GRAPH)
    built = [graphs_built(model, rows, length) for rows, length in [(8, 32), (8, 33), (5, 32), (3, 17)]]
    assert built[0] > 0 and built[1:] == [0, 0, 0]


def test_inductor_blocks_fuse_the_norms_backward_at_any_size(monkeypatch):
    """Inductor fuses the norms' backward reductions only above a size, a guard on the micro-batch's rows ×
    length (seen on a card: a graph for each side of it); the blocks compile without that test. Other backends
    take no inductor options."""
    from torch._inductor import config as inductor_config

    from caspo.models.policy import MIX_ORDER_AT_ANY_SIZE

    if not hasattr(inductor_config.triton, MIX_ORDER_AT_ANY_SIZE.split(".")[1]):
        pytest.skip("this torch has no mix-order reductions")
    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: calls.append(kwargs))
    compile_blocks(tiny_qwen2(layers=2))
    compile_blocks(tiny_qwen2(layers=1), **EAGER_GRAPH)
    flag = {MIX_ORDER_AT_ANY_SIZE: True}
    assert calls == [{"dynamic": True, "options": flag}] * 2 + [{"dynamic": True, "backend": "aot_eager"}]
