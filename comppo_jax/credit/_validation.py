"""Shape and dtype checks shared by the credit estimators.

They run at trace time (shapes and dtypes are static under `jax.jit`), so a bad
call fails before compilation with a message naming the offending tensor.
"""

import jax.numpy as jnp


def check_floating(name, x):
    """Raises ValueError unless `x` has a floating dtype."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"{name} must have a floating dtype, got {x.dtype} (shape {tuple(x.shape)})")


def check_mask(name, x):
    """Raises ValueError unless `x` is a bool, integer or floating 0/1 mask."""
    if not (x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer)
            or jnp.issubdtype(x.dtype, jnp.floating)):
        raise ValueError(
            f"{name} must be a bool, integer or floating 0/1 mask, got {x.dtype} "
            f"(shape {tuple(x.shape)})")


def check_rank(name, x, rank, layout):
    """Raises ValueError unless `x` has `rank` dims; `layout` reads e.g. "[B, T]"."""
    if x.ndim != rank:
        raise ValueError(f"{name} must have shape {layout}, got shape {tuple(x.shape)}")


def check_same_shape(ref_name, ref, **others):
    """Raises ValueError naming the first of `others` whose shape differs from `ref`."""
    for name, x in others.items():
        if x.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but {ref_name} has shape "
                f"{tuple(ref.shape)}; they must match")


def check_bt(**arrays):
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
