"""Where a process sits among a run's processes, read once from the environment it was started with.

The environment is the protocol between a launcher and its processes, and this module is the
one place that reads it (:meth:`Placement.from_environment`); the backends receive the result.

* ``torchrun``, the deprecated ``python -m torch.distributed.launch`` and kd's own launcher
  (torch's elastic agent) set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR`` and ``MASTER_PORT``, and ``TORCHELASTIC_RESTART_COUNT`` after a restart;
* Slurm's ``srun`` with several tasks sets ``SLURM_*`` variables, which :func:`slurm_env` turns
  into torchrun's (``MASTER_ADDR``/``MASTER_PORT`` from the environment when set, else the first
  node and a port derived from the job id);
* kd's launcher makes just the ``--gpus`` visible (``CUDA_VISIBLE_DEVICES``) and hands each of
  its processes that list as an argument (:meth:`Placement.for_visible_gpus` renumbers them from 0);
* ``KD_DIST_TIMEOUT``: seconds a collective may wait for the other processes (600).

A process nobody launched is rank 0 of 1.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from kd.errors import KDError

#: Seconds a collective may wait for the other processes before the run fails (default 10 min).
TIMEOUT_ENV = "KD_DIST_TIMEOUT"
#: Set by kd's launcher in its processes: the ``--gpus`` (or the first GPUs) it made visible.


@dataclass(frozen=True)
class Placement:
    """This process's place: its ranks, its node's processes and GPUs, and how to meet the others."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    #: Processes on this node.
    local_world_size: int = 1
    #: Started by torchrun, torch.distributed.launch, srun or kd's launcher (else rank 0 of 1).
    launched: bool = False
    #: The GPUs given to this node's processes, numbered as this process sees them (``--gpus``,
    #: renumbered from 0 where kd's launcher made just those visible); None where nobody chose
    #: (one GPU per process, by local rank).
    gpus: Optional[Tuple[int, ...]] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    #: How often torch's elastic agent restarted the group (``--max-restarts``); 0 on the first attempt.
    restart: int = 0
    #: The processes meet through the elastic agent's store (``TORCHELASTIC_USE_AGENT_STORE``).
    agent_store: bool = False
    #: How long a collective may wait for the other processes.
    timeout: timedelta = timedelta(seconds=600)

    @classmethod
    def for_visible_gpus(cls, visible: str, environ: Optional[Mapping[str, str]] = None) -> Placement:
        """The placement of a process kd's launcher started with exactly the GPUs ``visible`` (its
        ``CUDA_VISIBLE_DEVICES``, in ``--gpus`` order), numbered 0, 1, ... inside the process."""
        return dataclasses.replace(cls.from_environment(None, environ), gpus=tuple(range(len(visible.split(",")))))

    @classmethod
    def from_environment(
        cls, gpus: Optional[Sequence[int]] = None, environ: Optional[Mapping[str, str]] = None
    ) -> Placement:
        """The placement of this process, given ``--gpus`` and its environment (``os.environ``).

        Raises KDError for variables that are not numbers.
        """
        env = dict(os.environ if environ is None else environ)
        env.update(slurm_env(env))
        value = env.get(TIMEOUT_ENV, "600")
        try:
            timeout = timedelta(seconds=float(value))
        except ValueError:
            raise KDError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds") from None
        given = tuple(gpus) if gpus else None
        if "WORLD_SIZE" not in env or "LOCAL_RANK" not in env:
            return cls(gpus=given, timeout=timeout)
        try:
            world, local_rank = int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
            rank, local_world = int(env.get("RANK", local_rank)), int(env.get("LOCAL_WORLD_SIZE", world))
            port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None
            restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        except ValueError:
            raise KDError(
                "RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_PORT must be integers "
                f"(got {env.get('RANK')!r}, {env.get('WORLD_SIZE')!r}, {env.get('LOCAL_RANK')!r}, "
                f"{env.get('LOCAL_WORLD_SIZE')!r}, {env.get('MASTER_PORT')!r})"
            ) from None
        return cls(
            rank,
            world,
            local_rank,
            local_world,
            True,
            given,
            env.get("MASTER_ADDR") or None,
            port,
            restart,
            env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            timeout,
        )


# ----------------------------------------------------------------------------- Slurm
def slurm_env(environ: Mapping[str, str]) -> Dict[str, str]:
    """torchrun's variables for a process that ``srun`` started as one of several tasks, else ``{}``.

    A torchrun inside srun wins (its variables are already set); one task (``sbatch`` alone, or
    ``srun -n 1``) is no launch at all, and kd may start the processes itself.
    """
    if "LOCAL_RANK" in environ and "WORLD_SIZE" in environ:
        return {}
    ntasks = _int(environ.get("SLURM_STEP_NUM_TASKS"), 1)  # set by srun only, not in a batch script
    if "SLURM_PROCID" not in environ or ntasks <= 1:
        return {}
    nodes = expand_hostlist(
        environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    )
    per_node = expand_tasks_per_node(
        environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or ""
    )
    host = environ.get("SLURMD_NODENAME")
    index = nodes.index(host) if host in nodes else _int(environ.get("SLURM_NODEID"), 0)
    local_world = per_node[index] if index < len(per_node) else (per_node[0] if per_node else ntasks)
    return {
        "RANK": str(_int(environ["SLURM_PROCID"], 0)),
        "WORLD_SIZE": str(ntasks),
        "LOCAL_RANK": str(_int(environ.get("SLURM_LOCALID"), 0)),
        "LOCAL_WORLD_SIZE": str(local_world),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or (nodes[0] if nodes else "127.0.0.1"),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(slurm_port(environ)),
    }


def slurm_port(environ: Mapping[str, str]) -> int:
    """A port every task of one job step computes alike (20000-39999)."""
    job = _int(environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID"), 0)
    step = _int(environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID"), 0)
    return 20000 + (job * 31 + step) % 20000


def expand_hostlist(text: str) -> List[str]:
    """``"gpu[01-03,07],login1"`` -> ``["gpu01", "gpu02", "gpu03", "gpu07", "login1"]``."""
    hosts: List[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text):
        match = re.search(r"\[([^\]]*)\]", item)
        if not match:
            hosts.append(item)
            continue
        prefix, rest = item[: match.start()], item[match.end() :]
        for part in match.group(1).split(","):
            lo, _, hi = part.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.extend(prefix + str(n).zfill(len(lo)) + tail for tail in (expand_hostlist(rest) or [""]))
    return hosts


def expand_tasks_per_node(text: str) -> List[int]:
    """``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    out: List[int] = []
    for count, _, repeat in re.findall(r"(\d+)(\(x(\d+)\))?", text):
        out.extend([int(count)] * int(repeat or 1))
    return out


def _int(value: Optional[str], default: int) -> int:
    try:
        return int(str(value).split("(")[0])
    except (TypeError, ValueError):
        return default


#: device files of a GPU that torch.cuda may use: NVIDIA's, Jetson's (nvhost, nvmap), WSL's (dxg)
#: and ROCm's (kfd)
GPU_DEVICE_FILES = ("dev/nvidia*", "dev/nvhost-*", "dev/nvmap", "dev/dxg", "dev/kfd", "proc/driver/nvidia")


def why_no_cuda(environ: Optional[Mapping[str, str]] = None, root: str = "/") -> Optional[str]:
    """Why no CUDA GPU can be usable in this process, decided without torch, or None where one may
    be (torch.cuda then says): ``CUDA_VISIBLE_DEVICES`` empty or -1, or, on Linux, no GPU's
    device file or driver under ``root``."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES is {visible.strip() or 'empty'}"
    if not sys.platform.startswith("linux"):
        return None
    if any(glob.glob(os.path.join(root, pattern)) for pattern in GPU_DEVICE_FILES):
        return None
    return "this machine has no GPU device (no /dev/nvidia*) and no NVIDIA driver"
