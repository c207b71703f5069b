# Run: python export.py [experiment=smoke] [export.checkpoint=PATH] [export.dtype=bfloat16] [export.output_dir=DIR]
# PATH: a Lightning .ckpt, a run folder, a DeepSpeed ZeRO checkpoint folder, or a bundle.
"""Checkpoint -> bundle (model.safetensors, config.json, tokenizer.model, README.md model card)."""
import sys

import hydra
from omegaconf import DictConfig

import bpd_train  # noqa: F401  (registers the ${repo_root:} resolver)


@hydra.main(version_base="1.3", config_path="conf", config_name="export")
def main(cfg: DictConfig) -> None:
    from bpd_train.checkpoint import CheckpointError
    from bpd_train.evaluation.cli import run_export

    try:
        run_export(cfg)
    except (CheckpointError, ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)  # one line, no traceback: bad input, not a bug
        sys.exit(2)


if __name__ == "__main__":
    main()
