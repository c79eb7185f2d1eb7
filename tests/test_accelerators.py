"""A machine with no accelerator: importing the package and calling an estimator prints nothing on stderr,
with libtpu installed (the `tpu` extra), and a machine with an accelerator is left as JAX has it."""

from __future__ import annotations

import subprocess
import sys

import jax
import pytest
from conftest import CPU_ONLY_ENV, HANG_S, REPO, require_libtpu
from jax._src import hardware_utils

from comppo_jax import accelerators

# What a notebook user types first (README: "call comp_gae as a jitted function in a notebook").
NOTEBOOK = """
import comppo_jax
from comppo_jax.credit import comp_gae
import jax, jax.numpy as jnp
rewards = jnp.zeros((2, 5)).at[:, -1].set(1.0)
advantages, returns = jax.jit(comp_gae)(rewards, jnp.zeros((2, 5)), jnp.full((2, 5), 0.9), jnp.ones((2, 5), bool), 0.95)
print(float(advantages[0, 0]), float(returns[0, 0]))
"""


def test_importing_the_package_and_calling_comp_gae_prints_nothing_on_stderr():
    require_libtpu()
    if accelerators.accelerator_attached():
        pytest.skip("a TPU or GPU is attached: JAX starts it")
    env = {name: value for name, value in CPU_ONLY_ENV.items() if name != "JAX_PLATFORMS"}
    result = subprocess.run(
        [sys.executable, "-c", NOTEBOOK], cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr[-3000:]
    namespace: dict = {}
    exec(NOTEBOOK.replace("print(", "result = ("), namespace)  # the same line here, where stderr is pytest's
    assert [float(x) for x in result.stdout.split()] == pytest.approx(namespace["result"])


@pytest.mark.parametrize("attached", ["tpu", "gpu", "JAX_PLATFORMS"])
def test_a_machine_with_an_accelerator_or_a_chosen_platform_is_left_as_jax_has_it(monkeypatch, attached):
    monkeypatch.setattr(jax.config, "update", lambda *args: pytest.fail(f"jax.config.update{args}"))
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    if attached == "tpu":
        monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (4, None))
    elif attached == "gpu":
        monkeypatch.setattr(hardware_utils, "has_visible_nvidia_gpu", lambda: True)
    else:
        monkeypatch.setenv("JAX_PLATFORMS", "tpu,cpu")
    accelerators.select_cpu_without_accelerator()
