"""The run's examples: training and held-out sets from the `data` section, and their summary.

Held-out problems come from `data.eval_source`, from `data.heldout_fraction` of `data.source` (split by
prompt), or from arith's own held-out split. A run that evaluates without one of these, or with
`data.eval_source` naming `data.source` itself, is an error: it would judge the policy on the rows it
trains on. Training prompts that are also held-out prompts, or problems of a benchmark of
`eval.benchmarks`, are counted in the summary and printed as a warning (caspo.data.overlap).
"""

from __future__ import annotations

from dataclasses import dataclass

from caspo.config import Config
from caspo.config.validate import evaluates
from caspo.data.examples import SHOWN, DataError, Example, LoadResult, arith_examples
from caspo.data.load import load_source
from caspo.data.overlap import benchmark_overlap, shared_prompts
from caspo.data.registry import ARITH
from caspo.data.rows import same_source
from caspo.data.split import heldout_split
from caspo.data.tasks.arith import ArithSpec, ArithTask
from caspo.runlog import console


@dataclass
class TaskExamples:
    train: list[Example]
    eval: list[Example]
    summary: dict  # sources, counts, invalid and excluded rows, overlaps with the held-out set and benchmarks


def arith_task(cfg: Config) -> ArithTask:
    a = cfg.data.arith
    spec = ArithSpec(min_ops=a.min_ops, max_ops=a.max_ops, max_start=a.max_start, max_addend=a.max_addend,
                     mul_factors=tuple(a.mul_factors), max_value=a.max_value,
                     skip_last_prob=cfg.sft.skip_last_prob, skip_last_when=cfg.sft.skip_last_when,
                     slip_prob=cfg.sft.slip_prob)
    return ArithTask(spec, seed=a.seed, train_size=a.train_size, heldout_pool_size=a.heldout_pool_size)


def load_examples(cfg: Config, source: str, split: str = "heldout", limit: int = 0) -> LoadResult:
    """The first `limit` (0 = all) valid examples of a source, with the run's field names; arith's `split`."""
    d = cfg.data
    if source == ARITH:
        task = arith_task(cfg)
        n = min(limit, task.size(split)) if limit else task.size(split)
        return LoadResult(f"arith/{split}", arith_examples(task, split, n), rows=n)
    return load_source(source, query_field=d.query_field, label_field=d.label_field, id_field=d.id_field,
                       max_answer_chars=cfg.reward.max_answer_chars,
                       skip_invalid=d.skip_invalid, limit=limit)


def task_examples(cfg: Config, summarize: bool = True) -> TaskExamples:
    """The run's training and held-out examples; with `summarize`, their counts and overlaps are recorded in
    the summary and printed (`summarize_use`: load_task_data calls it itself once long prompts are left out)."""
    d, heldout_size = cfg.data, cfg.eval.heldout_size
    if d.heldout_fraction:
        full = load_examples(cfg, d.source, "train")
        train, held = heldout_split(full.examples, d.heldout_fraction, d.split_seed)
        summary = {"train": full.summary(), "heldout": {"split": f"data.heldout_fraction={d.heldout_fraction}",
                                                        "seed": d.split_seed, "examples": len(held)}}
        train, held = train[:d.train_size or None], held[:heldout_size or None]
    else:
        check_heldout_is_not_train(cfg)
        first = load_examples(cfg, d.source, "train", d.train_size)
        eval_source = d.eval_source or (ARITH if d.source == ARITH else None)
        if eval_source is None and evaluates(cfg.eval):
            raise DataError(f"data.source={d.source!r} has no held-out problems: set data.eval_source (e.g. math500) "
                            "or data.heldout_fraction (e.g. 0.05)")
        second = load_examples(cfg, eval_source, "heldout", heldout_size) if eval_source else None
        train, held = first.examples, second.examples if second else []
        summary = {"train": first.summary(), "heldout": second.summary() if second else {"examples": 0}}
    if not train:
        raise DataError(f"data.source={d.source!r} gave no training examples; check the source and data.train_size")
    if summarize:
        summarize_use(cfg, summary, train, held)
    return TaskExamples(train, held, summary)


def check_heldout_is_not_train(cfg: Config) -> None:
    """data.eval_source naming data.source itself (arith aside: it has its own held-out split)."""
    d = cfg.data
    if d.eval_source and d.source != ARITH and same_source(d.source, d.eval_source):
        raise DataError(f"data.eval_source={d.eval_source!r} is data.source itself, so the run would be evaluated on "
                        "the rows it trains on: hold out part of it (data.eval_source=null data.heldout_fraction=0.05) "
                        "or set another data.eval_source (e.g. math500)")


def summarize_use(cfg: Config, summary: dict, train: list[Example], held: list[Example]) -> None:
    """Records in `summary` what the run uses (the examples of each side, the held-out prompts that are training
    prompts, and for each of eval.benchmarks the training prompts that are its problems), then prints it."""
    summary["train"]["used"], summary["heldout"]["used"] = len(train), len(held)
    summary["overlap"] = shared_prompts(train, [e.query for e in held])
    summary["benchmark_overlap"] = benchmark_overlap(
        cfg, train, lambda: [e.query for e in load_examples(cfg, ARITH, "heldout", cfg.eval.limit).examples])
    print_summary(cfg, summary)


def print_summary(cfg: Config, summary: dict) -> None:
    for side in ("train", "heldout"):
        s = summary[side]
        name = s.get("source") or s.get("split", "")
        console.print(f"data {side}: {name}, {s['used']} examples" + (f" of {s['rows']} rows" if "rows" in s else ""))
        if s.get("excluded"):
            console.print(f"  {s['excluded']} known invalid rows left out ({', '.join(s['excluded_ids'][:SHOWN])}); "
                          "see caspo/data/benchmarks/LICENSES.md")
        if s.get("invalid"):
            console.print(f"[yellow]  {s['invalid']} invalid rows skipped (data.skip_invalid=true); first:[/yellow]")
            for problem in s["invalid_first"]:
                console.print(f"    {problem}")
        if s.get("skipped_long"):
            console.print(skipped_long_note(cfg, s["skipped_long"], s["skipped_long_ids"]))
    if summary["overlap"]:
        console.print(f"[yellow]data: {summary['overlap']} held-out prompts are also training prompts[/yellow]")
    for name, shared in summary["benchmark_overlap"].items():
        if shared:
            console.print(f"[yellow]data: benchmark {name} (eval.benchmarks) shares {shared} "
                          f"problem{'s' if shared > 1 else ''} with the training prompts[/yellow]")


def skipped_long_note(cfg: Config, count: int, ids: list[str]) -> str:
    return (f"  {count} prompts over data.max_prompt_tokens={cfg.data.max_prompt_tokens} left out "
            f"(data.long_prompts=skip): {', '.join(ids)}")
