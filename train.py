# python train.py +regime=base experiment=smoke      then: python train.py +regime=frozen experiment=smoke
# Regimes (conf/regime/): base, frozen [Regular], finetune [Fine Tuning], distill [Distillation], both [Both],
# self (heads on the model's own greedy output).
# Resume: ckpt_path=last. Configs: conf/train.yaml. Work happens in bpd_train/training/run.py.
import sys

import hydra
from omegaconf import DictConfig

import bpd_train  # noqa: F401  (registers the ${repo_root:} resolver)
from bpd_train.app.cli import check_argv, check_config  # light: Lightning is imported only for a run


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    from bpd_train.app.cli import exits_on_user_error
    from bpd_train.training.run import train

    exits_on_user_error(train)(cfg)


if __name__ == "__main__":
    check_argv(sys.argv[1:])
    check_config("train", sys.argv[1:], "python train.py")
    main()
