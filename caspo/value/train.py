"""Phase 1, part two: fit a prefix value model to Monte Carlo labels.

The loss is the binary cross-entropy of σ(V/β) against p̂ for every labelled prefix,

    L = −(1/N) Σ_n [ p̂_n · log σ(z_n) + (1 − p̂_n) · log(1 − σ(z_n)) ],   z_n = V_n / β = Σ_{i<b_n} d_i,

so β only sets the scale of V, not what is learned. φ starts as a copy of the
reference (every V = 0). Validation prefixes are held out by row, by prompt (all
prefixes of a prompt on one side, chosen by a hash of its id) or from a separate
label file; the checkpoint with the best validation Spearman ρ is kept. Training
prefixes longer than `max_train_prefix_len` response tokens are dropped (and counted),
and `save_every` keeps a checkpoint every N epochs in `step_NNNNNN/` beside the best.

IPVRM's balancing (``use_adb``, ``use_dlw``) belongs to CASPO's online value update during RL
(method.caspo.use_adb / use_dlw, caspo.algo.ipvrm); this offline fit is the plain BCE above.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from caspo.config import ConfigError
from caspo.models.policy import load_policy, resolve_device, resolve_model_path
from caspo.models.prefix_value import DEFAULT_BETA, PrefixValueModel
from caspo.models.provenance import ProvenanceError, check_provenance, model_identity, tokenizer_hash
from caspo.models.tokenizer import load_tokenizer
from caspo.runlog import console, progress_bar
from caspo.train import distributed, fsdp, sharded
from caspo.train.update import clip_gradients
from caspo.value.labels import LabelRow, ResponseLabels, group_responses, merge_duplicates, read_label_file
from caspo.value.probe import boundary_values, evaluate, write_report


@dataclass
class TrainSpec:
    beta: float = DEFAULT_BETA
    lr: float = 3e-4  # best of 1e-4, 3e-4, 1e-3 on the embedded policy; 1.5B full fine-tunes want ~5e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    epochs: int = 2
    batch_size: int = 16  # rollouts per optimizer step (each brings all its labelled prefixes)
    micro_batch_size: int = 16
    val_split: str = "prompt"  # "row" | "prompt" | "file:PATH"
    val_fraction: float = 0.1
    eval_every: int = 0  # optimizer steps between validations; 0 = at the end of each epoch only
    seed: int = 0
    # train on distinct rollouts weighted by their copies (batch_size counts distinct ones)
    merge_duplicates: bool = False
    # the seed's max_train_prefix_len: training prefixes longer than this many response tokens are dropped,
    # and the training forward reads no token past it (0 = no cap: the collection's own)
    max_train_prefix_len: int = 0
    # the seed's value_save_every: also save the model every N epochs, in <out>/step_NNNNNN/ with that
    # epoch's validation metrics (0 = only the best)
    save_every: int = 0


def hash_unit(seed: int, key: str) -> float:
    """A uniform number in [0, 1) from (seed, key): a reproducible coin, the same in every process."""
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def split_rows(rows: list[LabelRow], mode: str, fraction: float, seed: int) -> tuple[list[LabelRow], list[LabelRow]]:
    """(train, validation) rows. "row": each row by its own coin (prefixes of one prompt land on
    both sides, so validation flatters); "prompt": each prompt's rows together."""
    if mode not in ("row", "prompt"):
        raise ConfigError(f"val split {mode!r}: choose row, prompt or file:PATH")
    if not 0 < fraction < 1:
        raise ConfigError(f"validation fraction must be in (0, 1), got {fraction}")
    key = (lambda r: f"prompt/{r.prompt_id}") if mode == "prompt" else (
        lambda r: f"row/{r.prompt_index}/{r.sample}/{r.boundary}")
    held = [hash_unit(seed, key(r)) < fraction for r in rows]
    train = [r for r, h in zip(rows, held) if not h]
    val = [r for r, h in zip(rows, held) if h]
    if not train or not val:
        raise ConfigError(f"the {mode} split at fraction {fraction} leaves {len(train)} training and {len(val)} "
                          "validation rows; collect more prompts or change --val-fraction")
    return train, val


def load_split(labels_path: str | Path, spec: TrainSpec):
    """Training and validation rows and the label provenance, checked to agree."""
    labels = read_label_file(labels_path)
    if spec.val_split.startswith("file:"):
        held_out = read_label_file(spec.val_split[len("file:"):])
        check_provenance(labels.provenance, held_out.provenance, f"validation file {spec.val_split[5:]}")
        return labels.rows, held_out.rows, labels.provenance
    train, val = split_rows(labels.rows, spec.val_split, spec.val_fraction, spec.seed)
    return train, val, labels.provenance


def train_value(labels_path: str | Path, policy: str, out_dir: str | Path, spec: TrainSpec,
                device: str = "cpu") -> dict:
    """Train φ from ``policy`` on the labels; the best checkpoint (by validation ρ) goes to ``out_dir``."""
    out_dir = Path(out_dir)
    if spec.max_train_prefix_len < 0 or spec.save_every < 0:
        raise ValueError(f"max_train_prefix_len and save_every must be >= 0 (0 = off), got "
                         f"{spec.max_train_prefix_len} and {spec.save_every}")
    train_rows, val_rows, provenance = load_split(labels_path, spec)
    train_rows, dropped = drop_long_prefixes(train_rows, spec.max_train_prefix_len)
    path = resolve_model_path(policy)
    tokenizer = load_tokenizer(path)
    if tokenizer_hash(tokenizer) != provenance.tokenizer_hash:
        raise ProvenanceError(f"{policy} has tokenizer {tokenizer_hash(tokenizer)}, the labels were tokenized by "
                              f"{provenance.tokenizer_hash}: their token ids mean other text to this model")
    device = str(resolve_device(device))  # `auto` becomes cuda or cpu
    if distributed.launched():  # one of `caspo value train --nproc N`'s ranks
        distributed.join(device)
        if device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"  # this rank's card
    reference = load_policy(path, fsdp.read_device(device))
    identity = distributed.on_main(model_identity, reference)  # rank 0 holds the weights
    model = PrefixValueModel.from_reference(reference, spec.beta, provenance.with_reference(identity),
                                            reference_source=policy)
    if distributed.active():  # φ and the reference sharded with FSDP2; each rank trains on its block of a batch
        fsdp.shard_routed(model.policy, "fp32")
        fsdp.shard_routed(model.reference, "fp32")
        model.call = fsdp.call
    optimizer = torch.optim.AdamW(model.policy.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    responses = truncate_responses(group_responses(train_rows), spec.max_train_prefix_len)
    if spec.merge_duplicates:
        responses = merge_duplicates(responses)
    steps_per_epoch = math.ceil(len(responses) / spec.batch_size)
    generator = torch.Generator().manual_seed(spec.seed)
    pad = tokenizer.pad_token_id
    history, best, best_values, step, t0 = [], None, None, 0, time.monotonic()
    saved: list[str] = []  # the checkpoints of save_every

    def validate(epoch: float) -> dict:
        nonlocal best, best_values
        model.policy.eval()
        metrics, values = evaluate(model, val_rows, pad, spec.micro_batch_size, device)
        model.policy.train()
        record = {"step": step, "epoch": round(epoch, 3), "seconds": round(time.monotonic() - t0, 1), **metrics}
        history.append(record)
        rho = metrics["spearman"]
        # rank 0 decides: saving is a collective, and another rank's ρ could differ in its last bits on a GPU
        if distributed.from_main(not math.isnan(rho) and (best is None or rho > best["spearman"])):
            best, best_values = record, values
            save_model(model, out_dir, tokenizer)
        console.print(f"step {step}: val ρ {rho:.3f}  within-response ρ {metrics['within_response_spearman']:.3f}  "
                      f"AUC {metrics['auc_outcome']:.3f}  bce {metrics['bce']:.4f}")
        return record

    model.policy.train()
    with progress_bar() as progress:
        task = progress.add_task("train value", total=spec.epochs * steps_per_epoch, status="")
        for epoch in range(spec.epochs):
            order = torch.randperm(len(responses), generator=generator).tolist()
            for start in range(0, len(order), spec.batch_size):
                batch = [responses[i] for i in order[start:start + spec.batch_size]]
                loss = train_step(model, optimizer, batch, pad, spec, device)
                step += 1
                progress.update(task, advance=1, status=f"loss {loss:.4f}")
                if spec.eval_every and step % spec.eval_every == 0 and step % steps_per_epoch:
                    validate(step / steps_per_epoch)
            record = validate(epoch + 1)
            if spec.save_every and (epoch + 1) % spec.save_every == 0:
                saved.append(str(save_epoch(model, tokenizer, out_dir, record)))
    if best is None:
        raise RuntimeError("validation ρ was undefined at every evaluation (constant values or labels); "
                           "nothing was saved")
    summary = {"best": best, "out": str(out_dir), "train_rows": len(train_rows), "val_rows": len(val_rows),
               "dropped_long_prefixes": dropped, "epoch_checkpoints": saved, "seconds": round(time.monotonic() - t0, 1)}
    if not distributed.is_main():
        return summary
    best_metrics = {k: v for k, v in best.items() if k not in ("step", "epoch", "seconds")}
    write_report(out_dir, best_metrics, best_values, val_rows, spec.beta,
                 f"validation ({spec.val_split}), best step {best['step']}",
                 extra={"best_step": best["step"], "history": history, "spec": asdict(spec),
                        "train_rows": len(train_rows), "dropped_long_prefixes": dropped,
                        "epoch_checkpoints": saved, "labels": str(labels_path)})
    return summary


def drop_long_prefixes(rows: list[LabelRow], max_len: int) -> tuple[list[LabelRow], int]:
    """(rows whose prefix holds at most `max_len` response tokens, how many were dropped); 0 keeps all."""
    if max_len == 0:
        return rows, 0
    kept = [r for r in rows if r.boundary <= max_len]
    if not kept:
        raise ValueError(f"max_train_prefix_len={max_len} drops all {len(rows)} training prefixes (the shortest "
                         f"holds {min(r.boundary for r in rows)} response tokens); raise it or set 0")
    if len(kept) < len(rows):
        console.print(f"max_train_prefix_len={max_len}: {len(rows) - len(kept)} of {len(rows)} training prefixes "
                      "are longer and dropped")
    return kept, len(rows) - len(kept)


def truncate_responses(responses: list[ResponseLabels], max_len: int) -> list[ResponseLabels]:
    """Each rollout cut to its first `max_len` response tokens (0: whole). Every boundary b is <= max_len and
    V(y_{<b}) reads tokens < b of a causal model, so the values and the loss are those of the whole rollout."""
    if max_len == 0:
        return responses
    return [dataclasses.replace(r, response_tokens=r.response_tokens[:max_len]) for r in responses]


def save_model(model: PrefixValueModel, folder: Path, tokenizer) -> None:
    """model.save, by rank 0 with φ's gathered tensors when φ is sharded (every rank takes part)."""
    if not distributed.active():
        model.save(folder, tokenizer)
        return
    state = sharded.whole_state(model.policy, "fp32")  # a collective
    if distributed.is_main():
        model.save(folder, tokenizer, state_dict=state)
    distributed.barrier()


def save_epoch(model: PrefixValueModel, tokenizer, out_dir: Path, record: dict) -> Path:
    """The model after an epoch, with that epoch's validation metrics, in <out>/step_NNNNNN/."""
    folder = out_dir / f"step_{record['step']:06d}"
    save_model(model, folder, tokenizer)
    if distributed.is_main():
        (folder / "metrics.json").write_text(json.dumps(record, indent=2) + "\n")
    return folder


def train_step(model: PrefixValueModel, optimizer: torch.optim.Optimizer, batch, pad_token_id: int,
               spec: TrainSpec, device) -> float:
    """One optimizer step over the rollouts of ``batch``, micro-batch by micro-batch.

    Each micro-batch's summed BCE is divided by the prefixes of the whole batch, so the
    gradient does not depend on the micro-batch size; a merged rollout counts ``weight`` times.
    """
    total = sum(r.weight * len(r.boundaries) for r in batch)  # the whole batch's, on every rank
    optimizer.zero_grad(set_to_none=True)
    share = distributed.block(len(batch))  # this rank's rollouts (all of them in one process)
    mine = batch[share.start:share.stop]
    micros = [mine[i:i + spec.micro_batch_size] for i in range(0, len(mine), spec.micro_batch_size)]
    # every rank runs as many forwards and backwards (FSDP's collectives); a stand-in's loss counts 0
    stand_ins = distributed.all_max(len(micros)) - len(micros)
    loss_sum = 0.0
    for micro, real in [(m, True) for m in micros] + [(batch[:1], False)] * stand_ins:
        values, mask, _ = boundary_values(model, micro, pad_token_id, device)
        targets = torch.zeros_like(values)
        for i, r in enumerate(micro):
            targets[i, :len(r.p_hats)] = torch.tensor(r.p_hats)
        weights = torch.tensor([float(r.weight) for r in micro], device=values.device)[:, None]
        bce = F.binary_cross_entropy_with_logits(values / model.beta, targets, reduction="none")
        loss = (bce * mask * weights).sum() / total * (1.0 if real else 0.0)
        loss.backward()
        loss_sum += loss.detach().item()
    clip_gradients([p for p in model.policy.parameters() if p.grad is not None], spec.grad_clip)
    optimizer.step()
    return distributed.all_sum({"loss": loss_sum})["loss"]
