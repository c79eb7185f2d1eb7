"""Shared fixtures: tiny random `transformers` checkpoints written with `save_pretrained`."""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile

import numpy as np
import pytest

VOCAB = 101

# Bytecode is written even where PYTHONDONTWRITEBYTECODE asks otherwise: each xdist worker collects every
# test module (pytest caches their rewritten asserts as bytecode: collection 8.7 s -> 3.6 s), and the
# launch/ subprocesses import the package dozens of times.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# The tests run in pytest-xdist workers, and the TPU ahead-of-time tests in each load libtpu;
# without this, the second to load it fails on libtpu's single-process lockfile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# One persistent compilation cache for the session: the xdist workers (which inherit this from the
# controller) and the launch/ subprocesses they start compile each identical program once
# (a small train run: 46 s cold, 16 s from the cache). Made and removed by the first process. Every
# program is kept, however fast it compiled: a run's dozens of small ones cost a launch about 2 s otherwise
# (a 2x2-device run from a warm cache: 30.3-32.6 s keeping those over 0.2 s, 29.0-30.3 s keeping all).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="comppo_jax_test_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def _add_xla_flags(flags: dict[str, str]) -> None:
    """Adds each flag to XLA_FLAGS unless it is already set there (the user's setting wins)."""
    for flag, value in flags.items():
        if flag not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{flag}={value}".strip()


# Compiling is most of what these small tests do. LLVM's optimization passes are most of XLA:CPU's compile
# time (tests/rollout/test_sampler.py: 150 s of CPU at the default level, 94 s at 0), and the elemental
# emitters compile in about half the time of the MLIR fusion emitters (the same file: 68 s -> 34 s; a tiny
# packed and padded run pair, cold cache: 86 s -> 52 s). Both change how fast the compiled code runs and
# how XLA fuses, not what it computes: the tests that compare two programs' results allow float32 rounding
# (and AdamW's amplification of it) wherever the programs differ. Subprocesses inherit them. XLA from
# jaxlib 0.11 has only the fusion emitters and aborts at an unknown flag (seen on a GPU machine's jax 0.11.2).
_add_xla_flags({"xla_backend_optimization_level": "0"})
if tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11):
    _add_xla_flags({"xla_cpu_use_fusion_emitters": "false"})

# Imported after the settings above: JAX reads JAX_COMPILATION_CACHE_DIR and the cache's minimum compile
# time when it is first imported, so the tests' own process would otherwise run without the cache.
from comppo_jax import storage  # noqa: E402

# How long a test waits on a subprocess (or a notebook cell) before calling it hung. A guard
# against hangs, not a speed check: a busy machine (several workers on two cores under CI) makes
# the runs several times slower, and no test may fail for that.
HANG_S = 1800


def hf_model_config(architecture: str, tie_word_embeddings: bool):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_key_value_heads=2,
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation="eager",
        eos_token_id=2,
    )
    if architecture == "qwen3":
        return transformers.Qwen3Config(num_attention_heads=4, head_dim=16, rope_theta=10000.0, **common)
    if architecture == "llama":
        # original_max_position_embeddings small enough that the llama3 rescaling changes the frequencies.
        scaling = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        )
        return transformers.LlamaConfig(num_attention_heads=8, rope_theta=500000.0, rope_scaling=scaling, **common)
    raise ValueError(architecture)


def build_hf_model(architecture: str, tie_word_embeddings: bool, seed: int = 0):
    """A random transformers CausalLM with randomized norm weights (so norms are not identity)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = hf_model_config(architecture, tie_word_embeddings)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
    return model.eval()


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: (architecture, tie) -> (directory, torch model), cached for the session."""
    cache = {}

    def make(architecture: str = "qwen3", tie_word_embeddings: bool = True):
        key = (architecture, tie_word_embeddings)
        if key not in cache:
            model = build_hf_model(architecture, tie_word_embeddings)
            path = tmp_path_factory.mktemp(f"{architecture}_tie{int(tie_word_embeddings)}")
            model.save_pretrained(path)
            cache[key] = (str(path), model)
        return cache[key]

    return make


def right_padded_batch(seed: int = 0, lengths=(20, 14, 9, 17), length: int = 20, vocab: int = VOCAB):
    """Random tokens with right padding: (tokens [B, L] int32, attention_mask [B, L] bool)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (len(lengths), length)).astype(np.int32)
    mask = np.arange(length)[None] < np.asarray(lengths)[:, None]
    return tokens, mask


def rewrite_config(path: str, edit) -> None:
    """Applies `edit(dict)` to `path/config.json` in place."""
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    edit(config)
    with open(config_path, "w") as f:
        json.dump(config, f)


def save_word_tokenizer(path, words) -> dict:
    """Saves a word-level HF tokenizer with a chat template (<user> ... <assistant>); returns its vocab.

    Ids: <pad> 0, <unk> 1, <eos> 2 (the tiny checkpoints' EOS), <user> 3, <assistant> 4, then `words`.
    """
    import tokenizers
    import transformers

    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<eos>", "<user>", "<assistant>", *words])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        additional_special_tokens=["<user>", "<assistant>"],
    )
    fast.chat_template = (
        "{% for m in messages %}<user> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    fast.save_pretrained(path)
    return vocab


# --- Program inspection: proving that no [L, L] array exists --------------------------------------


def nested_jaxprs(jaxpr):
    """`jaxpr` and, recursively, every jaxpr nested in its equations' parameters."""
    yield jaxpr
    for eqn in jaxpr.eqns:
        for param in eqn.params.values():
            for nested in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(nested, "jaxpr", nested)  # ClosedJaxpr -> Jaxpr
                if hasattr(inner, "eqns"):
                    yield from nested_jaxprs(inner)


def jaxpr_shapes(jaxpr):
    """Every array shape in a jaxpr and in the jaxprs nested in it."""
    for inner in nested_jaxprs(jaxpr):
        for var in (*inner.invars, *inner.outvars):
            yield getattr(var.aval, "shape", ())
        for eqn in inner.eqns:
            for var in (*eqn.invars, *eqn.outvars):
                yield getattr(getattr(var, "aval", None), "shape", ())


def hlo_shapes(text):
    return [tuple(int(d) for d in dims.split(",")) for dims in re.findall(r"[a-z]\d*\[(\d+(?:,\d+)*)\]", text)]


def square(shapes, length):
    return sorted({shape for shape in shapes if sum(d >= length for d in shape) >= 2})


TPU_TOPOLOGIES = {  # chip: (topology name, chip config), as in DESIGN.md
    "v4": ("v4:2x2x1", "megacore"),
    "v5e": ("v5e:2x2", "default"),
    "v5p": ("v5p:2x2x1", "megacore"),
    "v6e": ("v6e:2x2x1", "default"),
}


def require_libtpu():
    """Skips without libtpu, or fails when COMPPO_REQUIRE_LIBTPU=1 (CI)."""
    if importlib.util.find_spec("libtpu") is None:
        message = "libtpu is not installed (pip install -e '.[tpu]')"
        if os.environ.get("COMPPO_REQUIRE_LIBTPU") == "1":
            pytest.fail(message)
        pytest.skip(message)


CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"  # Debian's chromium, chromium-driver


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium driven by selenium; skips without it, or fails when
    COMPPO_REQUIRE_BROWSER=1 (CI, which installs it). Flags keep it off the network."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(path)]
    if missing or importlib.util.find_spec("selenium") is None:
        absent = ", ".join(missing) or "selenium"
        message = f"no headless browser ({absent} missing: apt-get install chromium chromium-driver)"
        if os.environ.get("COMPPO_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,2400",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def tpu_devices(chip):
    """The 4 devices of a 2x2 TPU topology via libtpu, for ahead-of-time compiles on this CPU."""
    require_libtpu()
    from jax.experimental import topologies

    name, chip_config = TPU_TOPOLOGIES[chip]
    return topologies.get_topology_desc(
        platform="tpu",
        topology_name=name,
        chip_config_name=chip_config,
        chips_per_host_bounds=(2, 2, 1),
        num_slices=1,
        wrap=(False, False, False),
    ).devices


# The tiny default shrunk to seconds per step (dotted config keys), for the train-loop tests.
SMALL_TRAIN_RUN = {
    "steps": 2,
    "warm_start.steps": 3,
    "data.train_size": 40,
    "data.dev_size": 4,
    "rollout.prompts_per_step": 2,
    "rollout.samples_per_prompt": 2,
    "rollout.max_new_tokens": 12,
    "train.minibatch_size": 2,
    "train.critic_warmup_steps": 1,
    "train.eval_every": 1,
    "progress": False,
    "reward.workers": 1,
    "checkpoint.every": 1,
    "plot": False,
}


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# PYTHONPATH for a payload script that imports tests/ helpers (tiny_model, ...): the repository root first, so
# tests/pallas_kernels does not stand for pallas_kernels.
HELPERS_PATH = os.pathsep.join([REPO, os.path.join(REPO, "tests")])
WALL_CLOCK = (
    "seconds",
    "reshard_seconds",
    "timing/rollout_seconds",
    "timing/update_seconds",
    "timing/generation_seconds",
    "timing/generation_overlap",
)  # metrics.jsonl fields that differ between identical runs


def _small_train_values(output_dir, overrides) -> dict:
    return {
        **SMALL_TRAIN_RUN,
        **{key.replace("__", "."): value for key, value in overrides.items()},
        "output_dir": str(output_dir),
    }


def small_train_flags(output_dir, **overrides) -> list[str]:
    """`small_train_config`'s values as launch/train.py flags (configs/tiny.py is the default config)."""
    return [f"--config.{key}={value}" for key, value in _small_train_values(output_dir, overrides).items()]


def small_train_config(output_dir, **overrides):
    """configs/tiny.py with SMALL_TRAIN_RUN and `overrides` (dotted keys spelled with "__")."""
    from comppo_jax.models import load_config_file

    config = load_config_file(os.path.join(REPO, "configs", "tiny.py"))
    for key, value in _small_train_values(output_dir, overrides).items():
        *sections, name = key.split(".")
        section = config
        for part in sections:
            section = section[part]
        section[name] = value
    return config


# Subprocesses that run JAX stay on the CPU backend, so they never contend with this process for
# libtpu's lockfile (/tmp/libtpu_lockfile) while the TPU ahead-of-time tests hold it.
CPU_ONLY_ENV = dict(os.environ, JAX_PLATFORMS="cpu")


@pytest.fixture(scope="session")
def gcs_emulator():
    """A GCS emulator on 127.0.0.1 for the session (tests/gcs_emulator.py); this process's clients
    (and subprocesses started with `CPU_ONLY_ENV | gcs_emulator.env`) talk to it."""
    import fsspec
    from gcs_emulator import GcsEmulator

    emulator = GcsEmulator()
    before = {name: os.environ.get(name) for name in emulator.env}
    os.environ.update(emulator.env)
    fsspec.config.conf.setdefault("gcs", {})["token"] = "anon"  # fsspec read its FSSPEC_* variables at import
    yield emulator
    fsspec.config.conf["gcs"].pop("token", None)
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    emulator.stop()


@pytest.fixture
def bucket(gcs_emulator):
    """A new empty bucket on the emulator, as "gs://<name>"."""
    return f"gs://{gcs_emulator.bucket()}"


@contextlib.contextmanager
def full_disk(free_bytes: int = 0):
    """Inside it, this process's writes past `free_bytes` of a file fail with EFBIG, as on a full disk
    (RLIMIT_FSIZE; Python ignores the SIGXFSZ that would otherwise end the process). Subprocesses
    started inside inherit the limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (free_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def wait_until(condition, timeout_s: float) -> bool:
    """Whether `condition()` came true within `timeout_s` seconds (polled every 50 ms)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def start_script(script: str, *args: str):
    """`launch_script`'s `python <script> <args>` started in the background (its output piped, as text)."""
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, script, *args],
        cwd=REPO,
        env=CPU_ONLY_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# Launchers that `launch_script` runs in a warm process (tests/launches.py): each puts back what it changes
# (signal handlers, the environment) as its run ends.
WARM_SCRIPTS = ("launch/train.py", "launch/eval.py", "launch/export.py")


def launch_script(script: str, *args: str, env: dict | None = None, fresh: bool = False):
    """`python <script> <args>` from the repository root on the CPU backend (`env` replaces
    CPU_ONLY_ENV), its output captured, allowed HANG_S. A launcher of WARM_SCRIPTS runs in the warm process
    for `env` (tests/launches.py), which has started JAX and keeps the programs earlier launches compiled;
    in a fresh interpreter with `fresh`, under a file-size limit (`full_disk`: a new process inherits it), for a
    multi-process run (`jax.distributed` starts before the backend), or while that process runs another thread's
    launch. Launches that must race each other ask for `fresh` (a warm one starts seconds ahead of a fresh one)."""
    import resource
    import subprocess
    import sys

    import launches

    env = CPU_ONLY_ENV if env is None else env
    fresh = (
        fresh
        or script not in WARM_SCRIPTS
        or resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY
        or any(arg.startswith("--config.mesh.distributed") for arg in args)  # jax.distributed precedes the backend
    )
    result = None if fresh else launches.launch("warm", script, args, env=env, cwd=REPO, timeout_s=HANG_S)
    if result is not None:
        return result
    return subprocess.run(
        [sys.executable, script, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S
    )


def launch_quick(script: str, *args: str, cwd: str = REPO):
    """`launch_script(script, *args)` forked from a process that has already imported the launchers' modules
    (tests/launches.py): for launches that end on their flags or config (one error line, --help), and
    launch/report.py (which never starts JAX's backend), seconds each otherwise."""
    import subprocess

    import launches

    env = dict(CPU_ONLY_ENV, OPENBLAS_NUM_THREADS="1")  # no BLAS threads beside the forking one
    result = launches.launch("forks", script, args, env=env, cwd=str(cwd), timeout_s=HANG_S)
    if result is None:  # another thread's launch holds it
        result = subprocess.run(
            [sys.executable, script, *args], cwd=cwd, env=CPU_ONLY_ENV, capture_output=True, text=True, timeout=HANG_S
        )
    return result


def fake_devices_env(devices: int, **extra: str) -> dict:
    """CPU_ONLY_ENV for a subprocess with `devices` fake CPU devices, keeping this session's XLA_FLAGS."""
    flags = f"{CPU_ONLY_ENV.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    return dict(CPU_ONLY_ENV, XLA_FLAGS=flags, **extra)


# XLA:CPU over gloo (jaxlib 0.10.2) can leave a collective waiting for good when a program with a
# cross-process all-reduce runs back to back on several devices per process (tests/launch/
# back_to_back_all_reduce.py shows it every time; docs/reliability.md). A training run waits for its
# results between most programs, so it hangs rarely (twice in 17 launcher runs of the SIGTERM/SIGKILL/
# resume sequence, looped; TPU collectives do not go through gloo). The launcher's collective timeout
# turns that into a failed run, which `on_local_cluster` reruns, as a supervisor would, up to RERUNS times.
COLLECTIVE_TIMEOUT_S = 120
# What a timed-out collective prints: the process that waited, and a peer whose pair it closed.
GLOO_TIMEOUTS = ("Timed out waiting", "Application timeout caused pair closure")
RERUNS = 2


def gloo_timed_out(result) -> bool:
    """Whether a launcher run failed on a gloo collective's timeout (not on anything of its own)."""
    return result.returncode != 0 and "Gloo" in result.stdout and any(sign in result.stdout for sign in GLOO_TIMEOUTS)


def on_local_cluster(
    script_flags,
    *,
    processes=2,
    devices_per_process=4,
    signal_after_rows=None,
    signum=None,
    metrics=None,
    script="launch/train.py",
    env=None,
):
    """`script` on launch/local_cluster.py (`env`: added to CPU_ONLY_ENV), its output (stdout and stderr) in
    `.stdout`; optionally `signum` once `metrics` has `signal_after_rows` rows (SIGKILL goes to the whole
    process group: the launcher, the processes and their verifier workers). A run that fails on a gloo timeout is rerun:
    without a signal, resumed if it has a checkpoint; with SIGTERM (a clean stop is what it tests), from
    its output directory as it was before, signalled again. A SIGKILL run is meant to fail and is not
    rerun. The result's `earlier` holds the error lines of the runs before it."""
    import signal

    launch = dict(processes=processes, devices_per_process=devices_per_process, script=script, env=env)
    signalled = dict(signal_after_rows=signal_after_rows, signum=signum, metrics=metrics)
    output_dirs = [arg.split("=", 1)[1] for arg in script_flags if arg.startswith("--config.output_dir=")]
    rerunnable = signum is None or (signum == signal.SIGTERM and bool(output_dirs))
    before = f"{output_dirs[0]}.before_sigterm" if signum is not None and rerunnable else None
    if before is not None and os.path.isdir(output_dirs[0]):
        shutil.copytree(output_dirs[0], before)
    result = _on_local_cluster_once(script_flags, **signalled, **launch)
    earlier = []
    while rerunnable and gloo_timed_out(result) and len(earlier) < RERUNS:
        earlier.append(
            "\n".join(line for line in result.stdout.splitlines() if "error" in line.lower() or "Timed out" in line)
        )
        if signum is None:
            resumable = script == "launch/train.py" and storage.path(output_dirs[0]).joinpath("checkpoints").is_dir()
            print(f"gloo timeout in {script}; running it again{' resumed' if resumable else ''}:\n{earlier[-1]}")
            rerun_flags = [*script_flags, *(["--config.resume=True"] if resumable else [])]
        else:
            print(f"gloo timeout in {script}; running it again from its directory before the run:\n{earlier[-1]}")
            shutil.rmtree(output_dirs[0], ignore_errors=True)
            if os.path.isdir(before):
                shutil.copytree(before, output_dirs[0])
            rerun_flags = script_flags
        result = _on_local_cluster_once(rerun_flags, **signalled, **launch)
    result.earlier = earlier
    return result


def _on_local_cluster_once(
    script_flags, *, processes, devices_per_process, script, env, signal_after_rows=None, signum=None, metrics=None
):
    import signal
    import subprocess
    import sys
    import time

    process = subprocess.Popen(
        [
            sys.executable,
            "launch/local_cluster.py",
            f"--processes={processes}",
            f"--devices_per_process={devices_per_process}",
            f"--collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
            "--",
            script,
            *script_flags,
        ],
        cwd=REPO,
        env={**CPU_ONLY_ENV, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    if signal_after_rows is not None:
        deadline = time.time() + 500
        while process.poll() is None and time.time() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= signal_after_rows:
                if signum == signal.SIGKILL:
                    os.killpg(process.pid, signal.SIGKILL)
                else:
                    process.send_signal(signum)
                break
            time.sleep(0.05)
    try:
        output, _ = process.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # a hung run must not outlive the test
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, output)


def cluster_tail(result, chars: int = 4000) -> str:
    """What ended a run: the errors of the runs `on_local_cluster` reran it after, then the end of its
    output without the stack dumps of a process aborted because a peer died (absl's check-failure
    trace and Python's faulthandler), which would push the cause out of view."""
    dump = re.compile(r"^\[p\d+\] ( +@ | +File |Thread 0x|Extension modules|Current thread|\.\S|$)")
    earlier = "".join(f"[rerun after a gloo timeout]\n{errors}\n" for errors in getattr(result, "earlier", []))
    return earlier + "\n".join(line for line in result.stdout.splitlines() if not dump.match(line))[-chars:]


# The longest files (minutes each, measured with --durations), started first on alternate workers.
LONGEST_FILES = (
    # the slow tier's (.ci/run on a clean clone, this machine, 2026-11-29)
    "launch/test_local_cluster.py",
    "train/test_staleness.py",
    "train/test_decode_layout.py",
    "planning/test_planner.py",
    "train/test_train_loop.py",
    "launch/test_pod_command.py",
    "launch/test_gpu_validation.py",
    # the fast tier's (this machine, 2026-11-29)
    "pallas_kernels/test_compile.py",
    "rollout/test_sampler.py",
    "models/test_attention.py",
    "rollout/test_quantized_rollout.py",
    "eval/test_run_report.py",
    "pallas_kernels/test_quantized_paged_attention.py",
    "test_cli.py",
    "pallas_kernels/test_kernels.py",
    "rollout/test_engine.py",
    "train/test_packed_update.py",
)


def pytest_collection_modifyitems(config, items):
    """The longest files first, then other files with slow tests, then the rest: the xdist
    workers (which take files in this order: setup.cfg passes --no-loadscope-reorder) start the
    long files early and finish on short ones, instead of one worker running a long file alone at
    the end. Tests marked gpu are skipped unless JAX's default backend is a GPU."""
    import jax

    if jax.default_backend() != "gpu":
        needs_gpu = pytest.mark.skip(
            reason="runs a GPU kernel compiled for the device (launch/gpu_validation.sh runs these)"
        )
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(needs_gpu)
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    longest = {os.path.join(REPO, "tests", name): rank for rank, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: (longest.get(str(item.path), len(longest)), item.path not in slow_files))


def restored_on_one_device(run_dir, step):
    """Checkpoint `step`'s state on this process's first device, whatever mesh (or processes) saved it."""
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import SingleDeviceSharding

    path = os.path.join(run_dir, "checkpoints", str(step), "state")
    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.metadata(path).item_metadata.tree
        device = SingleDeviceSharding(jax.devices()[0])
        return checkpointer.restore(
            path, jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
        )


def assert_same_checkpoint_state(a_dir, b_dir, step):
    """Both runs' checkpoint `step` hold the same arrays, bitwise, leaf by leaf."""
    import jax

    a, b = restored_on_one_device(a_dir, step), restored_on_one_device(b_dir, step)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def stand_in_batch(cfg, recipe, *, lengths=(10, 7, 10, 3), seed=0):
    """A rewarded, scored batch as the learner leaves it (comppo_jax.train.samples' inputs), with
    random gates, values and rewards on host arrays: `lengths` responses of a group of
    cfg.rollout.samples_per_prompt, the longest lengths[0] tokens."""
    from types import SimpleNamespace

    import jax

    from comppo_jax.credit import grpo_advantages, retention_gate
    from comppo_jax.data.datasets import Problem
    from comppo_jax.data.rewards import Verdict
    from comppo_jax.rollout.experience import Sampled
    from comppo_jax.train.methods import control_gate

    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    batch, length = len(lengths), int(lengths.max())
    mask = np.arange(length)[None] < lengths[:, None]
    tokens = rng.integers(32, 127, (batch, length)) * mask
    concentration = rng.uniform(0, 1, (batch, length)).astype(np.float32)
    kappa = np.asarray(retention_gate(concentration)) * mask
    window = np.maximum(np.arange(length)[None] + 4, 0) * mask
    rewards = rng.choice([0.0, 1.0], batch)
    reward_tokens = np.zeros((batch, length), np.float32)
    reward_tokens[np.arange(batch), lengths - 1] = rewards
    group = cfg.rollout.samples_per_prompt
    sampled = Sampled(
        generation=SimpleNamespace(response_tokens=tokens),
        problems=[Problem(f"prompt {i}", "1", str(i), "test") for i in range(batch // group)],
        texts=["".join(chr(int(t)) for t in row[:n]) for row, n in zip(tokens, lengths)],
        rewards=rewards,
        verdicts=[Verdict.CORRECT if r else Verdict.INCORRECT for r in rewards],
        reward_metrics={},
        host_mask=mask,
        reward_tokens=reward_tokens,
        host_lengths=lengths.astype(np.int32),
    )
    credit_kappa = np.asarray(control_gate(recipe, kappa, mask, jax.random.key(seed), fixed_value=cfg.fixed_gate))
    # The actor's advantages, which the kept responses read where no paper estimator of theirs recomputes them.
    advantages = np.asarray(grpo_advantages(rewards, group, mask)) + rng.normal(0, 0.1, (batch, length)) * mask
    scored = SimpleNamespace(
        rollout=SimpleNamespace(kappa=kappa, herfindahl=rng.uniform(0, 1, (batch, length)) * mask, window_size=window),
        kappa=credit_kappa,
        batch=SimpleNamespace(old_values=rng.normal(0, 0.5, (batch, length)) * mask, advantages=advantages),
    )
    return sampled, scored


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    """An xdist worker gets SIGINT from execnet when it is still busy 5 s after the controller ended the
    session, which prints a KeyboardInterrupt traceback from a run that passed. What keeps it busy is
    garbage collection over its heap of compiled programs (pytest collects once more as it unconfigures):
    freezing the heap here leaves that collection nothing to walk. Finalizers during the tests still
    run and are still reported."""
    import gc

    if os.environ.get("PYTEST_XDIST_WORKER"):
        gc.freeze()
