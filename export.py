# Run: python export.py [experiment=smoke] [export.checkpoint=PATH] [export.dtype=bfloat16] [export.output_dir=DIR]
# PATH: a Lightning .ckpt, a run folder, a DeepSpeed ZeRO checkpoint folder, or a bundle.
"""Checkpoint -> bundle (model.safetensors, config.json, tokenizer.model, README.md model card)."""

import sys

import hydra
from omegaconf import DictConfig

import bpd_train  # noqa: F401  (registers the ${repo_root:} resolver)
from bpd_train.app.cli import check_config


@hydra.main(version_base="1.3", config_path="conf", config_name="export")
def main(cfg: DictConfig) -> None:
    from bpd_train.app.cli import exits_on_user_error
    from bpd_train.app.export import run_export

    exits_on_user_error(run_export)(cfg)


if __name__ == "__main__":
    check_config("export", sys.argv[1:], "python export.py")
    main()
