"""One rank of a test training job: ``torchrun ... distributed_worker.py SPEC.json``.

SPEC holds the app, its config, an .npz of arrays and a list of jobs, each a
``converge.train.loop.train`` call (run_dir, train settings, resume,
stop_after) that every rank makes in turn. Rank 0 writes each job's history to
``RUN_DIR/history.json``. Not collected by pytest (no ``test_`` prefix).
"""
import json
import os
import sys

import numpy as np

from converge.contract import load_app
from converge.config import from_dict
from converge.train.loop import TrainConfig, train


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    app = load_app(spec["app"])
    app_cfg = from_dict(app.config_cls, spec["app_config"], "app")
    arrays = dict(np.load(spec["arrays"]))
    for job in spec["jobs"]:
        result = train(app, app_cfg, TrainConfig(**job["train"]), arrays, job["run_dir"],
                       resume=job.get("resume", False), progress=False, stop_after=job.get("stop_after"))
        if os.environ["RANK"] == "0":
            with open(f"{job['run_dir']}/history.json", "w") as f:
                json.dump(result.history, f)


if __name__ == "__main__":
    main(sys.argv[1])
