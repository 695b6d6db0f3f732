"""Train a face-recognition backbone with a Partial FC head (DeepSpeed).

    deepspeed --num_gpus 8 launch/train.py --deepspeed_config configs/ms1mv2_r100_8gpu_fp16.json
    python launch/train.py                       # the CPU quickstart, one process

The config is DeepSpeed's JSON plus a ``ds_pfc`` block (see ds_pfc/config.py and the
README's configs table). Checkpoints, the csv monitor, the summary and the
safetensors export go to ``ds_pfc.train.output_dir``; a rerun resumes from the
latest complete checkpoint there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import _common

DEFAULT_CONFIG = os.path.join(_common.ROOT, "configs", "cpu_quickstart.json")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deepspeed_config", default=DEFAULT_CONFIG, help="job JSON (default: the CPU quickstart)")
    p.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    p.add_argument("--output_dir", default=None, help="overrides ds_pfc.train.output_dir")
    p.add_argument("--max_steps", type=int, default=None, help="overrides ds_pfc.train.max_steps")
    p.add_argument("--no_resume", action="store_true", help="start fresh even if checkpoints exist")
    args = p.parse_args(argv)

    _common.single_process_env()
    from ds_pfc.config import ConfigError
    from ds_pfc.training import Trainer, load_config

    try:
        config = load_config(args.deepspeed_config)
        if args.no_resume:
            config.setdefault("ds_pfc", {}).setdefault("checkpoint", {})["resume"] = False
        trainer = Trainer(config, output_dir=args.output_dir, max_steps=args.max_steps)
        trainer.setup()
    except (ConfigError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    if trainer.rank == 0:
        out = {"steps": len(summary["losses"]), "final_loss": summary["losses"][-1] if summary["losses"] else None,
               "losses": summary["losses"], "elapsed_s": summary["elapsed_s"], "resumed": summary["resumed"],
               "checkpoint": summary["checkpoint"], "export": summary.get("export"),
               "evaluations": {str(step): {name: {"accuracy": r.accuracy, "accuracy_std": r.accuracy_std,
                                                  "tar_at_far": {str(k): v for k, v in r.tar_at_far.items()}}
                                           for name, r in results.items()}
                               for step, results in summary["evaluations"].items()}}
        path = os.path.join(trainer.output_dir, "summary.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print(f"summary {path}", flush=True)
    return summary


if __name__ == "__main__":
    main()
