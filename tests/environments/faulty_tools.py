"""Tools that fail, for the environments' tests (imported by their worker processes)."""

from comppo_jax.environments.calculator import evaluate


def hangs_or_raises(call: list) -> int:
    """The calculator, except that 1+1 never returns and 2+2 raises."""
    if call[0] == "1+1":
        while True:
            pass
    if call[0] == "2+2":
        raise ArithmeticError("2+2 is not allowed here")
    return evaluate(call)
