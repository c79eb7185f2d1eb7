"""Planning a run before it runs: the TPU ahead-of-time compile of a train step's programs and their
HBM (`planner`), a program's per-chip cost read from its optimized HLO (`hlo_cost`) on the chips'
published peaks (`chips`), the decode layouts' floors and auto's choice (`decode_floor`), and the
overlapped step's cost model (`overlap`). `launch/plan.py` and the benchmarks read it; a training
run reads only `decode_floor.decode_candidates`."""
