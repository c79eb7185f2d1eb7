"""How the absl entry points in launch/ start and fail.

`run(main)` is `absl.app.run(main)` with defaults for people at a terminal: logging at WARNING
unless `--verbosity` is given (Orbax logs every save at INFO), and an exception printed as one
line, `error: <Type>: <message>`, with exit status 1 instead of a traceback. Orbax's own error
logs (tracebacks from its background save threads) are held back too: every failure they describe
reaches `main` as an exception (comppo_jax.train.checkpoint raises a failed save at the next step
boundary), so it is printed in that one line. `--verbosity=1` (or any explicit `--verbosity`)
shows everything, as plain absl would.
"""

from __future__ import annotations

import logging as std_logging
import sys

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


def run(main) -> None:
    """Runs the absl `main(argv)` with the defaults above."""

    def guarded(argv):
        verbose = flags.FLAGS["verbosity"].present
        if not verbose:
            logging.set_verbosity(logging.WARNING)
            std_logging.getLogger("absl").addFilter(_not_an_orbax_error)
            sys.unraisablehook = _hide_closed_loop_callbacks(sys.unraisablehook)
        try:
            return main(argv)
        except Exception as error:  # noqa: BLE001 -- reported in one line, or re-raised with --verbosity
            if verbose:
                raise
            print(f"error: {_one_line(error)}\n(--verbosity=1 shows the traceback)", file=sys.stderr, flush=True)
            sys.exit(1)

    app.run(guarded)
