"""Console scripts of an installed package (pyproject.toml [project.scripts]): bpd-train, bpd-distill,
bpd-evaluate, bpd-export, bpd-translate. Each does what the clone's train.py / distill.py / evaluate.py /
export.py do, with the configs shipped inside the package (bpd_train.app.cli.config_dir), from any directory.
`python -m bpd_train.app.commands train|distill|evaluate|export ARGS` is the same (the pipeline's stages, installed)."""

from __future__ import annotations

import sys


def _main(config_name: str, prog: str, work) -> None:
    import hydra
    from omegaconf import DictConfig

    from bpd_train.app.cli import check_config, config_dir, exits_on_user_error

    argv = sys.argv[1:]
    if config_name == "train":
        from bpd_train.app.cli import check_argv

        check_argv(argv)
    check_config(config_name, argv, prog)
    # Hydra names the job after the file of the task function (this one); the output folders and log files use
    # the name the clone's scripts give them
    if not any(a.startswith("hydra.job.name=") for a in argv):
        sys.argv.append(f"hydra.job.name={config_name}")

    @hydra.main(version_base="1.3", config_path=str(config_dir()), config_name=config_name)
    def main(cfg: DictConfig) -> None:
        exits_on_user_error(work)(cfg)

    main()


def _train(cfg) -> None:
    from bpd_train.training.run import train

    train(cfg)


def _distill(cfg) -> None:
    import json

    from hydra.core.hydra_config import HydraConfig

    from bpd_train.distillation import run

    print(json.dumps(run(cfg, overrides=list(HydraConfig.get().overrides.task))))


def _evaluate(cfg) -> None:
    from bpd_train.evaluation.cli import run_evaluate

    run_evaluate(cfg)


def _export(cfg) -> None:
    from bpd_train.app.export import run_export

    run_export(cfg)


def train() -> None:
    _main("train", "bpd-train", _train)


def distill() -> None:
    _main("distill", "bpd-distill", _distill)


def evaluate() -> None:
    _main("evaluate", "bpd-evaluate", _evaluate)


def export() -> None:
    _main("export", "bpd-export", _export)


def translate() -> None:
    from bpd_train.app.translate import main

    sys.exit(main())


if __name__ == "__main__":
    COMMANDS = {"train": train, "distill": distill, "evaluate": evaluate, "export": export, "translate": translate}
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: python -m bpd_train.app.commands {{{','.join(COMMANDS)}}} [ARGS ...]")
    COMMANDS[sys.argv.pop(1)]()
