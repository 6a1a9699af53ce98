"""Step segmentation of a batch of responses: one response at a time (segment_response) against the batch
(segment_responses), on Qwen2.5's BPE tokenizer. CASPO and VinePPO segment every rollout of every step on
the CPU, between the rollout and the value phase.

Responses are MATH-500 solutions (complete text: the batch takes its offsets from the tokens' running
lengths) and random token ids (partial UTF-8 characters: decoded token by token, as before), each cut or
repeated to --tokens tokens.

    python benchmarks/segment_bench.py --rows 256 --tokens 2048 --out bench.jsonl --commit $COMMIT
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

from _common import append_result, print_table

from caspo.models.bpe import build_qwen_tokenizer
from caspo.models.tokenizer import batch_decoder
from caspo.segment import segment_response, segment_responses

MATH500 = Path(__file__).resolve().parents[1] / "caspo" / "data" / "benchmarks" / "math500.jsonl"


def solution_rows(tokenizer, rows: int, tokens: int) -> list[list[int]]:
    texts = [json.loads(line)["solution"] for line in MATH500.open()]
    out = []
    for i in range(rows):
        ids: list[int] = []
        while len(ids) < tokens:
            ids += tokenizer.encode(texts[(i * 7 + len(ids)) % len(texts)] + "\n", add_special_tokens=False)
        out.append(ids[:tokens])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--splitter", default="latex", choices=["latex", "newline"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="")
    parser.add_argument("--commit", default="")
    args = parser.parse_args()

    tokenizer = build_qwen_tokenizer()
    decode = partial(tokenizer.decode, skip_special_tokens=True)
    decode_many, concatenative = batch_decoder(tokenizer)
    rng = random.Random(args.seed)
    workloads = {"MATH-500 solutions": solution_rows(tokenizer, args.rows, args.tokens),
                 "random token ids": [[rng.randrange(len(tokenizer)) for _ in range(args.tokens)]
                                      for _ in range(args.rows)]}
    table, results = [], {}
    for name, rows in workloads.items():
        start = time.perf_counter()
        one_by_one = [segment_response(decode, ids, args.splitter) for ids in rows]
        single_s = time.perf_counter() - start
        start = time.perf_counter()
        batched = segment_responses(decode, decode_many, rows, concatenative, splitter=args.splitter)
        batch_s = time.perf_counter() - start
        if [s.token_step_ids for s in batched] != [s.token_step_ids for s in one_by_one]:
            raise SystemExit(f"{name}: the batch's step ids differ from segment_response's")
        results[name] = {"one_by_one_s": round(single_s, 3), "batch_s": round(batch_s, 3)}
        table.append([name, f"{single_s / len(rows) * 1e3:.1f}", f"{batch_s / len(rows) * 1e3:.1f}",
                      f"{single_s / batch_s:.1f}x"])
    print(f"{args.rows} responses x {args.tokens} tokens, {args.splitter} splitter; ms per response")
    print_table(["responses", "one at a time", "batch", "speed-up"], table)
    append_result(args.out, {"benchmark": "segment_bench", "commit": args.commit, "card": platform.processor(),
                             "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                             "shape": {"rows": args.rows, "tokens": args.tokens, "splitter": args.splitter},
                             "results": results})


if __name__ == "__main__":
    main()
