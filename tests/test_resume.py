import re
import subprocess
import sys
import textwrap

import pytest
import torch

from caspo.config import load_config
from caspo.models.policy import load_policy
from caspo.rollout.publication import weights_digest
from caspo.train import checkpoint as ckpt
from caspo.train import loop
from caspo.train.verify_resume import verify_resume

pytestmark = pytest.mark.timeout(300)


def test_a_kill_during_checkpoint_leaves_the_previous_one_loadable(tmp_path):
    script = textwrap.dedent(f"""
        import os, torch
        from caspo.train import checkpoint as ckpt
        model = torch.nn.Linear(2, 2)
        model.save_pretrained = lambda path, **kw: (os.makedirs(path), torch.save(model.state_dict(), f"{{path}}/w.pt"))
        ckpt.save_checkpoint({str(tmp_path)!r}, 1, models={{"policy": model}}, tokenizer=None,
                             trainer_state={{"step": 1}}, counters={{"step": 1}})
        real_save = torch.save
        def dying_save(obj, path, *a, **k):
            if str(path).endswith("trainer_state.pt"):
                os._exit(9)  # killed mid-checkpoint
            real_save(obj, path, *a, **k)
        torch.save = dying_save
        ckpt.save_checkpoint({str(tmp_path)!r}, 2, models={{"policy": model}}, tokenizer=None,
                             trainer_state={{"step": 2}}, counters={{"step": 2}})
    """)
    result = subprocess.run([sys.executable, "-c", script])
    assert result.returncode == 9
    latest = ckpt.resolve_checkpoint(tmp_path)
    assert latest.name == "step_000001"
    assert ckpt.load_trainer_state(latest)["step"] == 1
    assert (tmp_path / "checkpoints" / ".tmp_step_000002").exists()  # the half-written one, never renamed
    assert not (tmp_path / "checkpoints" / "step_000002").exists()


def test_resume_restores_state_publishes_it_and_keeps_the_base_reference(tmp_path):
    # weight decay moves the weights even where a step's groups all score alike (zero advantages)
    cfg = load_config("tests", [f"train.output_dir={tmp_path}", "eval.before=false", "optim.weight_decay=0.1"])
    tr = loop.build_trainer(cfg)
    with tr.pool:
        loop.outer_step(tr)
    folder = loop.save(tr)
    trained = weights_digest(dict(tr.policy.named_parameters()))

    fresh = loop.build_trainer(cfg)
    base = weights_digest(dict(fresh.policy.named_parameters()))
    assert base != trained
    loop.restore(fresh, folder)
    assert (fresh.step, fresh.version) == (1, 1)
    assert weights_digest(dict(fresh.policy.named_parameters())) == trained
    assert fresh.engine.digest() == trained and fresh.engine.version == 1  # published before any generation
    assert weights_digest(dict(fresh.ref.named_parameters())) == base  # KL anchor stays the original base
    assert fresh.cursor.state_dict() == tr.cursor.state_dict()
    assert torch.equal(fresh.update_rng.get_state(), tr.update_rng.get_state())


def test_bf16_checkpoint_exports_bf16_and_keeps_fp32_masters(tmp_path):
    cfg = load_config("tests", [f"train.output_dir={tmp_path}", "eval.before=false", "train.precision=bf16"])
    tr = loop.build_trainer(cfg)
    with tr.pool:
        loop.outer_step(tr)
    folder = loop.save(tr)
    exported = load_policy(str(folder / "policy"), dtype="auto")
    assert next(exported.parameters()).dtype == torch.bfloat16
    masters = ckpt.load_trainer_state(folder)["master_weights"]["policy"]
    assert all(v.dtype == torch.float32 for v in masters.values())
    assert next(tr.engine.model.parameters()).dtype == torch.bfloat16  # the engine serves its compute dtype


def test_verify_resume_is_identical_on_the_tests_preset(tmp_path):
    assert verify_resume("tests", [], tmp_path)


# `caspo train` in a process whose resume restores everything but the update RNG: it keeps a fresh run's
RESUME_WITHOUT_UPDATE_RNG = textwrap.dedent("""
    import sys
    from caspo.train import trainer
    restore_counters = trainer.restore_counters

    def without_update_rng(tr, state, **kwargs):
        fresh = tr.update_rng.get_state()
        restore_counters(tr, state, **kwargs)
        tr.update_rng.set_state(fresh)

    trainer.restore_counters = without_update_rng
    from caspo.cli import app
    app(["train", *sys.argv[1:]], prog_name="caspo")
""")


def verdicts(table: str) -> dict[str, str]:
    """item -> its "identical" cell (yes / NO), from the table verify-resume prints."""
    out = {}
    for line in table.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line)]
        if len(cells) == 6 and cells[4] in ("yes", "NO"):
            out[cells[1]] = cells[4]
    return out


@pytest.mark.slow
def test_verify_resume_fails_and_names_the_update_rng_when_a_resume_does_not_restore_it(tmp_path, monkeypatch):
    """The check can fail: a resumed run whose update RNG restarts from its seed shuffles step 3's minibatches
    otherwise. `caspo verify-resume` exits 1, and its table says NO on the update RNG and on what step 3's update
    made of other minibatches (the weights, the optimizer state, the step's loss metrics), yes on the rest (the
    cursor, and the samples step 3 drew before its update)."""
    from typer.testing import CliRunner

    from caspo.cli import app
    from caspo.train import verify_resume as module

    real_run_cli = module.run_cli

    def run_cli(args, log):
        if "--resume" not in args:
            return real_run_cli(args, log)
        result = subprocess.run([sys.executable, "-c", RESUME_WITHOUT_UPDATE_RNG, *args], capture_output=True,
                                text=True)
        assert result.returncode == 0, result.stderr[-3000:]

    monkeypatch.setattr(module, "run_cli", run_cli)
    result = CliRunner().invoke(app, ["verify-resume", "tests", "--workdir", str(tmp_path)])
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, result.output
    rows = verdicts(result.output)
    assert {item for item, same in rows.items() if same == "NO"} == {"update rng", "policy weights", "optimizers",
                                                                     "per-step metrics"}
    assert {"cursor", "rng", "sampled tokens", "rewards", "step / version"} <= rows.keys()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verify_resume_is_identical_with_compiled_blocks(tmp_path):
    # inductor's code for the CPU: each of the three processes compiles the blocks (or finds its disk cache)
    assert verify_resume("tests", ["rollout.backend=native", "train.compile=true"], tmp_path)


@pytest.fixture(scope="module")
def one_step_checkpoint(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    cfg = load_config("tests", [f"train.output_dir={run}", "eval.before=false"])
    tr = loop.build_trainer(cfg)
    with tr.pool:
        loop.outer_step(tr)
    return cfg, loop.save(tr)


def test_a_corrupted_checkpoint_file_is_named_at_resume(tmp_path, one_step_checkpoint):
    import shutil

    cfg, folder = one_step_checkpoint
    copy = tmp_path / "step_000001"
    shutil.copytree(folder, copy)
    ckpt.verify_checkpoint(copy)  # intact: passes
    manifest = (copy / ckpt.MANIFEST).read_text()
    assert "policy/model.safetensors" in manifest and "trainer_state.pt" in manifest
    weights = copy / "policy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit pattern, same size
    weights.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="policy/model.safetensors does not match its checksum"):
        loop.restore(loop.build_trainer(cfg), copy)
    shutil.copy(folder / "policy" / "model.safetensors", weights)
    (copy / "trainer_state.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match="trainer_state.json is missing"):
        ckpt.verify_checkpoint(copy)


class Canary:
    """A pickle that would create a file when loaded without weights_only."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_trainer_state_cannot_run_code_when_loaded(tmp_path):
    canary = tmp_path / "canary"
    folder = tmp_path / "step_000001"
    folder.mkdir()
    torch.save({"step": 1, "payload": Canary(str(canary))}, folder / "trainer_state.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        ckpt.load_trainer_state(folder)
    assert not canary.exists()


def test_the_rng_state_loads_with_weights_only(one_step_checkpoint):
    _, folder = one_step_checkpoint
    state = ckpt.load_trainer_state(folder)
    assert state["rng"]["numpy"][0] == "MT19937" and state["rng"]["numpy"][1].dtype.name == "uint32"


def test_a_rank_file_of_several_processes_holds_its_rng_and_snapshots(tmp_path):
    """A rank's own file: its RNG and its shards of the engine's old versions; one written when it held the RNG
    alone still resumes, with no snapshots."""
    (tmp_path / "ranks").mkdir()
    rng = ckpt.rng_state()
    shard = {2: {"w": torch.arange(3.0)}}
    torch.save({"rng": rng, "snapshots": shard}, ckpt.rank_state_path(tmp_path, 0))
    torch.save(rng, ckpt.rank_state_path(tmp_path, 1))
    new, old = ckpt.load_rank_state(tmp_path, 0), ckpt.load_rank_state(tmp_path, 1)
    assert torch.equal(new["snapshots"][2]["w"], shard[2]["w"]) and old["snapshots"] == {}
    assert torch.equal(new["rng"]["torch"], rng["torch"]) and torch.equal(old["rng"]["torch"], rng["torch"])


def test_resuming_with_another_method_is_a_config_error(one_step_checkpoint):
    import dataclasses

    from caspo.config import ConfigError

    cfg, folder = one_step_checkpoint
    other = dataclasses.replace(cfg, method=dataclasses.replace(cfg.method, name="ppo_critic"))
    with pytest.raises(ConfigError, match="holds a grpo run .*not ppo_critic; resume with the run's own config"):
        loop.restore(loop.build_trainer(other), folder)


def test_resuming_with_other_optimizer_settings_is_a_config_error(one_step_checkpoint):
    """The optimizer and scheduler states would bring back the checkpoint's learning rate and betas whatever the
    config says; a setting the run's learners do not read (SGD's momentum for AdamW) may change."""
    import dataclasses

    from caspo.config import ConfigError

    cfg, folder = one_step_checkpoint
    other = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=cfg.optim.lr * 10, betas=[0.9, 0.95]))
    with pytest.raises(ConfigError, match=r"other optimizer settings \(optim.lr 0.0001 -> 0.001; optim.betas "
                                          r"\[0.9, 0.999\] -> \[0.9, 0.95\]\)"):
        loop.restore(loop.build_trainer(other), folder)
    unread = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, momentum=0.9, grad_clip=0.5))
    tr = loop.build_trainer(unread)
    loop.restore(tr, folder)  # the clip is read at every step: it may change
    assert tr.step == 1 and tr.actor.grad_clip == 0.5


def test_a_resume_refuses_a_base_model_that_changed_under_it(tmp_path):
    """The KL reference is a copy of what model.policy holds at start: a resume that loads other base weights
    (a retrained folder under the same name) would anchor the rest of the run to another model."""
    import shutil

    from caspo.config import ConfigError
    from caspo.models.policy import resolve_model_path

    base = shutil.copytree(resolve_model_path("embedded:tiny-arith"), tmp_path / "base")
    cfg = load_config("tests", [f"train.output_dir={tmp_path / 'run'}", "eval.before=false", f"model.policy={base}"])
    tr = loop.build_trainer(cfg)
    with tr.pool:
        loop.outer_step(tr)
    folder = loop.save(tr)
    loop.restore(loop.build_trainer(cfg), folder)  # the same base: resumes
    model = load_policy(str(base))
    with torch.no_grad():
        model.lm_head.weight.add_(1e-3)  # tied: the embedding moves too
    model.save_pretrained(base)
    with pytest.raises(ConfigError, match="another policy than the run"):
        loop.restore(loop.build_trainer(cfg), folder)


def test_an_export_from_whole_state_dicts_records_their_dtype(tmp_path):
    """A sharded run exports rank 0's gathered bf16 tensors beside fp32 master parameters: config.json must name
    bf16, as a one-process export does, or dtype="auto" loads the export at twice the memory."""
    model = load_policy("embedded:tiny-arith")
    whole = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    ckpt.write_folder(tmp_path / "ckpt", {"policy": model}, None, {"step": 1}, {"step": 1}, None,
                      state_dicts={"policy": whole})
    exported = load_policy(str(tmp_path / "ckpt" / "policy"), dtype="auto")
    assert next(exported.parameters()).dtype == torch.bfloat16
    ckpt.verify_checkpoint(tmp_path / "ckpt")  # the manifest covers the rewritten config.json
