"""Data loaders on small files written here in every supported format, and the tokenizers."""

from __future__ import annotations

import csv
import json
import logging

import numpy as np
import pyarrow
import pyarrow.parquet
import pytest
from conftest import save_word_tokenizer

from comppo_jax.data.datasets import BENCHMARKS, DAPO_TEMPLATE, DataError, load_benchmark, load_dapo_math
from comppo_jax.data.synthetic import chained_arithmetic
from comppo_jax.data.tokenizers import CharTokenizer, load_tokenizer, pad_batch


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_synthetic_task_is_deterministic_multi_step_and_self_consistent():
    problems = chained_arithmetic(50, seed=3)
    assert problems == chained_arithmetic(50, seed=3) and problems != chained_arithmetic(50, seed=4)
    for problem in problems:
        steps = problem.solution.splitlines()
        assert len(steps) >= 3 and steps[-1] == f"Answer: {problem.answer}"
        value = int(problem.prompt.split()[0])
        for token in problem.prompt.split()[1:-1]:
            value = eval(f"{value}{token}") % 1000  # the prompt's own operations
        assert str(value) == problem.answer
        CharTokenizer().encode(problem.prompt + problem.solution)


def dapo_rows(count, copies):
    rows = []
    for i in range(count):
        row = {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": DAPO_TEMPLATE.format(problem=f"What is {i} + 1?")}],
            "reward_model": {"ground_truth": str(i + 1), "style": "rule-lang"},
        }
        rows += [row] * copies
    return rows


def test_dapo_parquet_is_deduplicated_and_split_deterministically(tmp_path):
    rows = dapo_rows(30, copies=100)
    path = str(tmp_path / "dapo.parquet")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    train, dev = load_dapo_math(path, dev_size=5)
    assert len(train) == 25 and len(dev) == 5 and not {p.id for p in train} & {p.id for p in dev}
    assert all("Answer:" in p.prompt for p in train + dev)
    # Row order does not change the split.
    shuffled = str(tmp_path / "shuffled.parquet")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows[::-1]), shuffled)
    assert [p.id for p in load_dapo_math(shuffled, dev_size=5)[1]] == [p.id for p in dev]


def test_dapo_jsonl_with_plain_prompts_gets_the_template_and_bad_rows_are_counted(tmp_path, caplog):
    rows = [{"prompt": f"Compute {i}*2.", "answer": str(2 * i)} for i in range(12)]
    rows += [{"prompt": "no answer here"}, {"answer": "7"}]
    path = tmp_path / "dapo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
    with caplog.at_level(logging.WARNING):
        train, dev = load_dapo_math(str(path), dev_size=2)
    assert len(train) + len(dev) == 12
    assert train[0].prompt.startswith("Solve the following math problem") and "Compute" in train[0].prompt
    assert "skipped 3 malformed DAPO-Math row(s)" in caplog.text and str(path) in caplog.text


def test_dapo_rows_without_a_gold_answer_are_skipped_and_counted_and_a_file_of_them_is_refused(tmp_path, caplog):
    """A null, missing or empty ground truth is not loaded as the answer "None" (no response could
    be rewarded): the row is skipped like a malformed one, and a file with no gold answers fails."""
    rows = dapo_rows(10, copies=1)
    unanswered = [
        {**rows[0], "prompt": [{"role": "user", "content": f"Unanswered {i}?"}], "reward_model": reward_model}
        for i, reward_model in enumerate(
            [{"ground_truth": None, "style": "rule"}, {"style": "rule"}, {"ground_truth": " ", "style": "rule"}]
        )
    ]
    path = str(tmp_path / "dapo.parquet")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows[:3] + unanswered + rows[3:]), path)
    with caplog.at_level(logging.WARNING):
        train, dev = load_dapo_math(path, dev_size=2)
    assert len(train) + len(dev) == 10 and "None" not in {p.answer for p in train + dev}
    assert (
        f"{path}: skipped 3 malformed DAPO-Math row(s); first: row 3: ValueError no gold answer: "
        "'reward_model'.'ground_truth' is None" in caplog.text
    )

    jsonl = write_jsonl(
        tmp_path / "unanswered.jsonl", [{**row, "reward_model": {"ground_truth": None}} for row in rows]
    )
    with pytest.raises(
        DataError,
        match=r"unanswered\.jsonl: no usable DAPO-Math rows \(10 malformed; first: row 0: "
        r"ValueError no gold answer: 'reward_model'\.'ground_truth' is None\)",
    ):
        load_dapo_math(jsonl, dev_size=2)


def test_missing_file_names_the_path_and_format(tmp_path):
    with pytest.raises(DataError, match=r"nope\.parquet does not exist; expected .*'reward_model'"):
        load_dapo_math(str(tmp_path / "nope.parquet"))
    with pytest.raises(DataError, match=r"unknown benchmark 'mmlu'"):
        load_benchmark("mmlu", str(tmp_path / "x.jsonl"))


def test_every_benchmark_format(tmp_path):
    write_jsonl(tmp_path / "math500.jsonl", [{"problem": "1+1?", "answer": "2", "unique_id": "a"}])
    write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": "Tom has 1,000 apples...", "answer": "work\n#### 1,200"}])
    pyarrow.parquet.write_table(
        pyarrow.Table.from_pylist([{"ID": "2024-I-1", "Problem": "Find x.", "Answer": "204"}]),
        str(tmp_path / "aime.parquet"),
    )
    with open(tmp_path / "gpqa.csv", "w", newline="") as f:
        writer = csv.DictWriter(
            f,
            [
                "Record ID",
                "Question",
                "Correct Answer",
                "Incorrect Answer 1",
                "Incorrect Answer 2",
                "Incorrect Answer 3",
            ],
        )
        writer.writeheader()
        writer.writerow(
            {
                "Record ID": "r1",
                "Question": "Which is a noble gas?",
                "Correct Answer": "Neon",
                "Incorrect Answer 1": "Iron",
                "Incorrect Answer 2": "Carbon",
                "Incorrect Answer 3": "Sodium",
            }
        )
    (tmp_path / "livebench.json").write_text(json.dumps([{"turns": ["Evaluate 3^2."], "ground_truth": "9"}]))
    write_jsonl(tmp_path / "olympiad.jsonl", [{"question": "Find n.", "final_answer": ["$5$"]}, {"question": "broken"}])

    assert load_benchmark("math500", str(tmp_path / "math500.jsonl"))[0][1:3] == ("2", "a")
    assert load_benchmark("gsm8k", str(tmp_path / "gsm8k.jsonl"))[0].answer == "1200"
    assert load_benchmark("aime24", str(tmp_path / "aime.parquet"))[0][1:3] == ("204", "2024-I-1")
    gpqa = load_benchmark("gpqa", str(tmp_path / "gpqa.csv"))[0]
    assert f"({gpqa.answer}) Neon" in gpqa.prompt
    assert load_benchmark("livebench_math", str(tmp_path / "livebench.json"))[0].answer == "9"
    olympiad = load_benchmark("olympiad", str(tmp_path / "olympiad.jsonl"))
    assert len(olympiad) == 1 and olympiad[0].answer == "$5$"
    assert set(BENCHMARKS) == {"math500", "gsm8k", "aime24", "aime25", "gpqa", "livebench_math", "olympiad"}


def test_char_tokenizer_and_padding():
    tokenizer = load_tokenizer(None)
    ids = tokenizer.encode_prompt("7 +5 =?\n")
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids) == "7 +5 =?\n"
    with pytest.raises(ValueError, match="printable ASCII"):
        tokenizer.encode("π")
    tokens, mask = pad_batch([[5, 6, 7], [8]], 0, side="left")
    np.testing.assert_array_equal(tokens, [[5, 6, 7], [0, 0, 8]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [0, 0, 1]])


def test_hf_tokenizer_from_a_local_directory_uses_the_chat_template(tmp_path):
    vocab = save_word_tokenizer(tmp_path / "tok", ["what", "is", "2", "+", "?"])
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    ids = tokenizer.encode_prompt("what is 2 + 2 ?")
    assert ids[0] == vocab["<user>"] and ids[-1] == vocab["<assistant>"]
    assert tokenizer.decode(tokenizer.encode("what is 2")) == "what is 2"
    with pytest.raises(FileNotFoundError, match="missing_dir does not exist"):
        load_tokenizer(str(tmp_path / "missing_dir"))


def test_undecodable_role_less_and_wrongly_typed_rows_are_skipped_and_counted(tmp_path, caplog):
    good = [json.dumps(row).encode() for row in dapo_rows(8, copies=1)]
    bad = [
        b'{"prompt": "What is 1 + \xff?", "answer": "2"}',  # not UTF-8
        json.dumps({"prompt": [{"role": "system", "content": "no user turn"}], "answer": "1"}).encode(),
        json.dumps({"prompt": {"content": "a dict"}, "answer": "1"}).encode(),
    ]
    path = tmp_path / "dapo.jsonl"
    path.write_bytes(b"\n".join(good[:4] + bad + good[4:]) + b"\n")
    with caplog.at_level(logging.WARNING):
        train, dev = load_dapo_math(str(path), dev_size=2)
    assert len(train) + len(dev) == 8
    assert "skipped 3 malformed DAPO-Math row(s)" in caplog.text and "line 5: not valid UTF-8" in caplog.text


def test_a_csv_row_that_is_not_utf8_is_skipped_not_the_file(tmp_path, caplog):
    path = tmp_path / "math500.csv"
    path.write_bytes(b"problem,answer\nWhat is 1 + 1?,2\nWhat is \xe9 + 1?,3\nWhat is 2 + 2?,4\n")
    with caplog.at_level(logging.WARNING):
        problems = load_benchmark("math500", str(path))
    assert [p.answer for p in problems] == ["2", "4"] and "csv row 2: not valid UTF-8" in caplog.text


def test_problems_the_tokenizer_cannot_encode_are_skipped_at_load_time(caplog):
    from comppo_jax.data.datasets import Problem, encodable_problems

    problems = [
        Problem("What is 1 + 1?", "2", "a", "t"),
        Problem("What is π + 1?", "4.14", "b", "t"),
        Problem("What is 2 + 2?", "4", "c", "t"),
        Problem("x" * 50, "1", "d", "t"),
    ]
    with caplog.at_level(logging.WARNING):
        kept = encodable_problems(CharTokenizer(), problems, "dapo.jsonl (train)", max_prompt_tokens=40)
    assert [p.id for p in kept] == ["a", "c"]
    assert "dapo.jsonl (train): skipped 2 problem(s) the tokenizer cannot encode; first: problem 1 ('b')" in caplog.text
    with pytest.raises(DataError, match="can encode none of its 1 problems"):
        encodable_problems(CharTokenizer(), problems[1:2], "dev")
