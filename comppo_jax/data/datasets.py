"""Problem sets: the synthetic default task, DAPO-Math-17K, and the frozen evaluation benchmarks.

Every loader returns `Problem`s (prompt text, gold answer, id, source) read from local files
(parquet, jsonl, a json list, or csv); DAPO-Math's may also be a gs:// file or a hub dataset id, fetched
first (`comppo_jax.hub`). A missing file raises
`DataError` naming the path and the expected format; a malformed row is skipped, counted, and
reported in one warning naming the file, the count and the first bad row.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import random
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from comppo_jax import hub

logger = logging.getLogger(__name__)

DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
DEV_SIZE = 500


class DataError(ValueError):
    """A data file is missing or unusable; the message names the path and the expected format."""


class Problem(NamedTuple):
    prompt: str  # the user message (templated for DAPO / GPQA)
    answer: str  # gold answer compared by the verifier
    id: str
    source: str
    solution: str | None = None  # a worked solution where the source has one (synthetic task)


def _malformed(reason: str) -> dict:
    return {"__malformed__": reason}


def read_records(path: str, expected: str) -> list[dict[str, Any]]:
    """Rows of a .parquet, .jsonl, .json (list of objects) or .csv file. `expected` describes the fields.

    A jsonl line or csv row that is not valid UTF-8 or JSON becomes a malformed row (skipped and
    counted by the loaders), so one bad row does not reject the file.
    """
    if not os.path.isfile(path):
        raise DataError(f"{path} does not exist; expected a .parquet, .jsonl, .json or .csv file with {expected}")
    if path.endswith(".parquet"):
        import pyarrow.parquet

        return pyarrow.parquet.read_table(path).to_pylist()
    if path.endswith(".jsonl"):
        rows = []
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                try:
                    text = line.decode("utf-8")
                    if text.strip():
                        rows.append(json.loads(text))
                except UnicodeDecodeError as error:
                    rows.append(_malformed(f"line {number}: not valid UTF-8 ({error.reason} at byte {error.start})"))
                except json.JSONDecodeError as error:
                    rows.append(_malformed(f"line {number}: {error}"))
        return rows
    if path.endswith(".csv"):
        # Undecodable bytes survive as lone surrogates, so the row holding them is found and skipped.
        with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
            rows = list(csv.DictReader(f))
        undecodable = lambda value: isinstance(value, str) and any("\udc80" <= c <= "\udcff" for c in value)
        return [
            _malformed(f"csv row {number}: not valid UTF-8") if any(undecodable(v) for v in row.values()) else row
            for number, row in enumerate(rows, 1)
        ]
    if path.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                rows = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise DataError(f"{path} is not a UTF-8 JSON list of objects with {expected} ({error})") from None
        if not isinstance(rows, list):
            raise DataError(f"{path} must hold a JSON list of objects with {expected}")
        return rows
    raise DataError(f"{path}: unsupported extension; expected .parquet, .jsonl, .json or .csv with {expected}")


def _convert_rows(
    path: str, rows: Iterable[dict], convert: Callable[[int, dict], Problem | None], source: str
) -> list[Problem]:
    problems, bad = [], []
    for index, row in enumerate(rows):
        try:
            if not isinstance(row, dict) or "__malformed__" in row:
                raise ValueError(
                    row.get("__malformed__", "not an object") if isinstance(row, dict) else "not an object"
                )
            problem = convert(index, row)
        except (KeyError, TypeError, ValueError, IndexError) as error:
            bad.append(f"row {index}: {type(error).__name__} {error}")
            continue
        if problem is not None:
            problems.append(problem)
    if bad:
        logger.warning("%s: skipped %d malformed %s row(s); first: %s", path, len(bad), source, bad[0])
    if not problems:
        raise DataError(
            f"{path}: no usable {source} rows ({len(bad)} malformed" + (f"; first: {bad[0]})" if bad else ")")
        )
    return problems


def _text(row: dict, *names: str) -> str:
    """The first present, non-empty field among `names` (case-insensitive), as a string."""
    lowered = {key.lower(): value for key, value in row.items()}
    for name in names:
        value = lowered.get(name.lower())
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        if value is not None and str(value).strip():
            return str(value).strip()
    raise KeyError(f"missing field, one of {names}")


def encodable_problems(
    tokenizer, problems: list[Problem], where: str, *, max_prompt_tokens: int | None = None
) -> list[Problem]:
    """The problems whose prompt, answer (and worked solution) `tokenizer` can encode, with a prompt
    of at most `max_prompt_tokens`; the others are skipped and counted in one warning naming
    `where` and the first one, like malformed rows. Runs at load time, so such a row cannot stop
    a run midway."""
    kept, bad = [], []
    for index, problem in enumerate(problems):
        try:
            length = len(tokenizer.encode_prompt(problem.prompt))
            for text in (problem.answer, problem.solution):
                if text is not None:
                    tokenizer.encode(text)
        except (ValueError, TypeError, KeyError) as error:
            bad.append(f"problem {index} ({problem.id or problem.prompt[:40]!r}): {error}")
            continue
        if max_prompt_tokens is not None and length > max_prompt_tokens:
            bad.append(
                f"problem {index} ({problem.id or problem.prompt[:40]!r}): {length} prompt tokens, "
                f"more than {max_prompt_tokens}"
            )
            continue
        kept.append(problem)
    if bad:
        logger.warning("%s: skipped %d problem(s) the tokenizer cannot encode; first: %s", where, len(bad), bad[0])
    if not kept:
        raise DataError(f"{where}: the tokenizer can encode none of its {len(problems)} problems; first: {bad[0]}")
    return kept


# --- DAPO-Math-17K -----------------------------------------------------------------------------

DAPO_FIELDS = "'prompt' (a chat message list or a string) and 'reward_model'.'ground_truth' (or 'answer')"


def _dapo_problem(index: int, row: dict) -> Problem:
    prompt = row["prompt"]
    if isinstance(prompt, (list, tuple)):  # the released parquet: [{"role": "user", "content": ...}]
        turns = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if not turns or not isinstance(turns[0], str):
            raise ValueError("the chat prompt has no user turn with string content")
        prompt = turns[0]
    elif not isinstance(prompt, str):
        raise TypeError(f"'prompt' is a {type(prompt).__name__}; expected a chat message list or a string")
    elif "Answer:" not in prompt:
        prompt = DAPO_TEMPLATE.format(problem=prompt.strip())
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict):
        answer = reward_model.get("ground_truth")
        # A row without a gold answer cannot be rewarded (as the answer "None", every reward would be no_answer).
        if answer is None or not str(answer).strip():
            found = repr(answer) if "ground_truth" in reward_model else "missing"
            raise ValueError(f"no gold answer: 'reward_model'.'ground_truth' is {found}")
    else:
        answer = _text(row, "answer", "solution")
    if not str(prompt).strip():
        raise ValueError("empty prompt")
    return Problem(str(prompt), str(answer).strip(), "", "dapo_math_17k")


def load_dapo_math(path: str, *, dev_size: int = DEV_SIZE, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """(train, dev) from a DAPO-Math-17K file: local, gs://, or a hub dataset id such as
    `BytedTsinghua-SIA/DAPO-Math-17k[@revision]` (its one parquet file).

    The released data repeats each problem about 100 times; rows are deduplicated by prompt
    (first occurrence kept). Prompts without the `Answer:` instruction get the DAPO template.
    The dev split is `dev_size` problems chosen by a seeded shuffle of the deduplicated
    problems' content hashes, so it does not depend on row order.
    """
    path = hub.resolve_dataset_file(path)
    problems = _convert_rows(path, read_records(path, DAPO_FIELDS), _dapo_problem, "DAPO-Math")
    unique: dict[str, Problem] = {}
    for problem in problems:
        key = hashlib.sha1(problem.prompt.encode()).hexdigest()
        unique.setdefault(key, problem._replace(id=key[:12]))
    keys = sorted(unique)
    random.Random(seed).shuffle(keys)
    if len(keys) <= dev_size:
        raise DataError(f"{path}: {len(keys)} unique problems, not more than the dev split ({dev_size})")
    dev = set(keys[:dev_size])
    return [unique[k] for k in sorted(unique) if k not in dev], [unique[k] for k in keys[:dev_size]]


# --- Frozen benchmarks -------------------------------------------------------------------------


def _simple(source: str, question: tuple[str, ...], answer: tuple[str, ...], postprocess=lambda a: a):
    def convert(index: int, row: dict) -> Problem:
        identifier = str(row.get("id", row.get("unique_id", row.get("ID", index))))
        return Problem(
            DAPO_TEMPLATE.format(problem=_text(row, *question)), postprocess(_text(row, *answer)), identifier, source
        )

    return convert


def _gsm8k_answer(text: str) -> str:
    if "####" not in text:
        raise ValueError("answer has no '####' final line")
    return text.rsplit("####", 1)[1].strip().replace(",", "")


GPQA_LETTERS = "ABCD"


def _gpqa(index: int, row: dict) -> Problem:
    """Multiple choice: the four options in a per-question seeded order; the gold is a letter."""
    question = _text(row, "Question")
    correct = _text(row, "Correct Answer")
    options = [correct] + [_text(row, f"Incorrect Answer {i}") for i in (1, 2, 3)]
    order = list(range(4))
    random.Random(hashlib.sha1(question.encode()).hexdigest()).shuffle(order)
    choices = "\n".join(f"({GPQA_LETTERS[slot]}) {options[option]}" for slot, option in enumerate(order))
    prompt = DAPO_TEMPLATE.format(problem=f"{question}\n\n{choices}\n\nAnswer with the letter of the correct option.")
    return Problem(prompt, GPQA_LETTERS[order.index(0)], str(row.get("Record ID", index)), "gpqa")


# name -> (converter, documented fields)
BENCHMARKS: dict[str, tuple[Callable[[int, dict], Problem], str]] = {
    "math500": (_simple("math500", ("problem",), ("answer",)), "'problem' and 'answer'"),
    "gsm8k": (
        _simple("gsm8k", ("question",), ("answer",), _gsm8k_answer),
        "'question' and 'answer' ending in '#### <number>'",
    ),
    "aime24": (_simple("aime24", ("problem", "question"), ("answer",)), "'problem' (or 'Problem') and 'answer'"),
    "aime25": (_simple("aime25", ("problem", "question"), ("answer",)), "'problem' (or 'Problem') and 'answer'"),
    "gpqa": (_gpqa, "'Question', 'Correct Answer', 'Incorrect Answer 1'..'3' (the GPQA csv columns)"),
    "livebench_math": (
        _simple("livebench_math", ("turns", "question"), ("ground_truth",)),
        "'turns' (first turn is the question) and 'ground_truth'",
    ),
    "olympiad": (
        _simple("olympiad", ("question", "problem"), ("final_answer", "answer")),
        "'question' and 'final_answer' (a list; the first is used)",
    ),
}


def load_benchmark(name: str, path: str) -> list[Problem]:
    """A frozen evaluation set from a file (local, gs://, or a hub dataset id holding one parquet file);
    `BENCHMARKS[name][1]` documents its fields."""
    if name not in BENCHMARKS:
        raise DataError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARKS)}")
    convert, fields = BENCHMARKS[name]
    path = hub.resolve_dataset_file(path, field=f"eval.benchmarks[{name}]")
    return _convert_rows(path, read_records(path, fields), convert, name)
