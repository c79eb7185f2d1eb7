"""Which JAX platform a machine with no accelerator gets: the CPU, chosen before JAX starts a backend.

With libtpu installed (the `tpu` extra, for ahead-of-time TPU compiles) and JAX_PLATFORMS unset, JAX
tries the TPU plugin first on every machine, and on one without a TPU chip libtpu prints its failed
start on stderr (`Failed to find host bounds ...`, `E0000 ... INVALID_ARGUMENT: ... TPU worker
hostnames`) before JAX falls back to the CPU. `import comppo_jax` runs `select_cpu_without_accelerator`
so that a notebook, a launcher or a test on such a machine prints nothing of it. A machine with a TPU
or a GPU attached, or a JAX_PLATFORMS set by the user, is left as JAX would have it. An ahead-of-time
TPU compile still loads libtpu (for its topology, not as a backend).
"""

from __future__ import annotations

import os


def accelerator_attached() -> bool:
    """A TPU chip (found as JAX finds them: PCI vendor and device ids) or a GPU (its device files)."""
    from jax._src import hardware_utils  # JAX's own detection; imports no backend

    return (
        hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
        or hardware_utils.has_visible_nvidia_gpu()
        or hardware_utils.num_available_amd_gpus(stop_at=1) > 0
    )


def select_cpu_without_accelerator() -> None:
    """jax_platforms=cpu when JAX_PLATFORMS is unset and no accelerator is attached."""
    if os.environ.get("JAX_PLATFORMS") or accelerator_attached():
        return
    import jax

    jax.config.update("jax_platforms", "cpu")
