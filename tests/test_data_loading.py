import json
import string

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from caspo.data import (
    SHIPPED,
    TEMPLATES,
    ArithTask,
    DataError,
    arith_examples,
    encode_prompts,
    load_jsonl,
    render_prompt,
)

GSM8K = SHIPPED["gsm8k"].path


# ---------------------------------------------------------------- templates

def test_named_templates():
    assert render_prompt("arith", "1+1?") == "1+1?\nSolution:\n"
    assert render_prompt("plain", "q") == "q"
    assert render_prompt("rho-math", "q") == "[MATH_TASK] Problem:\nq\n\nSolution:"
    assert render_prompt("qwen-boxed", "q") == (
        "q\nLet's think step by step and output the final answer within \\boxed{}."
    )


def test_braces_in_query_are_kept():
    query = "Find $\\frac{1}{2} + {x}$ where {query} is literal and {0} too."
    assert render_prompt("qwen-boxed", query).startswith(query + "\n")
    assert render_prompt("Q: {query} A:", query) == f"Q: {query} A:"


def test_unknown_template():
    with pytest.raises(ValueError, match="arith.*plain.*qwen-boxed.*rho-math"):
        render_prompt("chatml", "q")
    assert set(TEMPLATES) >= {"arith", "qwen-boxed", "rho-math", "plain"}


# ---------------------------------------------------------------- prompt encoding

def char_tokenizer(bos=True):
    vocab = {ch: i for i, ch in enumerate(["<unk>", "<bos>", "<eos>", "\n", *string.printable[:95]])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    kwargs = dict(bos_token="<bos>") if bos else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", **kwargs)


def test_encode_prompts_bos_and_no_special_tokens():
    tok = char_tokenizer()
    texts = ["ab c", "x\ny"]
    ids = encode_prompts(tok, texts, add_bos=True, max_prompt_tokens=16)
    assert [len(x) for x in ids] == [5, 4]
    assert all(x[0] == tok.bos_token_id for x in ids)
    assert tok.decode(ids[1][1:]).replace(" ", "") == "x\ny"
    plain = encode_prompts(tok, texts, add_bos=False, max_prompt_tokens=16)
    assert plain == [x[1:] for x in ids]
    assert encode_prompts(tok, [], add_bos=True, max_prompt_tokens=4) == []


def test_encode_prompts_needs_bos_token():
    with pytest.raises(ValueError, match="BOS"):
        encode_prompts(char_tokenizer(bos=False), ["a"], add_bos=True, max_prompt_tokens=8)


def test_encode_prompts_overflow():
    tok = char_tokenizer()
    texts = ["short", "much too long"]
    with pytest.raises(ValueError, match=r"prompt 1 is 14 tokens.*data\.max_prompt_tokens=8"):
        encode_prompts(tok, texts, add_bos=True, max_prompt_tokens=8)
    ids = encode_prompts(tok, texts, add_bos=True, max_prompt_tokens=8, on_overflow="truncate_left")
    full = encode_prompts(tok, texts, add_bos=True, max_prompt_tokens=64)
    assert ids[0] == full[0]
    assert ids[1] == [tok.bos_token_id] + full[1][-7:]  # BOS, then the last tokens
    with pytest.raises(ValueError, match="on_overflow"):
        encode_prompts(tok, texts, add_bos=True, max_prompt_tokens=8, on_overflow="drop")


# ---------------------------------------------------------------- JSONL loading

def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_load_math_rows(tmp_path):
    path = write_jsonl(tmp_path / "good.jsonl", [
        {"problem": "What is 1+2?", "answer": "3", "solution": "1+2=3"},
        "",  # blank lines are ignored but still counted
        {"problem": "Half of 1?", "answer": "\\frac{1}{2}", "source": "x"},
        {"problem": "Two?", "answer": 2},
    ])
    result = load_jsonl(path)
    assert result.skipped == 0 and result.problems == []
    ex = result.examples
    assert [e.id for e in ex] == ["good-1", "good-3", "good-4"]
    assert [e.label for e in ex] == ["3", "\\frac{1}{2}", "2"]
    assert ex[0].query == "What is 1+2?" and ex[0].meta == {"solution": "1+2=3"}


def test_a_byte_order_mark_is_not_part_of_the_first_row(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"problem": "One?", "answer": "1"}\n{"problem": "Two?", "answer": "2"}\n')
    result = load_jsonl(path)
    assert result.skipped == 0 and [e.query for e in result.examples] == ["One?", "Two?"]


def test_a_line_separator_inside_a_string_does_not_split_the_row(tmp_path):
    # JSON allows U+2028, U+2029 and U+0085 raw inside a string; str.splitlines would split a row at them
    path = tmp_path / "raw.jsonl"
    rows = [{"problem": "One?\u2028Two\u2029three\x85four?", "answer": "1"}, {"problem": "", "answer": "2"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), encoding="utf-8")
    result = load_jsonl(path, skip_invalid=True)
    assert [e.query for e in result.examples] == [rows[0]["problem"]] and result.rows == 2
    assert result.problems == [f"{path}:2:problem: query must be a non-empty string, got ''"]  # line numbers hold


def test_load_prompt_label_rows(tmp_path):
    path = write_jsonl(tmp_path / "loop.jsonl", [{"prompt": "p1", "label": "3"}, {"prompt": "p2", "label": "-1"}])
    result = load_jsonl(path, query_field="prompt", label_field="label")
    assert [(e.query, e.label) for e in result.examples] == [("p1", "3"), ("p2", "-1")]


def test_id_field_and_duplicates(tmp_path):
    rows = [{"id": "a", "problem": "q", "answer": "1"}, {"id": 7, "problem": "q", "answer": "1"},
            {"id": "a", "problem": "q", "answer": "2"}]
    path = write_jsonl(tmp_path / "ids.jsonl", rows)
    with pytest.raises(DataError, match=r"1 invalid row of 3 \(a\); first: .*ids\.jsonl:3:id: duplicate id "
                                         r"\(first at .*ids\.jsonl:1\)"):
        load_jsonl(path, id_field="id")
    result = load_jsonl(path, id_field="id", skip_invalid=True)
    assert [e.id for e in result.examples] == ["a", "7"] and result.skipped == 1


GOOD = {"problem": "What is 2+2?", "answer": "4"}
BAD_ROWS = [
    ('{"problem": "q", "answer": "4"', ":2: invalid JSON"),
    ("[1, 2]", ":2: expected a JSON object, got list"),
    ({"answer": "4"}, ":2:problem: missing field"),
    ({"problem": "q"}, ":2:answer: missing field"),
    ({"problem": 12, "answer": "4"}, ":2:problem: query must be a non-empty string"),
    ({"problem": "  ", "answer": "4"}, ":2:problem: query must be a non-empty string"),
    ({"problem": "q", "answer": 0.5}, ":2:answer: label must be a non-empty string or an int"),
    ({"problem": "q", "answer": True}, ":2:answer: label must be a non-empty string or an int"),
    ({"problem": "q", "answer": None}, ":2:answer: label must be a non-empty string or an int"),
    ({"problem": "q", "answer": ""}, ":2:answer: label must be a non-empty string or an int"),
    ({"problem": "q", "answer": ["4"]}, ":2:answer: label must be a non-empty string or an int"),
    ({"problem": "q", "answer": "\\"}, ":2:answer: rejected by the verifier"),
]


@pytest.mark.parametrize("row, where", BAD_ROWS, ids=[where.split(": ", 1)[1] for _, where in BAD_ROWS])
def test_bad_row_names_file_line_field(tmp_path, row, where):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, row, GOOD])
    with pytest.raises(DataError) as info:
        load_jsonl(path)
    message = str(info.value)
    assert message.startswith(f"{path}: 1 invalid row of 3 (bad-2); first: {path}{where}")
    assert "data.skip_invalid=true" in message and "\n" not in message
    assert isinstance(info.value, ValueError)


def test_skip_invalid_counts_and_reports(tmp_path):
    rows = [GOOD, BAD_ROWS[0][0], GOOD, BAD_ROWS[2][0], BAD_ROWS[6][0], GOOD]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    result = load_jsonl(path, skip_invalid=True)
    assert [e.id for e in result.examples] == ["mixed-1", "mixed-3", "mixed-6"]
    assert result.skipped == 3
    assert [p.split(": ")[0] for p in result.problems] == [f"{path}:2", f"{path}:4:problem", f"{path}:5:answer"]


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl"):
        load_jsonl(tmp_path / "nope.jsonl")


def test_load_gsm8k():
    result = load_jsonl(GSM8K)
    assert len(result.examples) == 1319 and result.skipped == 0
    assert result.examples[0].id == "gsm8k-1" and result.examples[0].label == "18"


def test_arith_examples():
    task = ArithTask(seed=0, heldout_pool_size=50)
    examples = arith_examples(task, "heldout", 50)
    assert [e.id for e in examples[:2]] == ["arith-heldout-0", "arith-heldout-1"]
    for e, p in zip(examples, task.heldout):
        assert e.query == p.question and e.label == str(p.answer)
        assert e.meta["solution"] == p.solution
    with pytest.raises(ValueError, match=r"n=51 must be in \[0, 50\] for split 'heldout'"):
        arith_examples(task, "heldout", 51)
