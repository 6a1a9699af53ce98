"""Supervised fine-tuning of a tiny policy on the arithmetic task's SFT mixture.

    caspo sft arith-tiny --output caspo/assets/tiny-arith

The learning rate warms up, then follows a cosine to zero, so the result is a
converged model: what RL gains afterwards is not a learning-rate artifact.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from caspo.config import Config, ConfigError
from caspo.data.build import arith_task
from caspo.data.templates import render_prompt
from caspo.eval.heldout import greedy_accuracy
from caspo.models.policy import (
    load_policy,
    resolve_device,
    resolve_model_path,
    stop_token_ids,
    tiny_looped_config,
    tiny_qwen2_config,
)
from caspo.models.tokenizer import build_char_tokenizer, load_tokenizer, save_tokenizer
from caspo.reward.pool import RewardPool
from caspo.rollout.hf import HFEngine
from caspo.runlog import JsonlWriter, console, progress_bar
from caspo.train.optim import build_scheduler
from caspo.train.run_files import refuse_model_folder

LOG = "sft_log.jsonl"  # one line a step


class TrainingDiverged(ConfigError):
    """The loss became NaN or infinite: a setting to change (sft.lr), so a user error, not a crash."""


def sft_batch(tokenizer, pairs: list[tuple[str, str]], device) -> tuple[torch.Tensor, ...]:
    """Right-padded prompt+target+EOS; labels are -100 except on the target and EOS."""
    seqs, labels = [], []
    for prompt, target in pairs:
        p = tokenizer.encode(prompt, add_special_tokens=False)
        t = tokenizer.encode(target, add_special_tokens=False) + [tokenizer.eos_token_id]
        seqs.append(p + t)
        labels.append([-100] * len(p) + t)
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    lab = torch.full((len(seqs), width), -100)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, :len(s)] = torch.tensor(s)
        lab[i, :len(l)] = torch.tensor(l)
        mask[i, :len(s)] = 1
    return ids.to(device), mask.to(device), lab.to(device)


def tiny_config(s, tokenizer):
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    shape = dict(hidden=s.hidden, layers=s.layers, heads=s.heads, intermediate=s.intermediate)
    if s.architecture == "qwen2":
        return tiny_qwen2_config(len(tokenizer), kv_heads=s.heads, **shape, **ids)
    layout = s.architecture.removeprefix("looped-")
    return tiny_looped_config(len(tokenizer), layout=layout, depth=s.depth, **shape, **ids)


def evaluate(model, tokenizer, task, cfg: Config, pool: RewardPool, device) -> dict:
    problems = task.heldout[: cfg.eval.heldout_size]
    prompts = [tokenizer.encode(render_prompt(cfg.data.template, p.question), add_special_tokens=False)
               for p in problems]
    engine = HFEngine(model, pad_token_id=tokenizer.pad_token_id, max_batch=cfg.sft.eval_batch_size)
    result = greedy_accuracy(engine, tokenizer, prompts, [str(p.answer) for p in problems], pool,
                             max_new_tokens=cfg.eval.max_new_tokens, stop_token_ids=stop_token_ids(model, tokenizer))
    return result.summary()


def run_sft(cfg: Config, output: str | Path, init: str | None = None, overwrite: bool = False) -> dict:
    s = cfg.sft
    output = Path(output)
    if (output / LOG).exists() and not overwrite:  # its log would hold two runs, its policy the second
        raise ConfigError(f"{output} holds an SFT run already ({LOG}); pass --overwrite to replace it, or "
                          "another --output")
    if not overwrite:  # another command's model, a run's checkpoint: the policy written here would replace it
        refuse_model_folder(output, "--output")
    torch.manual_seed(s.seed)
    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    device = resolve_device(cfg.model.device)
    if init:  # continue from an existing policy (e.g. to check that more SFT no longer helps)
        tokenizer = load_tokenizer(resolve_model_path(init))
        model = load_policy(init, device)
    else:
        tokenizer = build_char_tokenizer()
        model = AutoModelForCausalLM.from_config(tiny_config(s, tokenizer)).to(device)
    task = arith_task(cfg)
    rng = random.Random(s.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay, betas=(0.9, 0.95))
    scheduler = build_scheduler(optimizer, warmup=s.warmup_steps, total=s.steps, schedule="cosine",
                                min_ratio=s.min_lr_ratio)
    output.mkdir(parents=True, exist_ok=True)
    (output / LOG).unlink(missing_ok=True)  # --overwrite: the new run's log alone
    log = JsonlWriter(output / LOG)
    n_train = task.size("train")
    with RewardPool.from_config(cfg.reward) as pool, progress_bar() as progress:
        bar = progress.add_task("sft", total=s.steps, status="")
        for step in range(s.steps):
            problems = [task.problem("train", rng.randrange(n_train)) for _ in range(s.batch_size)]
            pairs = [(render_prompt(cfg.data.template, p.question), task.sft_solution(p, rng)) for p in problems]
            ids, mask, labels = sft_batch(tokenizer, pairs, device)
            model.train()
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            lr = scheduler.get_last_lr()[0]  # the learning rate this step uses
            optimizer.step()
            scheduler.step()
            record = {"step": step + 1, "loss": loss.item(), "lr": lr}
            if s.eval_every and ((step + 1) % s.eval_every == 0 or step + 1 == s.steps):
                model.eval()
                record.update({f"eval_{k}": v for k, v in evaluate(model, tokenizer, task, cfg, pool, device).items()})
                console.print(f"sft step {step + 1}: loss {record['loss']:.4f} accuracy {record['eval_accuracy']:.3f} "
                              f"boxed {record['eval_boxed_rate']:.3f}")
            log.write(record)
            if not math.isfinite(record["loss"]):
                raise TrainingDiverged(f"SFT loss is {record['loss']} at step {step + 1}; lower sft.lr "
                                       f"(now {s.lr:g})")
            progress.update(bar, completed=step + 1, status=f"loss {record['loss']:.4f}")
    log.close()
    model.eval()
    model.save_pretrained(output, safe_serialization=True)
    save_tokenizer(tokenizer, output)
    return record
