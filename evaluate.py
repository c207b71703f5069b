# Run: python evaluate.py [experiment=smoke] [evaluate.inputs=[PATH,...]] [decode.block_sizes=[8,4]] [decode=greedy]
#      [decode.rules=[exact,top2]] [evaluate.batch_sizes=[1,32]] [evaluate.split=test] [evaluate.max_sentences=N]
"""Greedy vs blockwise decoding of checkpoints: BLEU/chrF, k̂, calls, agreement, speedup -> report + plots."""

import sys

import hydra
from omegaconf import DictConfig

import bpd_train  # noqa: F401  (registers the ${repo_root:} resolver)
from bpd_train.app.cli import check_config


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    from bpd_train.app.cli import exits_on_user_error
    from bpd_train.evaluation.cli import run_evaluate

    exits_on_user_error(run_evaluate)(cfg)


if __name__ == "__main__":
    check_config("evaluate", sys.argv[1:], "python evaluate.py")
    main()
