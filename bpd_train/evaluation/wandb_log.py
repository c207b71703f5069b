"""Log an evaluation report to the W&B run each checkpoint was trained in (resumed by id): a table + the plots."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

COLUMNS = [
    "checkpoint",
    "regime",
    "k",
    "rule",
    "batch_size",
    "bleu",
    "chrf",
    "mean_accepted",
    "calls",
    "greedy_calls",
    "agreement",
    "speedup",
    "greedy_bleu",
]


def log_report(report: dict, out_dir: str | os.PathLike, force: bool = False, project: str = "bpd-train") -> int:
    """Returns the number of W&B runs logged to. Without a known training run nothing is logged unless `force`
    (then one new 'eval' run holds the whole report). Failures only warn: the report on disk is what counts."""
    out_dir = Path(out_dir)
    groups: dict[tuple, list[dict]] = {}
    for c in report["checkpoints"]:
        ids = c.get("wandb")
        if ids and ids.get("id"):
            groups.setdefault((ids["id"], ids.get("project"), ids.get("dir")), []).append(c)
    if not groups and force:
        groups[(None, None, None)] = report["checkpoints"]
    if not groups:
        return 0
    try:
        import wandb
    except ImportError:
        log.warning("wandb is not installed: report not logged to W&B")
        return 0
    done = 0
    for (run_id, proj, run_dir), cks in groups.items():
        names = {c["name"] for c in cks}
        rows = [r for r in report["rows"] if r["checkpoint"] in names]
        try:
            kwargs = {"project": proj or project, "job_type": "eval", "reinit": "create_new"}
            if run_id:
                kwargs.update(id=run_id, resume="allow")
            if run_dir:
                kwargs["dir"] = run_dir
            run = wandb.init(**kwargs)
            table = wandb.Table(columns=COLUMNS, data=[[r.get(c) for c in COLUMNS] for r in rows])
            payload = {"eval/results": table}
            for png in report.get("files", {}).get("plots", []):
                if (out_dir / png).is_file():
                    payload[f"eval/{Path(png).stem}"] = wandb.Image(str(out_dir / png))
            run.log(payload)
            for r in rows:
                key = f"eval/{r['checkpoint']}/k{r['k']}_{r['rule']}_bs{r['batch_size']}"
                run.summary[f"{key}/bleu"] = r["bleu"]
                run.summary[f"{key}/mean_accepted"] = r["mean_accepted"]
                run.summary[f"{key}/speedup"] = r["speedup"]
            run.finish()
            done += 1
        except Exception as e:  # noqa: BLE001 - W&B trouble must not lose the evaluation
            log.warning("could not log the evaluation to W&B run %s: %s", run_id, e)
    return done
