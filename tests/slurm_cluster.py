"""A real single-node SLURM cluster on localhost, started and stopped by the tests themselves.

Used by tests/test_slurm.py (pytest -m slurm). Needs Debian's slurmctld, slurmd, slurm-client and munge
(`bash .ci/install-slurm.sh`) and root (slurmd starts job steps as the submitting user). There is no init
system, so the daemons are started here with every path (config, keys, sockets, pid files, spool, state,
logs) in one temporary folder, on free ports, and stopped afterwards by pid - nothing under /etc or /run
is touched and a system SLURM, if any, is left alone. Clients reach this cluster through SLURM_CONF.

By hand (the same thing, for debugging):  python tests/slurm_cluster.py   (prints SLURM_CONF, Enter stops it)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "srun", "sinfo", "munge")
INSTALL_HINT = "install them with: bash .ci/install-slurm.sh (Debian: slurmctld slurmd slurm-client munge)"

# The exact configuration that works on Debian 12's slurm-wlm 22.05 in a container without systemd or
# cgroups. Placeholders in braces are filled by SlurmCluster.start().
SLURM_CONF = """\
# Written by tests/slurm_cluster.py: a throw-away single-node cluster on 127.0.0.1.
ClusterName=bpdtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job may start again only after this many seconds (default 120).
AuthInfo=socket={munge_socket},cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
# No cgroups in a container: track processes through /proc, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
# One CPU per job by default, so two jobs (e.g. two array tasks) run side by side on the 2 CPUs.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Test every pending job every 2 s (default 60): a requeued job or a released dependency starts at once.
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=3600
InactiveLimit=0
SlurmdTimeout=300
# Trust the CPU count below even where the machine has fewer (the node would be drained otherwise).
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""

TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
    "SPECIAL_EXIT",
}


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the local cluster (missing packages, not root); the tests skip."""


def missing_requirements() -> str | None:
    """Why the cluster cannot be started here, or None."""
    missing = [b for b in DAEMONS + CLIENTS if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return f"SLURM binaries not found: {' '.join(missing)}; {INSTALL_HINT}"
    if os.geteuid() != 0:
        return "the local SLURM cluster needs root (slurmd launches job steps as the submitting user)"
    return None


def _which(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


class SlurmCluster:
    """One slurmctld + one slurmd (NodeName=localhost, CPUs=cpus) + munged, all under `root`."""

    def __init__(self, root: str | os.PathLike | None = None, cpus: int = 2):
        self.root = Path(root or tempfile.mkdtemp(prefix="bpd-slurm-"))
        self.cpus = cpus
        self.conf = self.root / "slurm.conf"
        self.munge_dir = self.root / "munge"
        self.munge_socket = self.munge_dir / "munge.sock"
        self.log_dir = self.root / "log"
        self._pidfiles = {
            "slurmd": self.root / "slurmd.pid",
            "slurmctld": self.root / "slurmctld.pid",
            "munged": self.munge_dir / "munged.pid",
        }
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.started = False

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 60) -> "SlurmCluster":
        why = missing_requirements()
        if why:
            raise SlurmUnavailable(why)
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        # munged insists: socket folder reachable by all (0755), key readable by its owner only.
        self.root.chmod(0o755)
        self.munge_dir.mkdir(mode=0o755, exist_ok=True)
        self.munge_dir.chmod(0o755)
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.started = True  # from here on, stop() cleans up whatever did start
        self._run(
            [
                _which("munged"),
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={self._pidfiles['munged']}",
                f"--log-file={self.munge_dir / 'munged.log'}",
                f"--seed-file={self.munge_dir / 'munged.seed'}",
            ],
            "munged",
        )
        self.conf.write_text(
            SLURM_CONF.format(
                root=self.root,
                munge_socket=self.munge_socket,
                ctld_port=_free_port(),
                slurmd_port=_free_port(),
                user="root",
                cpus=self.cpus,
            )
        )
        self._run([_which("slurmctld"), "-f", str(self.conf)], "slurmctld")
        self._wait(
            lambda: "UP" in self.cmd("scontrol", "ping", check=False).stdout,
            timeout,
            "slurmctld to answer `scontrol ping`",
        )
        self._run([_which("slurmd"), "-f", str(self.conf), "-N", "localhost"], "slurmd")
        self._wait(
            lambda: self.cmd("sinfo", "-h", "-o", "%t", check=False).stdout.strip() == "idle",
            timeout,
            "node localhost to become idle",
        )
        return self

    def stop(self, keep: bool | None = None) -> None:
        """Cancel every job, stop the daemons by pid, then remove the folder (kept if keep or
        BPD_SLURM_KEEP=1)."""
        if not self.started:
            return
        self.started = False
        try:
            ids = self.cmd("squeue", "-h", "-o", "%A", check=False).stdout.split()
            if ids:
                self.cmd("scancel", "--full", *ids, check=False)
                self._wait(
                    lambda: not self.cmd("squeue", "-h", check=False).stdout.strip(), 20, "jobs to end", raise_=False
                )
        except Exception:
            pass
        for name in ("slurmd", "slurmctld", "munged"):
            self._kill_pidfile(name)
        # Job processes that outlived their slurmstepd: ours are exactly those with our SLURM_CONF.
        self._kill_ours()
        if keep is None:
            keep = os.environ.get("BPD_SLURM_KEEP") == "1"
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ clients
    def cmd(self, *args: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """Run a SLURM client (sbatch, squeue, ...) against this cluster."""
        kw.setdefault("env", self.env)
        p = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kw)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} -> rc={p.returncode}\n{p.stdout}\n{p.stderr}")
        return p

    def sbatch(self, *args: str, **kw) -> str:
        """sbatch --parsable ARGS -> job id."""
        return self.cmd("sbatch", "--parsable", *args, **kw).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> list[dict[str, str]]:
        """`scontrol show job -o` as dicts, one per job (an array id gives all its tasks)."""
        out = self.cmd("scontrol", "show", "job", "-o", str(job_id), check=False).stdout
        jobs = []
        for line in out.splitlines():
            fields = {}
            for tok in line.split():
                k, _, v = tok.partition("=")
                if k and k not in fields:
                    fields[k] = v
            if fields:
                jobs.append(fields)
        return jobs

    def states(self, job_id: str) -> list[str]:
        return [j.get("JobState", "?") for j in self.job(job_id)]

    def wait(self, job_ids, timeout: float = 300, poll: float = 1.0) -> dict[str, list[dict]]:
        """Wait until every job (and every task of an array) is in a terminal state; return their records."""
        ids = [str(j) for j in ([job_ids] if isinstance(job_ids, (str, int)) else job_ids)]
        deadline = time.monotonic() + timeout
        while True:
            recs = {j: self.job(j) for j in ids}
            if all(r and all(x.get("JobState") in TERMINAL_STATES for x in r) for r in recs.values()):
                return recs
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"jobs still running after {timeout:.0f}s: "
                    + ", ".join(f"{j}={[x.get('JobState') for x in r]}" for j, r in recs.items())
                    + "\n"
                    + self.cmd("squeue", check=False).stdout
                )
            time.sleep(poll)

    def logs(self) -> str:
        """The daemons' logs (for failure messages)."""
        out = []
        for p in sorted(self.log_dir.glob("*.log")) + [self.munge_dir / "munged.log"]:
            if p.exists():
                out.append(f"==> {p} <==\n" + "".join(p.read_text(errors="replace").splitlines(True)[-60:]))
        return "\n".join(out)

    # ------------------------------------------------------------------ internals
    def _run(self, argv: list[str], name: str) -> None:
        # The daemons fork into the background and write their pid files; SLURM_CONF is inherited by
        # slurmstepd and the jobs, which is how _kill_ours recognises them.
        p = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            raise RuntimeError(f"{name} did not start (rc={p.returncode}): {p.stderr.strip()}\n{self.logs()}")
        self._wait(lambda: self._pid(name) is not None, 20, f"{name} pid file")

    def _pid(self, name: str) -> int | None:
        try:
            pid = int(self._pidfiles[name].read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _pid_alive(pid) else None

    def _kill_pidfile(self, name: str) -> None:
        pid = self._pid(name)
        if pid is None:
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _pid_alive(pid):
            os.kill(pid, signal.SIGKILL)

    def _kill_ours(self) -> None:
        needle = f"SLURM_CONF={self.conf}".encode()
        me = os.getpid()
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == me:
                continue
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    os.kill(int(d.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass

    def _wait(self, cond, timeout: float, what: str, raise_: bool = True) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return True
            time.sleep(0.2)
        if raise_:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.logs()}")
        return False


@pytest.fixture(scope="session")
def slurm_cluster():
    """The running local cluster (session scope: started once, ~3 s). Skips, loudly, where it cannot run."""
    why = missing_requirements()
    if why:
        pytest.skip(f"SLURM tests skipped: {why}")
    cluster = SlurmCluster()
    try:
        cluster.start()
    except Exception:
        cluster.stop(keep=True)
        raise
    try:
        yield cluster
    finally:
        cluster.stop()


if __name__ == "__main__":
    with SlurmCluster() as c:
        print(f"export SLURM_CONF={c.conf}")
        print(c.cmd("sinfo").stdout)
        input("cluster up; press Enter to stop it ")
