"""Checks of caspo.train.distributed / fsdp / sharded on 2 gloo ranks: `torchrun --nproc-per-node 2
tests/distributed_checks.py OUT.json` (tests/test_distributed.py runs it). Each rank computes what one process
computes too (from an unsharded copy of the same model), then the sharded version; rank 0 writes the
differences and the facts the test asserts to OUT.json."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from caspo.batch import RolloutBatch
from caspo.config import load_config
from caspo.methods import get_method
from caspo.models.forward import hidden_logprobs, response_hidden, response_logprobs
from caspo.models.policy import is_skeleton, load_policy
from caspo.precision import LossScaler
from caspo.reward.pool import RewardResult
from caspo.rollout.base import Completion, Request, SamplingParams, publish
from caspo.rollout.hf import HFEngine
from caspo.rollout.publication import PublicationError
from caspo.train import checkpoint as ckpt
from caspo.train import distributed, fsdp, sharded
from caspo.train.blocks import RankSplitEngine, RankSplitPool
from caspo.train.method_state import MethodState
from caspo.train.optim import learner
from caspo.train.scoring import score
from caspo.train.update import accumulate_gradients, update

SAMPLED = [Request([5, 7, 9], seed=s, max_new_tokens=6) for s in range(3)]


def make_batch(rows: int = 7) -> RolloutBatch:
    """Rows of different prompt and response lengths, so that token-packed micro-batches differ in number."""
    g = torch.Generator().manual_seed(0)
    widths = torch.randint(3, 9, (rows,), generator=g).tolist()
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in widths]
    lengths = [2, 9, 3, 12, 5, 1, 7][:rows]
    completions = [Completion(torch.randint(3, 100, (n,), generator=g).tolist(), [0.0] * n, "stop", 0)
                   for n in lengths]
    batch = RolloutBatch.from_completions(prompts, completions, group_ids=list(range(rows)),
                                          example_ids=[str(i) for i in range(rows)], sample_seeds=list(range(rows)),
                                          texts=[""] * rows, pad_token_id=0)
    batch.advantages = torch.randn(batch.responses.shape, generator=g)
    return batch


def loss_fn(model, micro, cfg, denom):
    """A token-mean policy-gradient loss normalised by the whole minibatch's token count (`denom`: its Counts)."""
    logp, _ = hidden_logprobs(model, response_hidden(model, micro), micro.responses)
    return -(logp * micro.advantages * micro.response_mask).sum() / denom.tokens, {}


def gradients(model) -> dict[str, torch.Tensor]:
    return {n: fsdp.full_tensor(p.grad).clone() for n, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main(out: str) -> None:
    torch.manual_seed(0)
    cfg = load_config("tests", ["train.micro_batch_size=2", "train.micro_batch_tokens=30"])
    cfg = distributed.start(cfg)
    assert distributed.active() and distributed.size() == 2
    batch = make_batch()
    rows = torch.tensor([5, 0, 3, 6, 1, 2, 4])  # a minibatch in the update's order: 3 micro-batches, then 2
    base = load_policy(cfg.model.policy)
    facts: dict = {}

    # one process: the whole minibatch's gradient, the log-probs, the engine's digest after a publication
    single = copy.deepcopy(base)
    with distributed_off():
        accumulate_gradients(single, batch, rows, cfg, LossScaler("fp32"), batch.responses.shape[1], loss_fn)
        want_grads = gradients(single)
        want_logp = score(single, batch, cfg)
        engine = HFEngine(base, pad_token_id=0)
        want_digest = publish(engine, single, 1)
        want_tokens = [c.tokens for c in engine.generate(SAMPLED, SamplingParams())]
    # the sharded model: rank 0 reads the weights, rank 1 builds a skeleton and gets its shards from rank 0's;
    # each rank then works on its block of the rows. The engine is built before sharding, as the trainer does.
    loaded = load_policy(cfg.model.policy, fsdp.read_device("cpu"))
    facts["skeleton"] = is_skeleton(loaded)
    rank_engine = HFEngine(loaded, pad_token_id=0, device="cpu")
    try:
        rank_engine.generate(SAMPLED, SamplingParams())
        facts["unpublished_engine_refused"] = False
    except PublicationError:
        facts["unpublished_engine_refused"] = not distributed.is_main()  # rank 0's engine has the read weights
    model = fsdp.shard_routed(loaded, "fp32")
    facts["buffers_equal"] = all(torch.equal(b, dict(base.named_buffers())[n]) for n, b in model.named_buffers())
    facts["micro_batches"] = len(list(batch.micro_batches(2, distributed.my_rows(rows), 30)))
    accumulate_gradients(model, batch, rows, cfg, LossScaler("fp32"), batch.responses.shape[1], loss_fn)
    facts["grad_diff"] = max_diff(gradients(model), want_grads)
    facts["grad_scale"] = max(g.abs().max().item() for g in want_grads.values())
    got = fsdp.score_rows(model, batch, cfg, response_logprobs, 1.0)
    facts["logp_diff"] = ((got - want_logp) * batch.response_mask).abs().max().item()  # padding holds anything
    facts["digest_equal"] = publish(rank_engine, model, 1) == want_digest
    facts["engine_tokens_equal"] = [c.tokens for c in rank_engine.generate(SAMPLED, SamplingParams())] == want_tokens
    whole = sharded.whole_state(model, "fp32")
    tied = {"lm_head.weight"}  # the embedding, written once
    facts["export_keys_equal"] = not distributed.is_main() or set(whole) == set(single.state_dict()) - tied
    facts["export_diff"] = max((whole[k] - single.state_dict()[k]).abs().max().item() for k in whole) \
        if distributed.is_main() else 0.0

    # a sharded checkpoint whose rank 1 fails its part: both ranks raise the same error, the previous one stays
    run = Path(out).parent / "sharded_run"
    learners = {"policy": SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))}
    save = dict(learners=learners, precision="fp32", tokenizer=None, trainer_state={}, counters={}, config_yaml="")
    sharded.save(run, 1, rank_state={}, **save)
    real_save = torch.save
    if distributed.rank() == 1:
        torch.save = lambda obj, path, *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    try:
        sharded.save(run, 2, rank_state={}, **save)
    except ckpt.CheckpointError as err:
        facts["failed_save"] = str(err)
    finally:
        torch.save = real_save
    distributed.barrier()
    facts["after_failed_save"] = sorted(p.name for p in (run / "checkpoints").iterdir())

    # two epochs of two minibatches: a row another rank trains in the second epoch takes that rank's ratios
    ucfg = load_config("tests", ["train.micro_batch_size=2", "train.epochs_per_rollout=2", "train.minibatch_size=4",
                                 "method.kl_coef=0", "optim.warmup_steps=0"])
    ubatch = make_batch()
    with distributed_off():
        alone = copy.deepcopy(base)
        ubatch.old_logprobs = score(alone, ubatch, ucfg)
        update(learner(alone, ucfg), ubatch, ucfg, get_method("grpo"), MethodState(), torch.Generator().manual_seed(1),
               LossScaler("fp32"))
        want_ratios = ubatch.update_ratios.clone()
    update(learner(fsdp.shard_routed(copy.deepcopy(base), "fp32"), ucfg), ubatch, ucfg, get_method("grpo"),
           MethodState(), torch.Generator().manual_seed(1), LossScaler("fp32"))
    mask = ubatch.response_mask.bool()
    got_log, want_log = ubatch.update_ratios[mask].log(), want_ratios[mask].log()
    facts["update_ratio_diff"] = (got_log - want_log).abs().max().item()  # in nats
    facts["update_ratio_moved"] = want_log.abs().max().item()

    # the collectives' helpers
    mine = torch.zeros(5, dtype=torch.bool)
    mine[list(distributed.block(5))] = True
    x = torch.where(mine[:, None], torch.tensor([[1.0, float("nan")]] * 5) * (distributed.rank() + 1), torch.nan)
    shared = distributed.share_rows(x, mine)
    facts["share_rows"] = [[None if v != v else v for v in row] for row in shared.tolist()]
    facts["gather_rows"] = distributed.gather_rows(torch.arange(5)[list(distributed.block(5))] * 10, 5).tolist()
    facts["all_sum"] = distributed.all_sum({"a": 1.0, f"only{distributed.rank()}": 2.0})
    try:
        distributed.on_main(lambda: 1 / 0)
    except ZeroDivisionError:
        facts["on_main_raises_everywhere"] = True
    # the evaluations' engine and pool: each rank its block of a call, every rank all of the results
    engine, pool = RecordingEngine(), RecordingPool()
    completions = RankSplitEngine(engine).generate([Request([i], seed=i, max_new_tokens=1) for i in range(5)],
                                                   SamplingParams())
    result = RankSplitPool(pool).score([str(i) * (i + 1) for i in range(5)], ["0"] * 5, [True] * 5)
    facts["split_generated"], facts["split_scored"] = engine.seen, pool.seen
    facts["split_completions"] = [c.tokens for c in completions]
    facts["split_rewards"], facts["split_timeouts"] = result.rewards, result.timeouts
    facts["split_verifier_timeouts"] = result.verifier_timeouts
    # the outer step's: whole groups (3 prompts of G = 2 samples) stay on one rank
    engine, pool = RecordingEngine(), RecordingPool()
    grouped = RankSplitEngine(engine, group=2).generate([Request([i], seed=i, max_new_tokens=1) for i in range(6)],
                                                        SamplingParams())
    RankSplitPool(pool, group=2).score([str(i) for i in range(6)], ["0"] * 6, [True] * 6)
    facts["grouped_generated"], facts["grouped_scored"] = engine.seen, pool.seen
    facts["grouped_completions"] = [c.tokens for c in grouped]
    facts["per_rank"] = distributed.gather_objects({k: facts[k] for k in (
        "skeleton", "unpublished_engine_refused", "buffers_equal", "engine_tokens_equal",
        "micro_batches", "grad_diff", "update_ratio_diff", "digest_equal", "export_keys_equal", "failed_save",
        "split_generated", "split_scored", "split_completions", "split_rewards", "grouped_generated",
        "grouped_scored", "grouped_completions")})
    if distributed.is_main():
        with open(out, "w") as f:
            json.dump(facts, f, indent=1)


class RecordingEngine:
    """Completes prompt [i] with tokens [i, i]; records the prompts it was given."""

    def __init__(self):
        self.seen = []

    def generate(self, requests, sampling):
        self.seen += [r.prompt_ids[0] for r in requests]
        return [Completion(r.prompt_ids * 2, [0.0, 0.0], "stop", 0) for r in requests]


class RecordingPool:
    """Rewards each text by its length, one timeout a call; records the texts it was given."""

    def __init__(self):
        self.seen = []

    def score(self, texts, labels, finished):
        self.seen += texts
        return RewardResult([float(len(t)) for t in texts], timeouts=1, verifier_timeouts=2)


class distributed_off:
    """Run as one process would, in a process of a group (for the reference numbers)."""

    def __enter__(self):
        self.active, distributed.active = distributed.active, lambda: False

    def __exit__(self, *exc):
        distributed.active = self.active


if __name__ == "__main__":
    main(sys.argv[1])
    distributed.finish()  # the sharded models of main() gone first
