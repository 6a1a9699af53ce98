"""The benchmarks' planted policy (benchmarks/_common.plant_rates): a random model writes the planted tokens at
the planted rates, which the step-level trainer smokes rely on for their step boundaries and lengths."""

import argparse
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from _common import (  # noqa: E402
    add_model_args,
    add_peak_args,
    build_model,
    environment,
    mfu_shares,
    plant_rates,
    planted_learning_rate,
    text_rates,
)


@pytest.mark.parametrize("hidden, layers, dtype", [(64, 4, torch.float32), (1536, 2, torch.bfloat16)])
def test_planted_tokens_come_at_their_rates_whatever_the_context(hidden, layers, dtype):
    """Also at the 1.5B width in bf16, as the engine samples: the random layers must not drown column 0, and
    the planted offsets must survive bf16 rounding."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=2000, hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config).eval()
    rates = {7: 0.1, 11: 0.02}
    plant_rates(model, rates)
    model.to(dtype)
    contexts = torch.randint(0, 2000, (16, 24))
    with torch.no_grad():
        probs = torch.softmax(model(contexts).logits.float(), -1)  # every position of 64 random contexts
    for token, rate in rates.items():
        assert probs[..., token].mean().item() == pytest.approx(rate, rel=0.1)
        assert probs[..., token].std().item() < 0.2 * rate  # nearly the same at every position
    rest = probs.clone()
    rest[..., list(rates)] = 0
    assert rest.max().item() < 5 / 2000  # the other tokens stay near-uniform


def planted_model(hidden, layers, vocab=2000, rates=None):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    plant_rates(model, rates or {7: 0.1})
    return model


def rate_after_one_adam_step(lr):
    model = planted_model(1536, 2)
    contexts = torch.randint(0, 2000, (4, 12), generator=torch.Generator().manual_seed(1))

    def rate():
        with torch.no_grad():
            return torch.softmax(model(contexts).logits.float(), -1)[..., 7].mean().item()

    before = rate()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model(contexts, labels=contexts).loss.backward()
    optimizer.step()
    return before, rate()


def test_the_planted_learning_rate_keeps_the_rates_where_the_usual_one_moves_them():
    """Adam moves each parameter by about lr in its first step; the planted final-norm weight is ~1e-6 wide."""
    model = planted_model(1536, 2)
    assert planted_learning_rate(model) == pytest.approx(1e-3 * float(model.get_decoder().norm.weight[0]))
    before, after = rate_after_one_adam_step(planted_learning_rate(model))
    assert after == pytest.approx(before, rel=0.01)
    before, after = rate_after_one_adam_step(1e-6)  # the smokes' usual rate: the planted rate is gone
    assert abs(after / before - 1) > 0.1


def test_planted_text_gives_the_newline_splitter_its_lines():
    """Over the Qwen-sized vocabulary a random model writes ids the character tokenizer decodes to nothing: the
    planted visible characters make lines of text, one step each."""
    from caspo.models.policy import resolve_model_path
    from caspo.models.tokenizer import load_tokenizer
    from caspo.segment import newline_step_starts

    tokenizer = load_tokenizer(resolve_model_path("embedded:tiny-arith"))
    newline = tokenizer.convert_tokens_to_ids("\n")
    text = text_rates(tokenizer, 0.5)
    assert sum(text.values()) == pytest.approx(0.5)
    assert newline not in text and tokenizer.eos_token_id not in text
    assert all(tokenizer.decode([i]).strip() for i in text)
    model = planted_model(64, 4, rates=text | {newline: 0.05}).eval()
    with torch.no_grad():
        probs = torch.softmax(model(torch.randint(0, 2000, (1, 8))).logits[0, -1].float(), -1)
    ids = torch.multinomial(probs, 2000, replacement=True, generator=torch.Generator().manual_seed(0)).tolist()
    decoded = tokenizer.decode(ids)
    lines = decoded.count("\n")
    assert lines > 50  # ~100 planted newlines
    assert len(newline_step_starts(decoded)) > 0.8 * lines  # lines hold text: nearly every one is a step


def test_planting_needs_tied_embeddings():
    config = Qwen2Config(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="tied embeddings"):
        plant_rates(AutoModelForCausalLM.from_config(config), {3: 0.1})


def test_logit_scale_multiplies_a_random_models_logits():
    shape = dict(device="cpu", dtype="float32", hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=300,
                 seed=0, policy="")
    plain = build_model(argparse.Namespace(**shape, logit_scale=1.0))
    peaked = build_model(argparse.Namespace(**shape, logit_scale=8.0))
    tokens = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(peaked(tokens).logits, 8 * plain(tokens).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="random model"):
        build_model(argparse.Namespace(**{**shape, "policy": "embedded:tiny-arith"}, logit_scale=8.0))


def test_step_ratios_divide_each_last_step_by_grpos_and_caspos():
    from trainer_smoke import step_ratios

    rows = step_ratios({"grpo": 10.0, "ppo_critic": 14.0, "caspo": 13.0, "vineppo": 26.0})
    assert rows == [["grpo", "10.0", "1.00", "0.77"], ["ppo_critic", "14.0", "1.40", "1.08"],
                    ["caspo", "13.0", "1.30", "1.00"], ["vineppo", "26.0", "2.60", "2.00"]]
    assert step_ratios({"vineppo": 26.0, "caspo": 13.0}) == [["vineppo", "26.0", "2.00"], ["caspo", "13.0", "1.00"]]


# ---------------------------------------------------------------- memory_growth: the per-step diff of live blocks

from memory_growth import live_blocks, net_by_site, report, site  # noqa: E402


def snapshot(blocks, pool=(0, 0)):
    """A `torch.cuda.memory._snapshot()`-shaped dict: one segment holding (address, size, state, file, line)."""
    return {"segments": [{"segment_pool_id": pool, "blocks": [
        {"address": a, "size": s, "state": state,
         "frames": [{"filename": "/x/torch/cuda/memory.py", "line": 1, "name": "alloc"},
                    {"filename": f"/r/caspo/{f}", "line": line, "name": "fn"}]}
        for a, s, state, f, line in blocks]}]}


def test_growth_names_the_site_that_keeps_a_block_every_step_and_not_the_one_that_replaces_its_own():
    mib = 2**20
    # every step: the batch (site a.py:1) is replaced by one of another size; b.py:2 keeps one more block
    steps = [live_blocks(snapshot([(100 + i, (10 + i) * mib, "active_allocated", "a.py", 1),
                                   *((200 + j, 3 * mib, "active_allocated", "b.py", 2) for j in range(i)),
                                   (300, 50 * mib, "inactive", "c.py", 3)]))
             for i in range(4)]
    assert 300 not in steps[0]  # a freed (cached) block is not held
    assert net_by_site(steps[1], steps[2]) == {"a.py:1 fn": mib, "b.py:2 fn": 3 * mib}
    text = report(steps)
    assert text.splitlines()[3].split() == ["3", "0.018", "+0.004"]  # 12 + 6 MiB after 11 + 3: +4 MiB
    rising = text.split("steps 3..4:")[1].splitlines()[1:]
    assert rising[0].split()[0] == "+6.0" and rising[0].endswith("b.py:2 fn")  # 3 MiB in each of steps 3 and 4
    assert rising[1].endswith("a.py:1 fn")


def test_blocks_of_a_graph_pool_are_named_as_such():
    live = live_blocks(snapshot([(1, 8, "active_allocated", "graphs.py", 9)], pool=(1, 2)))
    assert live[1] == (8, "graphs.py:9 fn [graph pool (1, 2)]")
    # a compiled block's backward, on autograd's thread: no project frame, so inductor's file names it
    inductor = {"filename": "/tmp/torchinductor_root/c3/c3ob.py", "line": 1161, "name": "call"}
    assert site([inductor]) == "c3ob.py:1161 call"
    assert site([]) == "(no stack)"


def model_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    return parser.parse_args(["--device", "cpu", *flags])


def test_a_policys_shape_replaces_the_default_shape_flags_in_what_is_recorded():
    args = model_args("--dtype", "float32", "--policy", "embedded:tiny-arith")  # the flags keep the 1.5B shape
    build_model(args)
    assert environment(args)["model"] == {"hidden": 128, "layers": 4, "heads": 4, "kv_heads": 4, "intermediate": 256,
                                          "vocab": 100}


def test_the_weights_dtype_can_differ_from_the_compute_dtype_recorded():
    args = model_args("--hidden", "32", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--intermediate", "64",
                      "--vocab", "50")
    model = build_model(args, dtype="float32")  # fp32 master weights of a bf16 run
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert environment(args)["dtype"] == "bfloat16"
    assert environment(args)["model"] == {"hidden": 32, "layers": 1, "heads": 4, "kv_heads": 2, "intermediate": 64,
                                          "vocab": 50}


def test_mfu_is_a_share_of_the_measured_gemm_rate_and_the_datasheet_share_is_beside_it():
    parser = argparse.ArgumentParser()
    add_peak_args(parser)
    args = parser.parse_args([])
    assert (args.peak_tflops, args.datasheet_tflops) == (790.0, 989.0)
    mfu, datasheet = mfu_shares(2 * 395e12, 1.0, args, devices=2)  # 395 TFLOP/s a card
    assert mfu == pytest.approx(0.5) and datasheet == pytest.approx(395 / 989)


@pytest.mark.parametrize("script", ["trainer_smoke", "update_bench"])
def test_the_mfu_reference_is_named_for_what_it_is(script, monkeypatch, capsys):
    import importlib

    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
    with pytest.raises(SystemExit):
        importlib.import_module(script).main()
    text = " ".join(capsys.readouterr().out.split())
    assert "--peak-tflops PEAK_TFLOPS MFU's reference: the dense bf16 GEMM rate measured on H100/H200" in text
    assert "--datasheet-tflops DATASHEET_TFLOPS the card's datasheet dense bf16 peak (H100/H200 SXM: 989" in text


def test_the_mfu_target_notes_its_reference_and_the_datasheet_share():
    from seed_targets import report_rows

    steps = [{"step": i + 1, "t_step": 12.0, "mem_peak_gb": 47.0, "policy_mfu": mfu}
             for i, mfu in enumerate((0.17, 0.53, 0.51))]
    record = {"benchmark": "trainer_smoke", "method": "grpo", "card": "NVIDIA H200", "commit": "abc",
              "shape": {"prompts": 32, "samples": 8, "new_tokens": 1024}, "knobs": {"nproc": 1}, "steps": steps}
    [row] = [r for r in report_rows([record]) if r[0] == "32 × 8 grpo: policy MFU"]
    assert row[2:4] == ["51%", "met"]
    assert row[6] == "of 790 TFLOP/s, the measured bf16 GEMM rate; 41% of the 989 TFLOP/s datasheet peak"


def test_mc_continuations_times_its_workload_after_an_untimed_run_of_all_of_it(tmp_path, monkeypatch):
    """A warm-up of a few short requests left the graph captures of the other shapes inside the timed seconds."""
    import mc_continuations

    calls = []
    generate = mc_continuations.NativeEngine.generate

    def recorded(engine, requests, sampling, **options):
        calls.append([(tuple(r.prompt_ids), r.seed, r.max_new_tokens) for r in requests])
        return generate(engine, requests, sampling, **options)

    monkeypatch.setattr(mc_continuations.NativeEngine, "generate", recorded)
    monkeypatch.setattr(sys, "argv", [
        "mc_continuations.py", "--device", "cpu", "--dtype", "float32", "--hidden", "64", "--layers", "2", "--heads",
        "4", "--kv-heads", "2", "--intermediate", "128", "--vocab", "1000", "--prompts", "2", "--boundaries", "2",
        "--first-prefix", "16", "--stride", "8", "--k", "2", "--new-tokens", "4", "--modes", "shared",
        "--out", str(tmp_path / "results.jsonl")])
    mc_continuations.main()
    warm_up, timed_run = calls
    assert len(timed_run) == 2 * 2 * 2 and warm_up == timed_run
