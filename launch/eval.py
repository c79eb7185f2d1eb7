"""Evaluate a training run's checkpoint: greedy pass@1, avg@n, unbiased pass@k and majority@n per problem set.

    python launch/eval.py --checkpoint=runs/tiny [--step=latest|best|N] \
        [--config.eval.samples=8 --config.eval.temperature=1.0 --config.eval.top_p=0.7 --config.eval.pass_k=1,8]

The config is the run's own (the config.json it wrote, through configs/run.py), so the dev set,
the sampler and the model are the ones it trained with; `--config.eval.samples=8` overrides a field
on top of it, and `--config=<preset>.py` replaces it.

Restores only the actor params (onto this machine's `config.mesh`), then evaluates the ID dev
set and every frozen benchmark in `config.eval.benchmarks` ("math500=/data/math500.jsonl,...";
loaders in comppo_jax.data.datasets.BENCHMARKS). Per problem: one greedy response and n =
`eval.samples` responses at `eval.temperature` / `eval.top_p`, giving avg@n (their mean accuracy),
pass@k (Chen et al.'s unbiased estimator, for each k of `eval.pass_k`, default 1 and n) and
majority@n; each set's value comes with its standard error over problems (`<metric>_se`;
comppo_jax.eval.frozen). Each set's result is written to `<output>/<set>.json` as soon as it is
done, with what decides its numbers: the policy's digest (of the restored weights' content, so a
step saved again with other weights is another policy), the set's digest (of its problems as
loaded: the benchmark file, the dev split as config.data selects it) and the settings. A rerun
reuses it only when all three are the same, and otherwise says why in one line and evaluates the
set again; the table (with the unweighted macro average over the frozen benchmarks) is printed and
written as results.csv and results.json, in the folder its last line names. `<output>` defaults to
`<checkpoint>/eval/step_<N>`. Its first line names the step it restores, and each set shows a
progress bar while it is evaluated.

`--held_out_problems=N` also writes `<output>/held_out.json`: the checkpoint's realized gate
statistics and critic diagnostics on the first N dev prompts (comppo_jax.eval.held_out);
`--accuracy=False` skips the accuracy sets.

Multi-host: run it on every host like launch/train.py (docs/reliability.md); every process
evaluates its shards and process 0 writes the results.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import sys

from absl import flags

from comppo_jax import cli, storage

_CONFIG = cli.define_config_file(
    "config", None, "An ml_collections config file (default: the run's own, configs/run.py:<checkpoint>)."
)
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", None, "The training run's output_dir (holding checkpoints/).", required=True
)
_STEP = flags.DEFINE_string("step", "latest", "latest, best (by dev accuracy) or a saved step number.")
_OUTPUT = flags.DEFINE_string("output", "", "Where results go (default <checkpoint>/eval/step_<N>).")
_ACCURACY = flags.DEFINE_bool(
    "accuracy", True, "Evaluate greedy pass@1, avg@n, pass@k and majority@n on the dev set and benchmarks."
)
_HELD_OUT = flags.DEFINE_integer(
    "held_out_problems", 0, "Gate and critic diagnostics on this many dev prompts (0: none)."
)
cli.check_location_flags("checkpoint", "output")


def parse_benchmarks(spec: str) -> dict[str, str]:
    """ "name=path,name=path" -> {name: path}."""
    out = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"config.eval.benchmarks item {item!r}: expected name=path")
        storage.check_location(path.strip(), f"config.eval.benchmarks {name.strip()}")
        out[name.strip()] = path.strip()
    return out


def main(argv):
    del argv
    import jax

    from comppo_jax import environments, sharding
    from comppo_jax.data.datasets import load_benchmark
    from comppo_jax.data.rewards import VerifierPool
    from comppo_jax.data.tokenizers import load_tokenizer
    from comppo_jax.eval import evaluate_problems
    from comppo_jax.eval.frozen import eval_sampling, metric_names
    from comppo_jax.eval.restore import eval_meshes, policy_digest, resolve_step, restore_actor
    from comppo_jax.rollout.turns import ToolUse
    from comppo_jax.runs.checkpoint import RunCheckpoints
    from comppo_jax.train import decode_layout
    from comppo_jax.train.progress import first_call_notices
    from comppo_jax.train.specs import resolve
    from comppo_jax.train.start import load_problems

    cfg = _CONFIG.value
    benchmarks = parse_benchmarks(cfg.eval.benchmarks)
    ks = eval_sampling(cfg.eval)  # a bad field fails here, before any restore
    sharding.initialize_distributed(cfg.mesh)  # before anything touches a JAX backend (Orbax does)
    mesh, rollout_devices = eval_meshes(cfg.mesh)  # a mesh this machine cannot hold fails before any restore
    checkpoints = RunCheckpoints(_CHECKPOINT.value, read_only=True)
    step = resolve_step(checkpoints, _STEP.value, cfg)
    output = storage.path(_OUTPUT.value or storage.join(_CHECKPOINT.value, "eval", f"step_{step}"))
    main_process = jax.process_index() == 0  # a multi-process run: every process evaluates, process 0 writes
    if main_process:  # the restore and the first compile take a while before any set's progress bar
        print(f"restoring step {step} of {_CHECKPOINT.value} ...", flush=True)
    if _HELD_OUT.value:
        from comppo_jax.eval.held_out import held_out_diagnostics

        diagnostics = held_out_diagnostics(cfg, checkpoints, step, _HELD_OUT.value)
        if main_process:
            storage.write_text(output / "held_out.json", json.dumps(diagnostics, indent=2))
            print(json.dumps(diagnostics, indent=2))
    if not _ACCURACY.value:
        return
    sets = {"id_dev": load_problems(cfg.data, cfg.seed)[1]} if cfg.data.kind == "synthetic" or cfg.data.path else {}
    sets.update(
        {name: load_benchmark(name, path) for name, path in benchmarks.items()}
    )  # fails now on a bad file, not midway
    samples = cfg.eval.samples
    settings = {
        "samples": samples,
        "temperature": cfg.eval.temperature,
        "top_p": cfg.eval.top_p,
        "pass_k": list(ks),
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "seed": cfg.seed,
        "batch_size": cfg.eval.batch_size,  # the sampling keys follow the batches
        "tokenizer": cfg.model.tokenizer or cfg.model.path,
    }
    if cfg.rollout.get("environment", ""):  # a tool run's answers are conversations (kept results say so)
        settings.update({name: cfg.rollout[name] for name in ("environment", "max_turns", "max_reply_tokens")})
    policy_config, params = restore_actor(cfg, checkpoints, step, mesh)
    checkpoint_digest = policy_digest(params)
    keys = {
        name: {"checkpoint": checkpoint_digest, "data": problems_digest(problems), "settings": settings}
        for name, problems in sets.items()
    }
    # A set finished earlier for the same key is read, not recomputed; decided once, before any process writes.
    cached = {name: _cached(output / f"{name}.json", keys[name], main_process) for name in sets}

    # Decoded in the run's decode layout (rollout.mesh), as its training rollouts were.
    decode = decode_layout.for_run(resolve(cfg, policy_config).rollout, mesh, policy_config, params, rollout_devices)
    params = decode.evaluation_weights(params)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    rows = []
    with (
        jax.set_mesh(decode.mesh),
        VerifierPool(cfg.reward.workers, cfg.reward.timeout_s, across_processes=True) as pool,
        environments.opened(cfg.rollout.get("environment", ""), cfg.reward.workers) as environment,
    ):
        # A tool run's checkpoint talks to its environment, as in its training rollouts.
        tools = (
            None if environment is None else ToolUse(environment, cfg.rollout.max_turns, cfg.rollout.max_reply_tokens)
        )
        compiling = first_call_notices(main_process)  # the first batch compiles each decoder: minutes at scale
        for name, problems in sets.items():
            result = cached[name]
            if result is None:
                result = evaluate_problems(
                    params,
                    policy_config,
                    tokenizer,
                    problems,
                    pool,
                    max_new_tokens=cfg.rollout.max_new_tokens,
                    samples=samples,
                    temperature=cfg.eval.temperature,
                    top_p=cfg.eval.top_p,
                    pass_k=ks,
                    seed=cfg.seed,
                    batch_size=cfg.eval.batch_size,
                    desc=name,
                    tools=tools,
                    compiling=compiling,
                )
                if main_process:
                    storage.write_text(output / f"{name}.json", json.dumps({**keys[name], "metrics": result}, indent=2))
            rows.append({"set": name, **result})
    if not main_process:
        return
    metrics = metric_names(samples, ks)
    frozen = [row for row in rows if row["set"] != "id_dev"]
    if frozen:  # the unweighted mean over sets; its standard error treats the sets as independent
        macro = {"set": "macro (frozen)", "problems": sum(r["problems"] for r in frozen)}
        for m in metrics:
            macro[m] = sum(r[m] for r in frozen) / len(frozen)
            macro[f"{m}_se"] = math.sqrt(sum(r[f"{m}_se"] ** 2 for r in frozen)) / len(frozen)
        rows.append(macro)
    columns = ["set", "problems", *(c for m in metrics for c in (m, f"{m}_se"))]
    table = io.StringIO()
    writer = csv.DictWriter(table, columns, lineterminator="\r\n")
    writer.writeheader()
    writer.writerows(rows)
    storage.write_text(output / "results.csv", table.getvalue())
    storage.write_text(
        output / "results.json",
        json.dumps(
            {
                "checkpoint": str(storage.path(_CHECKPOINT.value)),
                "step": step,
                "checkpoint_digest": checkpoint_digest,
                "data_digests": {name: key["data"] for name, key in keys.items()},
                "settings": settings,
                "rows": rows,
            },
            indent=2,
        ),
    )
    print(
        f"checkpoint {_CHECKPOINT.value} step {step}: {samples} samples per problem at temperature "
        f"{cfg.eval.temperature}, top-p {cfg.eval.top_p}; mean (standard error)"
    )
    print("| set | problems | " + " | ".join(metrics) + " |")
    print("|" + "---|" * (len(metrics) + 2))
    for row in rows:
        print(
            f"| {row['set']} | {row['problems']} | "
            + " | ".join(f"{row[m]:.3f} ({row[m + '_se']:.3f})" for m in metrics)
            + " |"
        )
    print(f"results written to {output}/results.csv and results.json")


def problems_digest(problems) -> str:
    """A digest of a problem set's content as evaluated: every field of every problem, in order."""
    return hashlib.sha256(json.dumps([list(problem) for problem in problems]).encode()).hexdigest()[:16]


def _cached(path, key: dict, main_process: bool) -> dict | None:
    """The metrics `path` holds when they were computed for `key` ({"checkpoint", "data",
    "settings"}); None when there are none, or (said in one line) they were computed for another key."""
    if not path.exists():
        return None
    try:
        stored = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); delete it to recompute that set") from error
    if not isinstance(stored, dict) or "metrics" not in stored or "checkpoint" not in stored or "data" not in stored:
        why = "written without the checkpoint's and the problems' digests (an older format)"
    else:
        settings = stored.get("settings") if isinstance(stored.get("settings"), dict) else {}
        changed = [name for name, value in key["settings"].items() if settings.get(name) != value]
        differs = [
            *(["another checkpoint (other weights)"] if stored["checkpoint"] != key["checkpoint"] else []),
            *(["other problems (the set's content changed)"] if stored["data"] != key["data"] else []),
            *([f"other settings ({', '.join(changed)})"] if changed else []),
        ]
        if not differs:
            return stored["metrics"]
        why = "for " + ", ".join(differs)
    if main_process:
        print(f"cached results in {path} were {why}: evaluating again", flush=True)
    return None


if __name__ == "__main__":
    sys.argv = cli.with_run_config(sys.argv, "checkpoint")
    cli.run(main)
