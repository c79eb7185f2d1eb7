"""Shape and dtype checks shared by the credit estimators.

They run at trace time (shapes and dtypes are static under `jax.jit`), so a bad
call fails before compilation with a message naming the offending tensor; ranges of
Python-number arguments are checked before the jitted call (`unit_interval_arguments`).
"""

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def check_floating(name: str, x: jax.Array | np.ndarray) -> None:
    """Raises ValueError unless `x` has a floating dtype."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must have a floating dtype, got {x.dtype} (shape {tuple(x.shape)})")


def check_mask(name: str, x: jax.Array | np.ndarray) -> None:
    """Raises ValueError unless `x` is a bool, integer or floating 0/1 mask."""
    if not (x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer) or jnp.issubdtype(x.dtype, jnp.floating)):
        raise ValueError(f"{name} must be a bool, integer or floating 0/1 mask, got {x.dtype} (shape {tuple(x.shape)})")


def check_rank(name: str, x: jax.Array | np.ndarray, rank: int, layout: str) -> None:
    """Raises ValueError unless `x` has `rank` dims; `layout` reads e.g. "[B, T]"."""
    if x.ndim != rank:
        raise ValueError(f"{name} must have shape {layout}, got shape {tuple(x.shape)}")


def check_same_shape(ref_name: str, ref: jax.Array | np.ndarray, **others: jax.Array | np.ndarray) -> None:
    """Raises ValueError naming the first of `others` whose shape differs from `ref`."""
    for name, x in others.items():
        if x.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}; they must match"
            )


def check_bt(**arrays: jax.Array | np.ndarray) -> None:
    """Checks that every array is [B, T] with the shape of the first one.

    The first keyword is the reference. Names containing "mask" are checked as
    masks, the others as floating tensors.
    """
    (ref_name, ref), *rest = arrays.items()
    for name, x in arrays.items():
        check_rank(name, x, 2, "[B, T]")
        if "mask" in name:
            check_mask(name, x)
        else:
            check_floating(name, x)
    check_same_shape(ref_name, ref, **dict(rest))


def unit_interval_arguments(*names: str) -> Callable[[Any], Callable[..., Any]]:
    """Decorates a jitted function so that the arguments `names`, when given as Python numbers,
    must lie in [0, 1] (ValueError naming the argument otherwise).

    The check runs before the jitted call: inside it they are tracers. Traced values (the
    function called under a caller's jit) pass through. `lower`, `trace` and `eval_shape` are
    the jitted function's.
    """

    def decorate(jitted: Any) -> Callable[..., Any]:  # a `jax.jit` wrapper (its type is private to jax)
        signature = inspect.signature(jitted)

        @functools.wraps(jitted)
        def checked(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            for name in names:
                value = bound.arguments[name]
                if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0.0 <= value <= 1.0:
                    raise ValueError(f"{name} must be in [0, 1], got {value}")
            return jitted(*args, **kwargs)

        checked.lower, checked.trace, checked.eval_shape = (  # type: ignore[attr-defined]  # function attributes
            jitted.lower,
            jitted.trace,
            jitted.eval_shape,
        )
        return checked

    return decorate
