"""Data parallelism on the CPU: 2 gloo processes against one (caspo.train.distributed, fsdp, sharded)."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from caspo.config import ConfigError, load_config
from caspo.train import distributed

HERE = Path(__file__).parent
# one thread per process: the two ranks share the machine's cores
RUN = ["model.threads=1", "eval.before=false", "eval.after=false", "train.deterministic=true"]


def caspo(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "caspo.cli", *args], capture_output=True, text=True,
                          env=env or {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")})


def test_blocks_split_as_tensor_split_and_cover_every_item():
    for n in range(0, 9):
        for world in (1, 2, 3, 4):
            blocks = [distributed.block(n, r, world) for r in range(world)]
            assert [list(b) for b in blocks] == [t.tolist() for t in torch.arange(n).tensor_split(world)]
    assert [list(distributed.block(5, r, 2)) for r in range(2)] == [[0, 1, 2], [3, 4]]


def test_a_rank_with_fewer_micro_batches_runs_stand_ins_of_two_rows(monkeypatch):
    from test_batch import make_batch

    from caspo.train import fsdp

    monkeypatch.setattr(distributed, "active", lambda: True)
    monkeypatch.setattr(distributed, "all_max", lambda count: count + 2)  # another rank has two more
    batch = make_batch()
    chunks = list(fsdp.micro_batches(batch, torch.tensor([1, 2]), 2))
    assert [(idx.tolist(), real) for idx, _, real in chunks] == [([1, 2], True), ([1, 1], False), ([1, 1], False)]
    assert all(micro.size == 2 for _, micro, _ in chunks)  # compiled blocks would build a graph for one row
    empty = list(fsdp.micro_batches(batch, torch.tensor([], dtype=torch.long), 2))
    assert [(idx.tolist(), real) for idx, _, real in empty] == [([0, 0], False), ([0, 0], False)]


def test_one_process_joins_no_group_and_keeps_its_config(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config("tests")
    assert distributed.start(cfg) is cfg
    assert not torch.distributed.is_initialized() and not distributed.active()
    assert (distributed.rank(), distributed.size(), distributed.is_main()) == (0, 1, True)
    assert distributed.log_dir(Path("run")) == Path("run")
    x = torch.arange(6.0).view(3, 2)
    assert distributed.gather_rows(x, 3) is x and distributed.all_sum({"a": 1.0}) == {"a": 1.0}


@pytest.mark.parametrize("override, named", [
    ("model.device=cuda:1", "model.device=cuda:1"),
])
def test_several_processes_refuse_what_they_cannot_honour(override, named):
    cfg = load_config("tests", [override])
    distributed.check_config(cfg, 1)  # one process runs it
    with pytest.raises(ConfigError, match=named.replace("+", r"\+")):
        distributed.check_config(cfg, 2)


def test_a_cpu_run_shards_on_the_cpu_where_the_host_has_an_accelerator(tmp_path, monkeypatch):
    """FSDP2's default mesh is on the host's accelerator: a CPU run's models would move onto a visible GPU
    (here a pretended one, which this torch cannot reach) and its batches would not follow."""
    from caspo.models.policy import load_policy
    from caspo.train import fsdp

    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = fsdp.shard_routed(load_policy("embedded:tiny-arith"), "fp32")
        assert {(type(p).__name__, p.device.type) for p in model.parameters()} == {("DTensor", "cpu")}
    finally:
        torch.distributed.destroy_process_group()


def test_a_parameter_outside_every_group_is_refused_by_name(tmp_path):
    """A parameter of no FSDP group would stay whole where it was read (the host, for a sharded run's models) and
    its gradient would not be summed over the ranks: sharding refuses it, naming it."""
    from caspo.models.critic import load_critic
    from caspo.train import fsdp

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        critic = load_critic("embedded:tiny-arith")
        assert fsdp.shard_called(copy.deepcopy(critic), "fp32") is not None  # every parameter in a group
        critic.register_parameter("value_scale", torch.nn.Parameter(torch.ones(1)))  # on the model itself
        with pytest.raises(RuntimeError, match="parameters value_scale are in no FSDP group"):
            fsdp.shard_called(critic, "fp32")
    finally:
        torch.distributed.destroy_process_group()


def test_rank_0_reads_the_models_on_the_host_and_the_others_build_skeletons(monkeypatch):
    """Sharding moves each group to the rank's card; read there first, every rank would hold whole models on it,
    and read on every rank's host, the host would hold one copy per rank. On CUDA, attention runs without cuDNN
    even where the models are read on the host."""
    from caspo.train import fsdp

    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        assert fsdp.read_device("cuda:0") == torch.device("cuda", 0)  # one process: read where it runs
        monkeypatch.setattr(distributed, "active", lambda: True)
        monkeypatch.setattr(distributed, "rank", lambda: 0)
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert fsdp.read_device("cpu") == torch.device("cpu")
        assert torch.backends.cuda.cudnn_sdp_enabled()
        assert fsdp.read_device("cuda") == torch.device("cpu")
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        monkeypatch.setattr(distributed, "rank", lambda: 1)
        assert fsdp.read_device("cuda") == fsdp.read_device("cpu") == torch.device("meta")
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)


@pytest.mark.parametrize("spec", ["embedded:tiny-arith", "embedded:tiny-looped"])
def test_a_skeleton_has_the_loaded_models_structure_and_no_weights(spec):
    """What ranks other than 0 build in place of reading: every parameter and buffer of the loaded policy and
    critic by name, shape, dtype and trainability, and the EOS ids that end completions, on the meta device."""
    from caspo.models.critic import load_critic
    from caspo.models.policy import is_skeleton, load_policy

    def structure(model):
        return ({n: (p.shape, p.dtype, p.requires_grad) for n, p in model.named_parameters()},
                {n: (b.shape, b.dtype) for n, b in model.named_buffers()})

    for load in (load_policy, load_critic):
        loaded, skeleton = load(spec), load(spec, "meta")
        assert structure(skeleton) == structure(loaded) and not is_skeleton(loaded) and is_skeleton(skeleton)
        assert {t.device.type for t in [*skeleton.parameters(), *skeleton.buffers()]} == {"meta"}
    assert load_policy(spec, "meta").generation_config.eos_token_id == load_policy(spec).generation_config.eos_token_id


def test_value_training_refuses_one_card_for_several_ranks(tmp_path):
    from typer.testing import CliRunner

    from caspo.value.cli import value_app

    result = CliRunner().invoke(value_app, ["train", str(tmp_path / "labels.jsonl"), "--policy", "embedded:tiny-arith",
                                            "--out", str(tmp_path / "v"), "--device", "cuda:0", "--nproc", "2"])
    assert result.exit_code != 0 and "--device cuda:0 with --nproc 2" in str(result.exception)


def test_a_rank_joins_with_the_runs_timeout_and_nccl_ring_set_before(monkeypatch):
    """A rank that another launcher started (plain torchrun, a cluster's) must have NCCL_ALGO and the cuBLAS
    workspace in its environment before the group's communicator is made, not when the trainer starts; it
    joins with train.collective_timeout_minutes."""
    for name in distributed.DETERMINISTIC_ENV:
        monkeypatch.setenv(name, "unset")  # restored after the test
    monkeypatch.setenv("WORLD_SIZE", "2")
    seen = {}
    monkeypatch.setattr(distributed, "join", lambda device, minutes: seen.update(
        {"minutes": minutes, **{k: os.environ[k] for k in distributed.DETERMINISTIC_ENV}}))
    distributed.start(load_config("tests", ["train.deterministic=true", "train.collective_timeout_minutes=240"]))
    assert seen == {"minutes": 240, **distributed.DETERMINISTIC_ENV} and seen["NCCL_ALGO"] == "Ring"


def test_launch_command_runs_the_cli_under_torchrun():
    cmd = distributed.launch_command(4, ["train", "tests", "train.steps=2"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=4" in cmd and "--standalone" in cmd
    assert cmd[-5:] == ["-m", "caspo.cli", "train", "tests", "train.steps=2"]


def test_two_ranks_give_the_one_process_gradients_scores_and_publication(tmp_path):
    """tests/distributed_checks.py on 2 gloo ranks: token-packed micro-batches of unequal number per rank
    (stand-ins keep the collectives matched), the gradient of the whole minibatch, the no-grad scores, the
    engine's digest after a publication of the sharded policy, rank 0's HF export, the helpers, and the engine and
    pool split by ranks (by request, as the evaluations split, and by whole prompts, as the outer step does)."""
    out = tmp_path / "facts.json"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(HERE / "distributed_checks.py"), str(out)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    facts = json.loads(out.read_text())
    assert facts["grad_diff"] <= 1e-6 * facts["grad_scale"]
    assert facts["logp_diff"] <= 1e-5
    assert [r["micro_batches"] for r in facts["per_rank"]] == [3, 2]  # rank 1 ran a stand-in
    # rank 1 read no weights: its skeleton's shards and buffers, and its engine's weights, came from rank 0's;
    # its engine refused to sample before the first publication, then sampled the one process's tokens
    assert [r["skeleton"] for r in facts["per_rank"]] == [False, True]
    assert [r["unpublished_engine_refused"] for r in facts["per_rank"]] == [False, True]
    assert all(r["buffers_equal"] and r["engine_tokens_equal"] for r in facts["per_rank"])
    assert all(r["digest_equal"] and r["export_keys_equal"] and r["grad_diff"] == facts["grad_diff"]
               for r in facts["per_rank"])
    assert facts["export_diff"] == 0.0
    # the update's ratios after 2 epochs are the one process's: each row's from the rank that trained it last
    assert facts["update_ratio_moved"] > 1e-3
    assert all(r["update_ratio_diff"] <= 1e-4 for r in facts["per_rank"])
    # rank 1's part of checkpoint 2 failed: both ranks raised the error naming it; checkpoint 1 is still latest
    assert all(r["failed_save"].startswith("writing checkpoint step_000002 to ") and
               "rank 1: No space left on device" in r["failed_save"] and "(step_000001) is intact" in r["failed_save"]
               for r in facts["per_rank"])
    assert facts["after_failed_save"] == ["latest", "step_000001"]
    # rank 0 filled rows 0-2 with 1, rank 1 rows 3-4 with 2; the NaN of a filled row is kept
    assert facts["share_rows"] == [[1.0, None]] * 3 + [[2.0, None]] * 2
    assert facts["gather_rows"] == [0, 10, 20, 30, 40]
    assert facts["all_sum"] == {"a": 2.0, "only0": 2.0, "only1": 2.0}
    assert facts["on_main_raises_everywhere"]
    # evaluations split by ranks: rank 0 generated and scored items 0-2, rank 1 items 3-4; each holds all results
    assert [r["split_generated"] for r in facts["per_rank"]] == [[0, 1, 2], [3, 4]]
    assert [r["split_scored"] for r in facts["per_rank"]] == [["0", "11", "222"], ["3333", "44444"]]
    assert all(r["split_completions"] == [[i, i] for i in range(5)] for r in facts["per_rank"])
    assert all(r["split_rewards"] == [1.0, 2.0, 3.0, 4.0, 5.0] for r in facts["per_rank"])
    assert facts["split_timeouts"] == 2 and facts["split_verifier_timeouts"] == 4  # each rank's counts, summed
    # the outer step's split keeps a prompt's G = 2 samples together: groups 0-1 on rank 0, group 2 on rank 1
    assert [r["grouped_generated"] for r in facts["per_rank"]] == [[0, 1, 2, 3], [4, 5]]
    assert [r["grouped_scored"] for r in facts["per_rank"]] == [["0", "1", "2", "3"], ["4", "5"]]
    assert all(r["grouped_completions"] == [[i, i] for i in range(6)] for r in facts["per_rank"])


def exported(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    return {p.parent.name: load_file(p) for p in sorted(ckpt.glob("*/model.safetensors"))}


def samples(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["grpo", "ppo_critic", "ppo_critic_in_value_phase", "caspo", "flow_dppo", "dppo",
                                    "vineppo", "ppo_critic_looped_native"])
def test_two_processes_sample_and_train_as_one(tmp_path, method, value_model_folder):
    """Deterministic fp32, 3 steps: the same sampled tokens and, up to the order of the sums, the same weights
    of every trained model (the policy; the critic, in the update or, with one minibatch a rollout, in the value
    phase; CASPO's online value model, sharded, each rank's gradient of its rows summed by FSDP); flow_dppo
    reads its frozen old policy sharded as the policy is; dppo generates with the policy of one update ago, which
    each rank keeps as its shards; vineppo's ranks each value their block of prompts by Monte Carlo, and the
    step's counters are the whole batch's; a looped policy and critic, one FSDP group each, with rank 1's native
    engine built from the policy's skeleton."""
    extra = [f"method.name={method}"]
    if method == "ppo_critic_in_value_phase":  # one minibatch of the 8 responses: the critic's step comes first
        extra = ["method.name=ppo_critic", "train.minibatch_size=8"]
    if method == "caspo":
        extra += [f"method.caspo.value_model={value_model_folder}", "method.caspo.online=true",
                  "method.caspo.online_value_lr=1e-3"]
    if method == "dppo":
        extra += ["rollout.staleness=1"]
    if method == "ppo_critic_looped_native":  # a looped policy and critic, rank 1's native engine from a skeleton
        extra = ["method.name=ppo_critic", "model.policy=embedded:tiny-looped", "rollout.backend=native"]
    runs = {n: tmp_path / f"n{n}" for n in (1, 2)}
    for n, run in runs.items():
        result = caspo("train", "tests", *RUN, *extra, f"train.output_dir={run}", *(["--nproc", "2"] if n == 2 else []))
        assert result.returncode == 0, result.stderr[-3000:]
    one, two = samples(runs[1]), samples(runs[2])
    assert len(one) == len(two) == 3 * 8
    logged = [[json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] for run in runs.values()]
    if method == "vineppo":  # the counters are the whole batch's, not a rank's (nor every rank's sum of it)
        mc = [[r["mc_tokens"] for r in rows if "mc_tokens" in r] for rows in logged]
        assert len(mc[0]) == 3 and mc[0] == mc[1] and all(t > 0 for t in mc[0])
    # a learner's loss and gradient norm are the whole batch's, each row counted once, not one rank's part
    for key in {"caspo": ("value_bce", "value_grad_norm"), "ppo_critic": ("critic_grad_norm",),
                "ppo_critic_in_value_phase": ("critic_grad_norm",),
                "ppo_critic_looped_native": ("critic_grad_norm",)}.get(method, ()):
        one_two = [[r[key] for r in rows if key in r] for rows in logged]
        assert len(one_two[0]) == 3 and one_two[1] == pytest.approx(one_two[0], rel=1e-5)
    assert [s["tokens_digest"] for s in one] == [s["tokens_digest"] for s in two]
    assert [s["reward"] for s in one] == [s["reward"] for s in two]
    w1, w2 = exported(runs[1]), exported(runs[2])
    critic = {"critic"}
    learners = {"caspo": {"value"}, "ppo_critic": critic, "ppo_critic_in_value_phase": critic, "flow_dppo": critic,
                "dppo": critic, "ppo_critic_looped_native": critic}.get(method, set())
    assert set(w1) == set(w2) == {"policy", *learners}
    for name in w1:
        assert set(w1[name]) == set(w2[name])
        assert max((w1[name][k] - w2[name][k]).abs().max().item() for k in w1[name]) <= 1e-6
    # the sharded checkpoint: DCP shards, each rank's RNG; rank 1's own log beside rank 0's
    ckpt = runs[2] / "checkpoints" / "step_000003"
    assert (ckpt / "shards").is_dir() and sorted(p.name for p in (ckpt / "ranks").iterdir()) == ["rank_0.pt",
                                                                                                "rank_1.pt"]
    assert samples(runs[2] / "ranks" / "rank1") == two
    if method == "grpo":  # a sharded checkpoint resumes only in as many processes
        result = caspo("train", "tests", *RUN, f"train.output_dir={runs[2]}", "train.steps=4", "--resume", "latest")
        assert result.returncode == 2 and "--nproc" in result.stderr


@pytest.mark.slow
def test_compiled_blocks_under_fsdp2_train_as_the_eager_ones(tmp_path):
    """train.compile on 2 ranks: the blocks are compiled before they are sharded, and FSDP2's hooks run
    around the compiled code. aot_eager captures the same graphs without generating code, so the weights
    are those of the eager run."""
    runs = {flag: tmp_path / flag for flag in ("false", "true")}
    for flag, run in runs.items():
        result = caspo("train", "tests", *RUN, "rollout.backend=native", "method.kl_coef=0.01",
                       f"train.compile={flag}", "train.compile_backend=aot_eager", f"train.output_dir={run}",
                       "--nproc", "2")
        assert result.returncode == 0, result.stderr[-3000:]
    eager, compiled = exported(runs["false"])["policy"], exported(runs["true"])["policy"]
    assert set(eager) == set(compiled)
    assert max((eager[k] - compiled[k]).abs().max().item() for k in eager) <= 1e-6
    assert [s["tokens_digest"] for s in samples(runs["false"])] == [s["tokens_digest"] for s in samples(runs["true"])]


@pytest.mark.slow
def test_verify_resume_with_two_processes_is_bit_identical(tmp_path):
    result = caspo("verify-resume", "tests", "model.threads=1", "--nproc", "2", "--workdir", str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "NO" not in result.stdout


@pytest.mark.slow
def test_two_processes_in_fp16_skip_together_and_track_one_process(tmp_path):
    """fp16 with the fixed loss scale: the ranks compute with fp16 parameters where one process autocasts over fp32,
    so they agree to fp16 precision, not bit for bit (fp32 is the bit-level check above)."""
    runs = {n: tmp_path / f"n{n}" for n in (1, 2)}
    for n, run in runs.items():
        result = caspo("train", "tests", *RUN, "train.precision=fp16", "train.steps=2", f"train.output_dir={run}",
                       *(["--nproc", "2"] if n == 2 else []))
        assert result.returncode == 0, result.stderr[-3000:]
    one, two = samples(runs[1]), samples(runs[2])
    assert [s["tokens_digest"] for s in one] == [s["tokens_digest"] for s in two]
    rows = {n: [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] for n, run in runs.items()}
    assert [r["skipped_steps"] for r in rows[1]] == [r["skipped_steps"] for r in rows[2]]
    first = [r["grad_norm"] for r in rows[1] if "grad_norm" in r][0], [r["grad_norm"] for r in rows[2]
                                                                       if "grad_norm" in r][0]
    assert first[1] == pytest.approx(first[0], rel=0.02)
    w1, w2 = exported(runs[1])["policy"], exported(runs[2])["policy"]
    assert max((w1[k].float() - w2[k].float()).abs().max().item() for k in w1) <= 1e-3


@pytest.mark.slow
def test_value_training_on_two_ranks_fits_the_one_process_model(tmp_path):
    """`caspo value train --nproc 2`: φ and the reference sharded with FSDP2, each rank a block of every batch:
    the same validation numbers and, up to the order of the sums (amplified by AdamW), the same φ."""
    from safetensors.torch import load_file

    labels = tmp_path / "labels.jsonl"
    result = caspo("value", "collect", "tests", "reward.workers=0", "model.threads=1", "--prompts", "12", "--k", "4",
                   "--j", "2", "--boundaries", "2", "--out", str(labels))
    assert result.returncode == 0, result.stderr[-3000:]
    train = ["value", "train", str(labels), "--policy", "embedded:tiny-arith", "--val-split", "prompt",
             "--val-fraction", "0.5", "--epochs", "2", "--batch-size", "8", "--micro-batch-size", "3"]
    for n in (1, 2):
        result = caspo(*train, "--out", str(tmp_path / f"n{n}"), *(["--nproc", "2"] if n == 2 else []))
        assert result.returncode == 0, result.stderr[-3000:]
    history = {n: json.loads((tmp_path / f"n{n}" / "metrics.json").read_text())["history"] for n in (1, 2)}
    assert [h["step"] for h in history[1]] == [h["step"] for h in history[2]] == [2, 4]
    for one, two in zip(history[1], history[2]):
        assert two["spearman"] == one["spearman"] and two["bce"] == pytest.approx(one["bce"], rel=1e-6)
    w1, w2 = (load_file(tmp_path / f"n{n}" / "model.safetensors") for n in (1, 2))
    assert set(w1) == set(w2) and max((w1[k] - w2[k]).abs().max().item() for k in w1) <= 2e-5


@pytest.mark.slow
def test_a_refreshed_caspo_run_on_two_processes_labels_and_trains_as_one(tmp_path, value_model_folder):
    """method.caspo.refresh_every on 2 ranks: each collects its shard of a refresh's labels and rank 0 merges them
    into the one process's label rows; φ trains sharded; the refreshed value models, the sampled tokens and the
    policy then agree with one process up to the order of the sums."""
    from safetensors.torch import load_file

    refresh = ["method.name=caspo", f"method.caspo.value_model={value_model_folder}", "method.caspo.refresh_every=1",
               "method.caspo.refresh_prompts=24", "method.caspo.refresh_k=4", "method.caspo.refresh_j=2",
               "method.caspo.refresh_boundaries=2", "method.caspo.refresh_epochs=1", "reward.workers=0"]
    runs = {n: tmp_path / f"n{n}" for n in (1, 2)}
    for n, run in runs.items():
        result = caspo("train", "tests", *RUN, *refresh, f"train.output_dir={run}",
                       *(["--nproc", "2"] if n == 2 else []))
        assert result.returncode == 0, result.stderr[-3000:]
    for step in ("step_000001", "step_000002"):
        folders = [run / "refresh" / step for run in runs.values()]
        labels = [[json.loads(x) for x in (f / "labels.jsonl").read_text().splitlines()[1:]] for f in folders]
        assert labels[0] and labels[0] == labels[1]  # every row, in order: prefixes, seeds and p̂
        header = json.loads((folders[1] / "labels.jsonl").read_text().splitlines()[0])["header"]
        assert header["merged_from"] == 2 and not list(folders[1].glob("labels.shard*"))  # merged, then removed
        w1, w2 = (load_file(f / "value" / "model.safetensors") for f in folders)
        assert set(w1) == set(w2) and max((w1[k] - w2[k]).abs().max().item() for k in w1) <= 2e-5
    assert [s["tokens_digest"] for s in samples(runs[1])] == [s["tokens_digest"] for s in samples(runs[2])]
    p1, p2 = exported(runs[1])["policy"], exported(runs[2])["policy"]
    assert max((p1[k] - p2[k]).abs().max().item() for k in p1) <= 1e-6


@pytest.mark.slow
def test_evaluations_split_by_ranks_give_the_one_process_numbers(tmp_path):
    """The held-out evaluation (greedy and avg@k) and eval.benchmarks with 2 processes, each rank generating and
    scoring its block: the same metrics and the same per-problem records as one process, written once."""
    evals = ["train.steps=2", "eval.before=true", "eval.after=true", "eval.samples=2", "eval.benchmarks=[heldout]",
             "reward.workers=0"]
    runs = {n: tmp_path / f"n{n}" for n in (1, 2)}
    for n, run in runs.items():
        result = caspo("train", "tests", "model.threads=1", "train.deterministic=true", *evals,
                       f"train.output_dir={run}", *(["--nproc", "2"] if n == 2 else []))
        assert result.returncode == 0, result.stderr[-3000:]
    rows = {n: [{k: v for k, v in json.loads(x).items() if k.startswith(("eval_", "bench_")) and "_t_" not in k
                 and not k.startswith("eval_t")} for x in (run / "metrics.jsonl").read_text().splitlines()]
            for n, run in runs.items()}
    assert rows[1] == rows[2] and sum("eval_sampled_accuracy" in r for r in rows[1]) == 2
    for checkpoint in ("base", "step_000002"):
        one, two = ((run / "eval" / checkpoint / "heldout.jsonl").read_text() for run in runs.values())
        assert one == two and len(one.splitlines()) == 16
    rank1 = runs[2] / "ranks" / "rank1"  # its own metrics, but rank 0 alone writes the evaluations
    assert (rank1 / "metrics.jsonl").is_file() and not (rank1 / "eval").exists()
