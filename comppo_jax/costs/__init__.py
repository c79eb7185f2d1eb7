"""What a program costs on a chip, read before anything runs: a program's per-chip cost from its
optimized HLO (`hlo_cost`) on the chips' published peaks (`chips`), and the decode layouts' floors
with auto's choice (`decode_floor`). The trainer reads `decode_floor.decode_candidates` for
`rollout.decode_layout=auto`; the planner (comppo_jax.planning) reads all of it."""
