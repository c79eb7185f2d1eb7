"""Train with CompPO, GRPO or PPO: `python launch/train.py --config=configs/tiny.py`.

Any config value can be overridden, e.g. `--config.method=grpo --config.steps=10`.
Writes `metrics.jsonl` and `summary.json` under `config.output_dir`.
"""

from __future__ import annotations

import json

from absl import app
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "ml_collections config file.")


def main(argv):
    del argv
    from comppo_jax.train.loop import train

    summary = train(_CONFIG.value)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    app.run(main)
