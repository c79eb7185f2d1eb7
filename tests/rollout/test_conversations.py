"""Multi-turn conversations on the paged engine: replies appended as tokens, pages kept between turns,
token in and token out."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import cluster_tail, fake_devices_env, launch_script, on_local_cluster

from comppo_jax.data.datasets import Problem
from comppo_jax.environments import Environment, Reply
from comppo_jax.rollout import engine, generate, turns
from comppo_jax.rollout.scoring import score_rollout
from comppo_jax.rollout.turns import converse
from tests.rollout.test_engine import CONFIG, PROMPT_MASK, PROMPTS, params  # noqa: F401  (fixture)

PROBLEMS = [Problem(f"p{i}", "0", f"id{i}", "test") for i in range(PROMPTS.shape[0])]
REPLY = (41, 42, 43)


class IdTokenizer:
    """Token ids as text ("5 17 3"): decode then encode gives the ids back only for whole turns."""

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


class Scripted(Environment):
    """Replies REPLY (or `done` after `stop_after` calls of a row), recording every turn it saw."""

    def __init__(self, calls: tuple[int, ...], stop_after: int | None = None, reply: tuple[int, ...] = REPLY):
        self.call_tokens = tuple(str(c) for c in calls)
        self.stop_after, self.reply, self.turns, self.problems = stop_after, reply, [], None

    def reset(self, problems):
        self.problems, self.turns = list(problems), []

    def step(self, turns):
        self.turns.extend(turns)
        seen = lambda row: sum(t.row == row for t in self.turns)
        return [
            Reply(done=True) if self.stop_after and seen(t.row) > self.stop_after else Reply(token_ids=self.reply)
            for t in turns
        ]


@pytest.fixture(scope="module")
def call(params):  # noqa: F811
    """Call tokens sampled often enough that most rows call at least once in 24 tokens."""
    # The keywords of test_without_calls_a_conversation_is_generate's sampler: one program for both.
    sampled = generate(
        params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(5), max_new_tokens=24, num_samples=2, temperature=1.0
    )
    ids, counts = np.unique(np.asarray(sampled.response_tokens), return_counts=True)
    return tuple(int(i) for i in ids[np.argsort(counts)[-6:]])


def talk(params, environment, **kwargs):  # noqa: F811
    options = dict(max_new_tokens=24, max_turns=4, num_samples=2, temperature=1.0, page_size=2, decode_slots=3)
    options.update(kwargs)
    return converse(
        params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(6), environment, PROBLEMS, IdTokenizer(), **options
    )


@pytest.fixture(scope="module")
def conversation(params, call):  # noqa: F811
    """talk() with Scripted(call), its programs traced afresh: (its Conversations, the environment, the
    shapes of the prompts the traced engine prefilled). Shared by the tests that read this conversation."""
    prefilled = []
    original = engine.prefill_prompts

    def recording(params, config, tokens, *args):  # noqa: F811
        prefilled.append(tokens.shape)
        return original(params, config, tokens, *args)

    environment = Scripted(call)
    # Another test file in this process may have traced the engine's steps already: trace them afresh (not
    # jax.clear_caches(), which would drop every program compiled so far, the call fixture's sampler too).
    for program in (turns._start, turns._decode, turns._resume):
        program.clear_cache()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "prefill_prompts", recording)
        out = talk(params, environment)
    return out, environment, prefilled


def test_replies_are_appended_as_the_environments_tokens_and_never_sampled(conversation, call):
    out, environment, _ = conversation
    response = np.asarray(out.generation.response_tokens)
    mask, env = np.asarray(out.generation.response_mask), np.asarray(out.env_mask)
    assert out.outcomes["ok"] == len(environment.turns) > 4 and (out.calls >= 1).sum() > 4
    for turn in environment.turns:  # each turn is the row's own tokens since its last reply, ending at the call
        assert turn.token_ids[-1] in call
        row = response[turn.row]
        starts = [
            t
            for t in range(len(row) - len(turn.token_ids) + 1)
            if tuple(row[t : t + len(turn.token_ids)]) == turn.token_ids
        ]
        assert starts and not env[turn.row, starts[0] : starts[0] + len(turn.token_ids)].any()
    for r in range(len(response)):
        spans = np.flatnonzero(np.diff(np.concatenate([[0], env[r].astype(int), [0]])))
        for start, stop in zip(spans[::2], spans[1::2]):  # every reply: REPLY (or cut by the token limit) after a call
            assert response[r, start - 1] in call
            assert tuple(response[r, start:stop]) == REPLY[: stop - start]
            assert stop - start == len(REPLY) or stop == mask[r].sum()
    assert (np.asarray(out.generation.log_probs)[env] == 0).all()


@pytest.mark.parametrize("reply", [REPLY, ()])
def test_sampled_log_probs_equal_the_scoring_pass_of_the_whole_conversation(params, call, reply):  # noqa: F811
    """The pages a row keeps between turns hold exactly its tokens: a teacher-forced pass over the
    conversation (prompt, turns and replies) gives the sampler's log-probs at every policy token,
    also where an empty reply has the policy sample right after its call."""
    environment = Scripted(call, reply=reply)
    out = talk(params, environment)
    assert len(environment.turns) > 4
    scored = score_rollout(params, None, CONFIG, out.generation, temperature=1.0, top_k=None, backend="reference")
    policy = np.asarray(out.generation.response_mask) & ~np.asarray(out.env_mask)
    np.testing.assert_allclose(
        np.asarray(scored.log_probs)[policy], np.asarray(out.generation.log_probs)[policy], atol=1e-5
    )


def test_rows_depend_on_the_rng_and_replies_only_not_on_slots_or_pages(params, call, conversation):  # noqa: F811
    reference = conversation[0]
    for page_size, decode_slots in [(4, 1)]:  # pages and slots differ from talk()'s (2, 3)
        other = talk(params, Scripted(call), page_size=page_size, decode_slots=decode_slots)
        np.testing.assert_array_equal(other.generation.tokens, reference.generation.tokens)
        np.testing.assert_array_equal(other.env_mask, reference.env_mask)


def test_without_calls_a_conversation_is_generate(params, call):  # noqa: F811
    # Call tokens past the vocabulary, never sampled; as many as `call`'s, with max_turns as in the next test's
    # first case: its compiled decode loop (without a call no turn ever ends, whatever max_turns).
    never = tuple(CONFIG.vocab_size + 1 + i for i in range(len(call)))
    out = talk(params, Scripted(never), max_turns=2)
    plain = generate(
        params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(6), max_new_tokens=24, num_samples=2, temperature=1.0
    )
    np.testing.assert_array_equal(out.generation.tokens, plain.tokens)
    np.testing.assert_allclose(out.generation.log_probs, plain.log_probs, atol=1e-6)
    assert not np.asarray(out.env_mask).any()


@pytest.mark.parametrize("max_turns,stop_after", [(2, None), (4, 1)])
def test_a_row_ends_at_its_last_turns_call_or_when_the_environment_is_done(params, call, max_turns, stop_after):  # noqa: F811
    out = talk(params, Scripted(call, stop_after), max_turns=max_turns)
    response, mask = np.asarray(out.generation.response_tokens), np.asarray(out.generation.response_mask)
    ended = np.flatnonzero(out.calls == 2)
    assert out.calls.max() == 2 and len(ended) > 1
    for r in ended:  # the second call ends the row, unanswered
        assert response[r, mask[r].sum() - 1] in call and not np.asarray(out.env_mask)[r, mask[r].sum() - 1]


def test_the_prompts_are_prefilled_once_for_all_turns(conversation):
    # The fixture traced the engine's three steps (start, decode, resume): a prefill in any of them would show.
    _, environment, prefilled = conversation
    assert len(environment.turns) > 4 and prefilled == [PROMPTS.shape]


def _records(stdout: str) -> dict[int, dict]:
    # local_cluster.py prefixes each process's lines with "[p<i>] "
    lines = [line.split("conversations ", 1)[1] for line in stdout.splitlines() if "conversations {" in line]
    records = [json.loads(line) for line in lines]
    return {record.pop("process"): record for record in records}


@pytest.mark.slow
def test_two_processes_converse_as_one_and_only_process_0_steps_the_environment():
    """A conversation on a mesh of 8 devices, in one process and in two (launch/local_cluster.py): the
    same tokens, masks, rewards and calls on every process, log-probs within 1e-5; process 1's
    environment never sees a turn, yet its rows hold process 0's replies."""
    payload = "tests/rollout/conversations_on_processes.py"
    one = launch_script(payload, env=fake_devices_env(8))
    assert one.returncode == 0, (one.stdout + one.stderr)[-4000:]
    (reference,) = _records(one.stdout).values()
    cluster = on_local_cluster([], script=payload)
    assert cluster.returncode == 0, cluster_tail(cluster)
    processes = _records(cluster.stdout)
    assert sorted(processes) == [0, 1]
    assert reference["turns"] and reference["outcomes"]["ok"] > 4 and max(reference["calls"]) == 3
    assert processes[0]["turns"] == reference["turns"] and processes[1]["turns"] == []
    for record in processes.values():
        for field in ("response_tokens", "response_mask", "env_mask", "turn_rewards", "calls", "outcomes"):
            assert record[field] == reference[field], field
        np.testing.assert_allclose(record["log_probs"], reference["log_probs"], atol=1e-5, rtol=0)
