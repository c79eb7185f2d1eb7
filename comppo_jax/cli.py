"""How the absl entry points in launch/ start and fail.

`run(main)` is `absl.app.run(main)` with defaults for people at a terminal: logging at WARNING
unless `--verbosity` is given (Orbax logs every save at INFO), and an exception printed as one
line, `error: <Type>: <message>`, with exit status 1 instead of a traceback. Orbax's own error
logs (tracebacks from its background save threads) are held back too: every failure they describe
reaches `main` as an exception (comppo_jax.runs.checkpoint raises a failed save at the next step
boundary), so it is printed in that one line. `--verbosity=1` (or any explicit `--verbosity`)
shows everything, as plain absl would.

A config file flag (ml_collections' `DEFINE_config_file`) that cannot be loaded, or an override of it
that names no field or does not parse, is reported the same way before `main` runs, as one
ConfigFileError line naming the file and the field (`_config_problem`). That failure comes where
absl parses the flags (`_parse_flags`) or, for a flag not named on the command line, where
launch/<x>.py defines it (`define_config_file`): that loads its default with the command line's
overrides, at import, before `run`.

A process of a multi-process run (`jax.distributed`) that fails exits at once, without
`jax.distributed`'s shutdown barrier: there it would wait up to 5 minutes for peers that are
themselves stuck in a collective waiting for it, and a launcher (or `launch/local_cluster.py`)
only stops the others once one has exited.
"""

from __future__ import annotations

import difflib
import functools
import importlib.machinery
import importlib.util
import logging as std_logging
import os
import re
import sys
import traceback

from absl import app, flags, logging
from ml_collections.config_flags.config_flags import ConfigFileFlagParser

from comppo_jax import storage, workers


class ConfigFileError(Exception):
    """A config file flag whose file cannot be loaded, or an override of it that names no field of
    the config or does not parse as that field's type."""


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


def _verbose(argv: list[str]) -> bool:
    """Whether `argv` names --verbosity (or -v), read before absl parses the flags: a config flag's
    error can come first."""
    return any(re.match(r"--?(verbosity|v)(=|$)", arg) for arg in argv[1:])


def _report(error: BaseException) -> None:
    print(f"error: {_one_line(error)}\n(--verbosity=1 shows the traceback)", file=sys.stderr, flush=True)


def _exit_failed(status: int = 1) -> None:
    """Exit `status`; in a multi-process run without the shutdown barrier (see the module docstring).
    The run's `with` blocks have closed by now (verifier workers, a pending checkpoint save)."""
    jax = sys.modules.get("jax")
    if jax is not None and jax.distributed.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull")


def print_help(argv: list[str], field_help: dict[str, dict[str, str]]) -> None:
    """The entry point's docstring, its flags and, for each ml_collections config flag, every field of
    the config it loads (`--config=...` in `argv`, else the default) with its value and description
    (`field_help[flag name]`, else the training config's, comppo_jax.train.schema.FIELD_HELP)."""
    from comppo_jax.train.schema import FIELD_HELP

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
        print(
            f"\n--{flag.name} fields (from {source}, with the overrides given); override any as "
            f"--{flag.name}.<section>.<field>=value:"
        )
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
    """{section: [(dotted name, value, description)]}, the top level ("") first (method, steps, seed, output_dir:
    the fields most runs set), then the sections in order; a field with a description is one row even if it holds
    a dict. A field in `resolved` (dotted name -> what its value stands for in this config) shows both."""
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
    return dict(sorted(rows.items(), key=lambda row: row[0] != ""))


def _resolved_fields(config) -> dict[str, str]:
    """What each "auto"-like field of a training config resolves to (comppo_jax.train.specs.RESOLVED_FIELDS)."""
    from comppo_jax.train.specs import RESOLVED_FIELDS

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
        dotted, text = arg[len(prefix) :].split("=", 1)
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


def check_location_flags(*names: str) -> None:
    """Refuses, where absl parses the flags (before `main`), a flag of `names` that is neither a local path nor
    gs://BUCKET/... (`storage.check_location`): s3:// or a mistyped gs:/ would be a relative local folder."""
    for name in names:
        flags.register_validator(name, functools.partial(_checked_location, f"--{name}"))


def _checked_location(flag: str, value: str | None) -> bool:
    if value:
        try:
            storage.check_location(value, flag)
        except ValueError as error:  # absl's message names the flag and its value itself
            raise flags.ValidationError(str(error).removeprefix(f"{flag}={value!r}: ")) from error
    return True


def with_run_config(argv: list[str], run_flag: str) -> list[str]:
    """`argv` with `--config=configs/run.py:<run dir>` (the run's own config.json) first, when it
    names no --config but names the run in `--<run_flag>`: `--config.<field>=` overrides then apply
    on top of the config the run trained with."""
    from comppo_jax.models.loading import PRESET_DIR

    run_dir = _named(argv, run_flag)
    if _named(argv, "config") is not None or run_dir is None:
        return argv
    try:
        storage.check_location(run_dir, f"--{run_flag}")
    except ValueError:  # not read as a run: the flag's validator (check_location_flags) refuses it, named
        return argv
    return [argv[0], f"--config={PRESET_DIR / 'run.py'}:{run_dir}", *argv[1:]]


def _named(argv: list[str], name: str) -> str | None:
    """The value of the last `--<name>=value` (or `--<name> value`) of `argv`."""
    value = None
    for index, arg in enumerate(argv[1:], 1):
        match = re.fullmatch(rf"--?{re.escape(name)}(=(.*))?", arg, re.DOTALL)
        if match:
            value = match.group(2) if match.group(1) else (argv[index + 1] if index + 1 < len(argv) else None)
    return value


def _config_files(argv: list[str]) -> dict[str, str]:
    """{flag name: its argument, "file.py" or "file.py:arg"} of each config file flag: the command
    line's, else the default it loaded when it was defined (a flag with neither loads nothing)."""
    files = {}
    for name in flags.FLAGS:
        flag = flags.FLAGS[name]
        if flag.name != name or not isinstance(flag.parser, ConfigFileFlagParser):
            continue
        argument = _named(argv, name)
        if argument is None:
            try:
                argument = flag.config_filename
            except flags.Error:  # no default
                continue
        files[name] = argument
    return files


def _config_problem(error: BaseException, argv: list[str], files: dict[str, str]) -> ConfigFileError | None:
    """What `error`, raised loading the config files `files` ({flag name: argument}) with `argv`'s
    overrides, comes down to, in one line naming the file and the field; None if it is none of these."""
    for name, argument in files.items():
        problem = _file_problem(error, name, argument, argv) or _override_problem(name, argument, argv)
        if problem is not None:
            return problem
    return None


def _same_file(path: str | None, file: str) -> bool:
    return path is not None and os.path.realpath(path) == os.path.realpath(file)


def _file_problem(error: BaseException, name: str, argument: str, argv: list[str]) -> ConfigFileError | None:
    """The config file is missing, does not compile, has no get_config, or raised `error` (or what
    `error` was raised from: ml_collections re-raises a TypeError or ValueError with the traceback in
    its message, and absl that as a flag error)."""
    file = argument.split(":", 1)[0]
    if not os.path.isfile(file):
        given = (
            f"--{name}={argument}" if _named(argv, name) is not None else f"the default of --{name}, from {os.getcwd()}"
        )
        return ConfigFileError(f"{file} does not exist ({given})")
    cause = error
    while cause is not None:
        if isinstance(cause, SyntaxError) and _same_file(cause.filename, file):
            return ConfigFileError(f"{file} line {cause.lineno}: {type(cause).__name__}: {cause.msg}")
        if (
            isinstance(cause, AttributeError)
            and cause.name == "get_config"
            and _same_file(getattr(cause.obj, "__file__", None), file)
        ):
            return ConfigFileError(f"{file} has no get_config()")
        lines = [
            frame.lineno for frame in traceback.extract_tb(cause.__traceback__) if _same_file(frame.filename, file)
        ]
        if lines:
            return ConfigFileError(f"{file} line {lines[-1]}: {_one_line(cause)}")
        cause = cause.__cause__ or cause.__context__
    return None


# How ml_collections parses an override of a field holding a value of this type.
_OVERRIDE_PARSERS = {bool: flags.BooleanParser(), int: flags.IntegerParser(), float: flags.FloatParser()}


def _override_problem(name: str, argument: str, argv: list[str]) -> ConfigFileError | None:
    """The first `--<name>.<field>=value` of `argv` that names no field of the config (with the
    closest fields, `_close_fields`) or whose value does not parse as the field's type."""
    overrides = [arg for arg in argv[1:] if re.match(rf"--?(no)?{re.escape(name)}\.", arg)]
    if not overrides:
        return None
    try:
        config = _load_config(argument)
    except Exception:  # the error being diagnosed is the one to report
        return None
    for arg in overrides:
        dotted, _, text = arg.split(".", 1)[1].partition("=")
        parts = dotted.split(".")
        value = config
        for index, part in enumerate(parts):
            if not hasattr(value, "keys"):  # not a section: ml_collections' own error stands
                return None
            if part not in value.keys():
                close = _close_fields(config, dotted)
                listed = " or ".join([", ".join(close[:-1]), close[-1]] if len(close) > 1 else close)
                hint = f"; did you mean {listed}?" if close else f" (--help lists {argument}'s fields)"
                return ConfigFileError(f"{arg}: {argument} has no field {'.'.join(parts[: index + 1])}{hint}")
            value = value[part]
        parser = _OVERRIDE_PARSERS.get(type(value))
        if parser is not None and text:
            try:
                parser.parse(text)
            except ValueError:
                return ConfigFileError(f"{arg}: expected {type(value).__name__} ({argument} has {dotted}={value!r})")
    return None


def _close_fields(config, dotted: str) -> list[str]:
    """Up to 3 fields of `config` closest to the misspelt `dotted`, closest first: by the whole dotted
    name and by the last name alone (a field of the same name in another section is as close), with
    a field's `lr` read as learning_rate (train.lerning_rate: warm_start.learning_rate, train.actor_lr)."""
    from comppo_jax.train.validation import config_fields

    typed = dotted.rsplit(".", 1)[-1]
    ratio = lambda a, b: difflib.SequenceMatcher(None, a, b).ratio()
    scores = {}
    for path, _ in config_fields(config):
        name = path.rsplit(".", 1)[-1]
        spelled = "_".join("learning_rate" if word == "lr" else word for word in name.split("_"))
        scores[path] = max(ratio(dotted, path), ratio(typed, name), ratio(typed, spelled))
    return sorted((path for path in scores if scores[path] >= 0.75), key=lambda path: -scores[path])[:3]


def _load_config(argument: str):
    """get_config() of the config file `argument`, "file.py" or "file.py:arg", as its flag loads it."""
    file, *arg = argument.split(":", 1)
    loader = importlib.machinery.SourceFileLoader("diagnosed_config", file)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module.get_config(*arg)


def _fail_before_main(error: Exception, argv: list[str], files: dict[str, str] | None = None) -> None:
    """Reports `error`, raised parsing the flags or loading the config files `files` (default: every
    config file flag's), as `run` reports main's (a config file's as its ConfigFileError); with
    --verbosity, raises it."""
    if _verbose(argv):
        raise error
    _report(_config_problem(error, argv, _config_files(argv) if files is None else files) or error)
    _exit_failed()


def _parse_flags(argv: list[str]) -> list[str]:
    """`app.run`'s flags parser: absl's, its errors reported by `_fail_before_main`."""
    try:
        remaining = flags.FLAGS(argv)
        for name in _config_files(argv):
            # ml_collections defers an OSError loading a config file (the file is missing, or
            # get_config raised one) to the config's first use: this is one.
            getattr(flags.FLAGS[name].value, "lock", None)
    except Exception as error:  # reported in one line, or in full with --verbosity
        _fail_before_main(error, argv)
    return remaining


def define_config_file(name: str, default: str | None, help_string: str):
    """`config_flags.DEFINE_config_file`, reporting a default that does not load as `run` reports an
    error. A config flag not named on the command line loads its default, with the command line's
    overrides, right here, at import, before `run`."""
    from ml_collections import config_flags

    try:
        holder = config_flags.DEFINE_config_file(name, default, help_string)
    except Exception as error:  # reported in one line, or in full with --verbosity
        _fail_before_main(error, sys.argv, {name: default})
    # Listed under the entry point that defines it (as ml_collections would), not this module: --help reads that.
    caller = sys._getframe(1).f_globals.get("__name__")
    flags.FLAGS.register_flag_by_module(sys.argv[0] if caller == "__main__" else caller, flags.FLAGS[name])
    return holder


def run(main, field_help: dict[str, dict[str, str]] | None = None) -> None:
    """Runs the absl `main(argv)` with the defaults above; `--help` prints `print_help` and exits 0.
    On a machine without an accelerator JAX runs on the CPU without trying the TPU plugin (importing
    comppo_jax chose it: `comppo_jax.accelerators`). A launcher started by the experiment runner
    (`workers.PARENT_ENV` set) gets SIGTERM when the runner dies, and exits if it already has."""
    if os.environ.get(workers.PARENT_ENV):
        workers.die_with_parent()
    if any(arg in HELP_FLAGS for arg in sys.argv[1:]):
        try:
            print_help(sys.argv, field_help or {})
        except Exception as error:  # a config file flag that does not load
            _fail_before_main(error, sys.argv)
        sys.exit(0)

    def guarded(argv):
        verbose = flags.FLAGS["verbosity"].present
        if not verbose:
            logging.set_verbosity(logging.WARNING)
            std_logging.getLogger("absl").addFilter(_not_an_orbax_error)
            sys.unraisablehook = _hide_closed_loop_callbacks(sys.unraisablehook)
        try:
            return main(argv)
        except KeyboardInterrupt:  # Ctrl-C where train() does not catch it (loading, imports): no traceback either
            print("interrupted (Ctrl-C)", file=sys.stderr, flush=True)
            _exit_failed(130)
        except Exception as error:  # reported in one line, or in full with --verbosity
            if verbose:
                traceback.print_exc()
            else:
                _report(error)
            _exit_failed()

    app.run(guarded, flags_parser=_parse_flags)
