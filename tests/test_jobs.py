"""What each process of a launch runs (kd.run.jobs): plain data that travels to spawned ranks."""

from __future__ import annotations

import pickle

from conftest import TINY_RUN

from kd.run.jobs import TeachJob, TrainJob
from kd.run.students import Students, for_command


def test_jobs_travel_to_spawned_processes(image_folder, tmp_path):
    """kd's launcher hands each process its job by pickle (torch's elastic launcher spawns them)."""
    cfg = for_command([], {**TINY_RUN, "data": str(image_folder), "out": str(tmp_path / "a")}).first
    for job in (TrainJob(Students.alone(cfg), timed_after=3), TeachJob(cfg)):
        again = pickle.loads(pickle.dumps(job))
        assert again == job and again.cfg == cfg
