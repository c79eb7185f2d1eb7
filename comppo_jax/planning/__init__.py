"""Planning a run before it runs: the TPU ahead-of-time compile of a train step's programs and their
HBM (`planner`) and the overlapped step's cost model (`overlap`), on the per-chip cost model of
comppo_jax.costs. `launch/plan.py` and the benchmarks read it; a training run never does."""
