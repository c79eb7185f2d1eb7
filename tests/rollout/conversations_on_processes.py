"""Multi-turn conversations on a mesh of 8 devices: one process with 8 fake CPU devices, or a
launch/local_cluster.py payload (2 processes x 4). Only process 0 steps the environment; every process
appends the replies process 0 broadcast. Prints one line "conversations {json}" per process: its
process index, the turns its environment saw, and the rows' tokens, masks and log-probs."""

import json

import jax
import numpy as np
from mesh_policy import sharded_policy  # this folder's sibling module (its docstring says why)

from comppo_jax import cli, sharding
from comppo_jax.data.datasets import Problem
from comppo_jax.environments import Environment, Reply
from comppo_jax.rollout.turns import converse

CALLS = tuple(range(10, 22))  # 12 of the 54 ids a random policy samples: most rows call within a few tokens


class IdTokenizer:
    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


class Echo(Environment):
    """Replies with the row's number and how many calls it has made; a row's third call ends it."""

    call_tokens = tuple(str(c) for c in CALLS)

    def __init__(self):
        self.turns = []

    def reset(self, problems):
        self.turns = []

    def step(self, turns):
        self.turns.extend(turns)
        seen = lambda row: sum(t.row == row for t in self.turns)
        return [
            Reply(done=True, reward=0.5) if seen(t.row) >= 3 else Reply(token_ids=(30 + t.row, 40 + seen(t.row)))
            for t in turns
        ]


def main(argv):
    del argv
    config, mesh, params = sharded_policy()
    rng = np.random.default_rng(0)  # the same prompts on every process
    prompts = rng.integers(22, 64, (4, 7)).astype(np.int32)
    mask = np.ones((4, 7), bool)
    environment = Echo()
    with jax.set_mesh(mesh):
        out = converse(
            params,
            config,
            prompts,
            mask,
            jax.random.PRNGKey(1),
            environment,
            [Problem(f"p{i}", "0", f"id{i}", "test") for i in range(4)],
            IdTokenizer(),
            max_new_tokens=16,
            max_turns=4,
            max_reply_tokens=2,
            num_samples=2,
            page_size=4,
        )
    generation = out.generation
    rows = {
        name: sharding.to_host(value).tolist()
        for name, value in (
            ("response_tokens", generation.response_tokens),
            ("response_mask", generation.response_mask),
            ("env_mask", out.env_mask),
            ("turn_rewards", out.turn_rewards),
            ("log_probs", generation.log_probs),
        )
    }
    seen = [[t.row, list(t.token_ids)] for t in environment.turns]
    record = dict(process=jax.process_index(), turns=seen, calls=out.calls.tolist(), outcomes=out.outcomes, **rows)
    print("conversations " + json.dumps(record), flush=True)


if __name__ == "__main__":
    cli.run(main)
