# Run: python distill.py [experiment=smoke] [distill.teacher=PATH] [distill.limit=N]
#      torchrun --nproc-per-node=N distill.py ...   |   sbatch --array=0-7 slurm/distill.sbatch ...
"""Re-translate a corpus split with the teacher's beam search into a resumable, sharded distilled corpus."""

import json
import sys

import hydra
from omegaconf import DictConfig

import bpd_train  # noqa: F401  (registers the ${repo_root:} resolver)
from bpd_train.app.cli import check_config


@hydra.main(version_base="1.3", config_path="conf", config_name="distill")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from bpd_train.app.cli import exits_on_user_error
    from bpd_train.distillation import run

    summary = exits_on_user_error(run)(cfg, overrides=list(HydraConfig.get().overrides.task))
    print(json.dumps(summary))


if __name__ == "__main__":
    check_config("distill", sys.argv[1:], "python distill.py")
    main()
