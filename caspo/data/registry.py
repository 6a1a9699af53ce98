"""The benchmarks that ship with caspo, addressed by name (`data.source=dsr_sub`, `--benchmarks math500`).

The files in `caspo/data/benchmarks/` are byte-for-byte copies of the project's curated JSONL
files; their sources, licences and how they were built are in `caspo/data/benchmarks/LICENSES.md`.
`known_invalid` lists the rows the loader rejects (source defects, and golds the verifier reads
only as text): they are left out of every load of that benchmark and named in its summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

BENCHMARK_DIR = Path(__file__).resolve().parent / "benchmarks"
ARITH = "arith"  # the procedural task: no file, its own held-out split


@dataclass(frozen=True)
class Benchmark:
    name: str
    file: str  # in BENCHMARK_DIR
    rows: int
    known_invalid: dict[str, str] = field(default_factory=dict)  # id -> why the loader rejects it
    subject_field: str | None = None  # per-subject and per-level tables (MATH, MATH-500)
    level_field: str | None = None
    query_field: str = "problem"
    label_field: str = "answer"
    id_field: str = "id"

    @property
    def path(self) -> Path:
        return BENCHMARK_DIR / self.file


SHIPPED: dict[str, Benchmark] = {b.name: b for b in [
    Benchmark("dsr_sub", "dsr_sub.jsonl", 1209, known_invalid={
        "dsr_sub-139": "gold '\\div' is an operator, which the verifier reads only as text",
        "dsr_sub-265": "source defect: empty answer",
        "dsr_sub-309": "gold '(1001)_2, ..., 5 | B' mixes base-subscripted numerals with a divisibility condition, "
                       "read only as text",
        "dsr_sub-546": "gold '4:40 a.m.' is a clock time, read only as text",
        "dsr_sub-782": "gold '\\[ v \\]' is wrapped in display-math delimiters, read only as text",
        "dsr_sub-1187": "source defect: the answer is cut off (an unclosed brace)",
    }),
    Benchmark("math500", "math500.jsonl", 500, subject_field="subject", level_field="level"),
    Benchmark("gsm8k", "gsm8k.jsonl", 1319),
    Benchmark("olympiadbench", "olympiadbench.jsonl", 675, known_invalid={
        "olympiadbench-1782": "gold 'm_{\\max }=n^{2}-n-1' is an equation of a subscripted name, read only as text",
        "olympiadbench-2045": "source defect: gold 't(0,4]' lost its membership sign, read only as text",
        "olympiadbench-1965": "gold 'f(x)=a x+b, where b is an arbitrary integer, ...' is a sentence, "
                              "read only as text",
        "olympiadbench-1970": "gold '(-\\infty, 0) \\cup\\{1\\}.' ends in a period, read only as text",
    }),
    Benchmark("math", "math.jsonl", 5000, subject_field="type", level_field="level", known_invalid={
        "test/counting_and_probability/861.json": "gold '\\frac{12}{5,\\!525}' has a thousands separator "
                                                  "inside a fraction, read only as text",
        "test/intermediate_algebra/1289.json": "gold '\\frac{7}{5} + \\frac{1}{5} i.' ends in a period, "
                                               "read only as text",
    }),
]}

NAMES = (*SHIPPED, ARITH)

# Benchmarks of the seed's suite that do not ship, by the names a user would try, with how to evaluate them.
NOT_SHIPPED = dict.fromkeys(
    ("collegemath", "college_math", "college-math"),
    "College Math does not ship (its rows carry their textbooks' licences); evaluate your copy: --benchmarks "
    "/path/college_math_test.jsonl data.id_field=id data.skip_invalid=true (docs/data.md)")


def level_name(value) -> str:
    """One spelling of a MATH level: "Level 5", 5 and "5" are all "5"."""
    text = str(value).strip()
    return text[len("Level "):] if text.startswith("Level ") else text
