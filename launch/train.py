"""Train with CompPO, GRPO or PPO: `python launch/train.py --config=configs/tiny.py`.

Any config value can be overridden, e.g. `--config.method=grpo --config.steps=10`. Under
`config.output_dir` it writes metrics.jsonl, TensorBoard events (tensorboard/), Orbax checkpoints
(checkpoints/, and reference/ after a warm start), summary.json and curves.png.
`--config.resume=True` continues the run in output_dir from its latest checkpoint.
"""

from __future__ import annotations

import json

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "ml_collections config file.")


def main(argv):
    del argv
    if not flags.FLAGS["verbosity"].present:  # Orbax logs every save at INFO; keep the progress bar readable
        logging.set_verbosity(logging.WARNING)
    from comppo_jax.train.loop import train

    summary = train(_CONFIG.value)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    app.run(main)
