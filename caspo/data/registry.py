"""The benchmarks that ship with caspo, addressed by name (`data.source=dsr_sub`, `--benchmarks math500`).

The files in `caspo/data/benchmarks/` are byte-for-byte copies of the project's curated JSONL
files; their sources, licences and how they were built are in `caspo/data/benchmarks/LICENSES.md`.
`known_invalid` lists the rows the loader rejects (source defects, and golds the verifier reads
only as text) and the rows whose gold is not the problem's answer (WRONG_GOLD): they are left out of
every load of that benchmark and named in its summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

BENCHMARK_DIR = Path(__file__).resolve().parent / "benchmarks"
ARITH = "arith"  # the procedural task: no file, its own held-out split
HELDOUT = "heldout"  # as an eval benchmark, the run's own held-out set (caspo.eval.benchmarks)
# Begins the reason of a known invalid row whose gold the verifier reads but which is not the answer (MATH's
# gold is the last \boxed{} of its solution: one of several solutions asked for): left out all the same.
WRONG_GOLD = "wrong gold: "


@dataclass(frozen=True)
class Benchmark:
    name: str
    file: str  # in BENCHMARK_DIR
    rows: int
    known_invalid: dict[str, str] = field(default_factory=dict)  # id -> why the loader leaves it out
    subject_field: str | None = None  # per-subject and per-level tables (MATH, MATH-500)
    level_field: str | None = None
    query_field: str = "problem"
    label_field: str = "answer"
    id_field: str = "id"

    @property
    def path(self) -> Path:
        return BENCHMARK_DIR / self.file


# MATH rows whose gold, the last \boxed{} of the solution, is one of several answers the problem asks for or
# accepts, or not its answer at all: a fully correct response would score 0. None of them is in MATH-500.
MATH_WRONG_GOLDS = {
    "test/algebra/1730.json": "'3', while the solution's answer is -3 (it accepts 3 as well)",
    "test/algebra/1878.json": "'1' is one of the two solutions asked for (-2, 1)",
    "test/intermediate_algebra/25.json": "'(0,0)' is one of the two foci, either accepted ((10,0), (0,0))",
    "test/intermediate_algebra/225.json": "'\\frac{2}{5}' is one of the two solutions asked for (3, 2/5)",
    "test/intermediate_algebra/702.json": "'(-5/2, -5/2)' is one of the two vertices, either accepted "
                                          "((3/2, -5/2), (-5/2, -5/2))",
    "test/intermediate_algebra/747.json": "'(0,0)' is the second answer the solution accepts; its first is (3,-5)",
    "test/intermediate_algebra/1020.json": "'-3 + 6i' is one of the three values asked for (5 - 10i, 11, -3 + 6i)",
    "test/intermediate_algebra/1855.json": "'-\\tfrac34' is one of the two solutions asked for (-3/2, -3/4)",
    "test/intermediate_algebra/2089.json": "'10879' is one of the two values asked for (-10879, 10879)",
    "test/prealgebra/177.json": "'12' is an intermediate value (the problem writes its function as \\boxed{}); "
                                "the answer is 6",
    "test/precalculus/679.json": "'\\frac{5\\pi}{4}' is one of the two solutions asked for (pi/4, 5pi/4)",
    "test/precalculus/1227.json": "'2' is one of the two values asked for (-1, 2)",
    "test/precalculus/1233.json": "'105^\\circ' is one of the three angles asked for (30, 45, 105 degrees)",
}

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
        **{row_id: WRONG_GOLD + why for row_id, why in MATH_WRONG_GOLDS.items()},
    }),
]}

NAMES = (*SHIPPED, ARITH)

# Benchmarks of the seed's suite that do not ship, by the names a user would try, with how to evaluate them.
NOT_SHIPPED = dict.fromkeys(
    ("collegemath", "college_math", "college-math"),
    "College Math does not ship (its rows carry their textbooks' licences); evaluate your copy: --benchmarks "
    "/path/college_math_test.jsonl --preset qwen-math-dsr data.id_field=id data.skip_invalid=true (docs/data.md)")


def level_name(value) -> str:
    """One spelling of a MATH level: "Level 5", 5 and "5" are all "5"."""
    text = str(value).strip()
    return text[len("Level "):] if text.startswith("Level ") else text
