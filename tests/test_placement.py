"""kd.utils.placement: where a process sits, read once from torchrun's, srun's or kd's launcher's environment."""

from __future__ import annotations

from datetime import timedelta

import pytest

from kd.errors import KDError
from kd.utils import placement
from kd.utils.placement import Placement

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "head",
    "MASTER_PORT": "29500",
}


def test_a_process_nobody_launched_is_rank_0_of_1():
    assert Placement.from_environment(None, {}) == Placement()
    assert Placement.from_environment([2], {}).gpus == (2,)


def test_torchrun_variables():
    got = Placement.from_environment(
        None,
        {
            **TORCHRUN,
            "TORCHELASTIC_RESTART_COUNT": "2",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "KD_DIST_TIMEOUT": "120",
        },
    )
    assert got == Placement(
        rank=3,
        world_size=4,
        local_rank=1,
        local_world_size=2,
        launched=True,
        gpus=None,
        master_addr="head",
        master_port=29500,
        restart=2,
        agent_store=True,
        timeout=timedelta(seconds=120),
    )
    legacy = Placement.from_environment(None, {"WORLD_SIZE": "2", "LOCAL_RANK": "1"})  # --local_rank, no RANK
    assert (legacy.rank, legacy.local_world_size, legacy.master_addr, legacy.restart) == (1, 2, None, 0)


def test_srun_variables_become_the_placement():
    env = {
        "SLURM_JOB_ID": "77",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURMD_NODENAME": "gpu08",
    }
    got = Placement.from_environment(None, env)
    assert (got.rank, got.world_size, got.local_rank, got.local_world_size, got.launched) == (3, 4, 1, 2, True)
    assert (got.master_addr, got.master_port) == ("gpu07", placement.slurm_port(env))


def test_kd_launcher_renumbers_the_gpus_it_made_visible():
    got = Placement.for_visible_gpus("2,5", TORCHRUN)  # the launcher's processes see just --gpus 2,5
    assert (
        got.gpus == (0, 1) and got.launched and got.world_size == Placement.from_environment(None, TORCHRUN).world_size
    )
    assert Placement.for_visible_gpus("3", TORCHRUN).gpus == (0,)
    assert Placement.from_environment([1], TORCHRUN).gpus == (1,)  # torchrun: --gpus as given
    assert "KD_GPUS" not in open(placement.__file__).read()  # placement travels as an argument, not a variable


@pytest.mark.parametrize(
    "env, message",
    [
        ({**TORCHRUN, "RANK": "x"}, "must be integers"),
        ({**TORCHRUN, "MASTER_PORT": "http"}, "must be integers"),
        ({"KD_DIST_TIMEOUT": "soon"}, "KD_DIST_TIMEOUT='soon' is not a number of seconds"),
    ],
)
def test_bad_variables_are_one_kd_error(env, message):
    with pytest.raises(KDError, match=message):
        Placement.from_environment(None, env)


def test_slurm_environment_becomes_torchrun_variables():
    env = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "1",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURMD_NODENAME": "gpu08",
    }
    got = placement.slurm_env(env)
    assert got == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(placement.slurm_port(env)),
    }
    assert placement.slurm_port(env) == placement.slurm_port(dict(env, SLURM_PROCID="0"))  # the same on every task
    assert placement.slurm_env({**env, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})["MASTER_ADDR"] == "head"
    # torchrun inside srun wins; a batch script (no step) or one task is no launch
    assert placement.slurm_env({**env, "LOCAL_RANK": "0", "WORLD_SIZE": "8"}) == {}
    assert placement.slurm_env({k: v for k, v in env.items() if k != "SLURM_STEP_NUM_TASKS"}) == {}
    assert placement.slurm_env({**env, "SLURM_STEP_NUM_TASKS": "1"}) == {}


def test_hostlists_and_tasks_per_node():
    assert placement.expand_hostlist("gpu[01-03,07],login1,r[1-2]-ib") == [
        "gpu01",
        "gpu02",
        "gpu03",
        "gpu07",
        "login1",
        "r1-ib",
        "r2-ib",
    ]
    assert placement.expand_tasks_per_node("4(x2),1") == [4, 4, 1]
