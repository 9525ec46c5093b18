from __future__ import annotations

import ast
import operator
import re

import pytest
from tests.gsm8k_fixture import gsm8k_fixture_rows, write_gsm8k_fixture

from pipeline.data.formats import read_rows
from pipeline.data.gsm8k import DATA_SOURCE, INSTRUCTION, answer_number, gsm8k_to_rl
from pipeline.data.loader import load_prompts
from pipeline.data.records import BadRowError
from pipeline.rewards.gsm8k import compute_score

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def _eval(expr: str) -> float:
    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(expr)

    return walk(ast.parse(expr, mode="eval").body)


def test_fixture_is_32_problems_with_correct_arithmetic():
    rows = gsm8k_fixture_rows()
    assert len(rows) == 32
    assert len({r["question"] for r in rows}) == 32
    for row in rows:
        annotations = re.findall(r"<<([^=]+)=([^>]+)>>", row["answer"])
        assert annotations, row
        for expr, value in annotations:
            assert _eval(expr) == float(value), (expr, value)
        assert answer_number(row["answer"]) == annotations[-1][1]
        assert compute_score(row["answer"], answer_number(row["answer"])) == 1.0
    finals = [answer_number(r["answer"]) for r in rows]
    assert any(f.startswith("-") for f in finals)  # a negative answer
    assert any("," in r["answer"].split("####")[1] for r in rows)  # a thousands separator


def test_conversion_matches_the_verl_schema():
    row = {"question": "How many?", "answer": "2 + 2 = <<2+2=4>>4\n#### 1,004"}
    rl = gsm8k_to_rl(row, 7, "train")
    assert rl == {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"How many? {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1004"},
        "extra_info": {
            "split": "train",
            "index": 7,
            "answer": row["answer"],
            "question": "How many?",
        },
    }
    with pytest.raises(BadRowError, match="row 3: GSM8K answer has no '####'"):
        gsm8k_to_rl({"question": "q", "answer": "4"}, 3, "train")
    with pytest.raises(BadRowError, match="string 'question' and 'answer'"):
        gsm8k_to_rl({"question": "q"}, 0, "train")


def test_fixture_files_round_trip_through_the_loader(tmp_path):
    paths = write_gsm8k_fixture(tmp_path)
    assert read_rows(paths.raw_jsonl) == read_rows(paths.raw_parquet) == gsm8k_fixture_rows()
    from_jsonl = load_prompts(paths.rl_jsonl, dataset_name="gsm8k_fixture")
    from_parquet = load_prompts(paths.rl_parquet, dataset_name="gsm8k_fixture")
    assert from_jsonl == from_parquet
    assert len(from_jsonl) == 32
    assert all(r.messages and r.data_source == DATA_SOURCE for r in from_jsonl)
    assert all(compute_score(r.extra_info["answer"], r.ground_truth) == 1.0 for r in from_jsonl)
