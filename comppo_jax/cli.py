"""How the absl entry points in launch/ start and fail.

`run(main)` is `absl.app.run(main)` with defaults for people at a terminal: logging at WARNING
unless `--verbosity` is given (Orbax logs every save at INFO), and an exception printed as one
line, `error: <Type>: <message>`, with exit status 1 instead of a traceback. Orbax's own error
logs (tracebacks from its background save threads) are held back too: every failure they describe
reaches `main` as an exception (comppo_jax.train.checkpoint raises a failed save at the next step
boundary), so it is printed in that one line. `--verbosity=1` (or any explicit `--verbosity`)
shows everything, as plain absl would.

A process of a multi-process run (`jax.distributed`) that fails exits at once, without
`jax.distributed`'s shutdown barrier: there it would wait up to 5 minutes for peers that are
themselves stuck in a collective waiting for it, and a launcher (or `launch/local_cluster.py`)
only stops the others once one has exited.
"""

from __future__ import annotations

import logging as std_logging
import os
import sys
import traceback

from absl import app, flags, logging


def _not_an_orbax_error(record: std_logging.LogRecord) -> bool:
    return not (record.levelno >= std_logging.ERROR and "/orbax/" in record.pathname.replace("\\", "/"))


def _hide_closed_loop_callbacks(hook):
    """After a failed async save, TensorStore completes its pending writes into Orbax's closed
    event loop and reports each resulting "Event loop is closed" error as unraisable; the save
    failure itself is raised to `main`. Every other unraisable exception goes to `hook`."""

    def unraisablehook(unraisable):
        if not (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"):
            hook(unraisable)

    return unraisablehook


def _one_line(error: BaseException) -> str:
    """Our own errors (comppo_jax.*) in full: a ConfigError lists one problem per line. Others:
    their first line, at most 500 characters."""
    message = str(error).strip()
    if not type(error).__module__.startswith("comppo_jax"):
        first = message.splitlines()[0] if message else ""
        message = first if len(first) <= 500 else first[:500] + " ..."
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _exit_failed() -> None:
    """Exit status 1; in a multi-process run without the shutdown barrier (see the module docstring).
    The run's `with` blocks have closed by now (verifier workers, a pending checkpoint save)."""
    jax = sys.modules.get("jax")
    if jax is not None and jax.distributed.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.exit(1)


HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull")


def print_help(argv: list[str], field_help: dict[str, dict[str, str]]) -> None:
    """The entry point's docstring, its flags and, for each ml_collections config flag, every field of
    the config it loads (`--config=...` in `argv`, else the default) with its value and description
    (`field_help[flag name]`, else the training config's, comppo_jax.train.paper.FIELD_HELP)."""
    from comppo_jax.train.paper import FIELD_HELP

    main_module = sys.modules["__main__"]
    print((main_module.__doc__ or "").strip() + "\n")
    print(flags.FLAGS.module_help(argv[0]))
    for flag in flags.FLAGS.get_flags_for_module(argv[0]):
        if not type(flag).__module__.startswith("ml_collections.config_flags"):
            continue
        named = [arg.split("=", 1)[1] for arg in argv[1:] if arg.startswith(f"--{flag.name}=")]
        if named:
            flag.parse(named[-1])  # loads that config file
        config = flag.value
        if config is None:
            print(f"\n--{flag.name}: pass one (e.g. --{flag.name}=<file>:<name>) with --help to list its fields")
            continue
        config = _with_shown_overrides(config, flag.name, argv)
        source = getattr(flag, "config_filename", "") or "the entry point"
        print(f"\n--{flag.name} fields (from {source}, with the overrides given); override any as "
              f"--{flag.name}.<section>.<field>=value:")
        resolved = {} if flag.name in field_help else _resolved_fields(config)
        for section, fields in _config_rows(config, field_help.get(flag.name, FIELD_HELP), resolved).items():
            print(f"\n[{section or 'top level'}]")
            entries = [(f"--{flag.name}.{name}={value}", description) for name, value, description in fields]
            width = min(max(len(entry) for entry, _ in entries), 56)
            for entry, description in entries:
                if len(entry) > width:  # a long value: its description goes on the next line
                    print(f"  {entry}" + (f"\n  {'':<{width}}  {description}" if description else ""))
                else:
                    print(f"  {entry:<{width}}  {description}".rstrip())


def _config_rows(config, descriptions: dict, resolved: dict | None = None) -> dict[str, list[tuple[str, str, str]]]:
    """{section: [(dotted name, value, description)]}; a field with a description is one row even if it holds a dict.
    A field in `resolved` (dotted name -> what its value stands for in this config) shows both."""
    from comppo_jax.train.validation import config_fields

    rows: dict[str, list] = {}
    for path, value in config_fields(config, whole=descriptions):
        shown = value.to_dict() if hasattr(value, "to_dict") else value
        section = path.split(".")[0] if "." in path else ""
        text = repr(shown) if isinstance(shown, str) else str(shown)
        description = descriptions.get(path, "")
        if resolved and path in resolved and resolved[path] != shown:
            description = f"[here: {resolved[path]}] {description}"
        rows.setdefault(section, []).append((path, text, description))
    return rows


def _resolved_fields(config) -> dict[str, str]:
    """What each "auto"-like field of a training config resolves to (comppo_jax.train.methods.RESOLVED_FIELDS)."""
    from comppo_jax.train.methods import RESOLVED_FIELDS

    return {path: resolve(config) for path, resolve in RESOLVED_FIELDS.items()}


def _with_shown_overrides(config, flag_name: str, argv: list[str]):
    """A copy of `config` with the `--<flag_name>.<field>=value` overrides of `argv` applied, each
    value read as the type of the field it replaces (for --help; the run itself parses them with
    ml_collections; a tuple field keeps the file's value here). An override naming no field, or a
    value of the wrong type, is an error."""
    config = config.copy_and_resolve_references()
    prefix = f"--{flag_name}."
    for arg in argv[1:]:
        if not arg.startswith(prefix) or "=" not in arg:
            continue
        dotted, text = arg[len(prefix):].split("=", 1)
        *sections, name = dotted.split(".")
        section = config
        for part in sections:
            section = section[part]
        current = section[name]
        if isinstance(current, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{arg}: expected True or False")
            section[name] = text.lower() in ("true", "1")
        elif isinstance(current, (int, float, str)):
            section[name] = type(current)(text)
    return config


def select_cpu_without_accelerator() -> None:
    """JAX_PLATFORMS=cpu when it is unset and no TPU or GPU is attached. Otherwise JAX would start the
    TPU plugin (libtpu, which the `tpu` extra installs for ahead-of-time TPU compiles) and libtpu
    logs E-level errors about TPU worker hostnames before falling back to the CPU. TPU chips are
    found as JAX finds them (PCI vendor and device ids), GPUs by their device files."""
    if os.environ.get("JAX_PLATFORMS"):
        return
    from jax._src import hardware_utils  # JAX's own TPU detection; imports no backend

    if hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0 and not hardware_utils.has_visible_nvidia_gpu() and (
            hardware_utils.num_available_amd_gpus(stop_at=1) == 0):
        import jax

        jax.config.update("jax_platforms", "cpu")


def with_run_config(argv: list[str], run_flag: str) -> list[str]:
    """`argv` with `--config=configs/run.py:<run dir>` (the run's own config.json) first, when it
    names no --config but names the run in `--<run_flag>`: `--config.<field>=` overrides then apply
    on top of the config the run trained with."""
    from comppo_jax.models.loading import PRESET_DIR

    if any(arg == "--config" or arg.startswith("--config=") for arg in argv[1:]):
        return argv
    for index, arg in enumerate(argv[1:], 1):
        if arg.startswith(f"--{run_flag}="):
            run_dir = arg.split("=", 1)[1]
        elif arg == f"--{run_flag}" and index + 1 < len(argv):
            run_dir = argv[index + 1]
        else:
            continue
        return [argv[0], f"--config={PRESET_DIR / 'run.py'}:{run_dir}", *argv[1:]]
    return argv


def run(main, field_help: dict[str, dict[str, str]] | None = None) -> None:
    """Runs the absl `main(argv)` with the defaults above; `--help` prints `print_help` and exits 0.
    On a machine without an accelerator JAX runs on the CPU without trying the TPU plugin
    (`select_cpu_without_accelerator`)."""
    select_cpu_without_accelerator()
    if any(arg in HELP_FLAGS for arg in sys.argv[1:]):
        print_help(sys.argv, field_help or {})
        sys.exit(0)

    def guarded(argv):
        verbose = flags.FLAGS["verbosity"].present
        if not verbose:
            logging.set_verbosity(logging.WARNING)
            std_logging.getLogger("absl").addFilter(_not_an_orbax_error)
            sys.unraisablehook = _hide_closed_loop_callbacks(sys.unraisablehook)
        try:
            return main(argv)
        except Exception as error:  # noqa: BLE001 -- reported in one line, or in full with --verbosity
            if verbose:
                traceback.print_exc()
            else:
                print(f"error: {_one_line(error)}\n(--verbosity=1 shows the traceback)", file=sys.stderr, flush=True)
            _exit_failed()

    app.run(guarded)
