"""Hostile files: a crafted DeepSpeed ZeRO folder whose model-states file carries a pickle payload must never run,
whichever entry point is handed it (or finds it): each stops with one error line and exit status 2."""

import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, offline_env


class _Payload:
    """Unpickling this runs exec(): it writes the marker file. Refusing to unpickle leaves no marker."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def plant_zero_payload(folder, marker):
    """A folder that looks exactly like a DeepSpeed ZeRO checkpoint: `latest` + global_step1/mp_rank_00_model_states.pt."""
    (folder / "global_step1").mkdir(parents=True)
    (folder / "latest").write_text("global_step1")
    states = {"module": _Payload(marker), "bpd": {"model_config": {"vocab_size": 8}}, "buffer_names": []}
    torch.save(states, folder / "global_step1" / "mp_rank_00_model_states.pt")
    return folder


def test_loader_refuses_zero_payload(tmp_path):
    from bpd_train.sources.checkpoint import CheckpointError
    from bpd_train.sources.loading import load as load_any

    marker = tmp_path / "marker"
    evil = plant_zero_payload(tmp_path / "evil", marker)
    with pytest.raises(CheckpointError, match=r"refusing .*mp_rank_00_model_states\.pt: .*never unpickles"):
        load_any(evil)
    assert not marker.exists()


CASES = {
    "evaluate inputs": ("evaluate.py", "evaluate.inputs=[{evil}]"),
    "evaluate discovery": ("evaluate.py", None),  # the folder sits where evaluation looks for runs
    "train init_from": ("train.py", "+regime=frozen", "regime.init_from={evil}"),
    "distill teacher": ("distill.py", "distill.teacher={evil}"),
    "export checkpoint": ("export.py", "export.checkpoint={evil}", "export.output_dir={art}/out"),
}


@pytest.mark.parametrize("case", CASES)
def test_entry_points_refuse_zero_payload(tmp_path, case):
    script, *overrides = CASES[case]
    art, marker = tmp_path / "art", tmp_path / "marker"
    evil = plant_zero_payload(art / "bible_en_fr" / "heads" / "evil", marker)
    args = [o.format(evil=evil, art=art) for o in overrides if o is not None]
    cmd = [
        sys.executable,
        str(REPO_ROOT / script),
        *args,
        "experiment=smoke",
        f"paths.artifacts={art}",
        f"hydra.run.dir={tmp_path}/hydra",
    ]
    r = subprocess.run(cmd, cwd=REPO_ROOT, env=offline_env(), capture_output=True, text=True, timeout=300)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert not marker.exists(), f"{case}: the payload ran"
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(errors) == 1 and "refusing" in errors[0] and "Traceback" not in r.stderr, r.stderr[-3000:]
