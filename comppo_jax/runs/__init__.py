"""A run's directory, on a local disk or a gs:// bucket (every file through comppo_jax.storage): its
lock and the resume's config comparison (`run_dir`), the Orbax checkpoints with their digests
(`checkpoint`), config.json, metrics.jsonl and the loggers (`outputs`), and the kept responses'
files (`samples`). The trainer writes them; evaluation, export and the run report read them."""
