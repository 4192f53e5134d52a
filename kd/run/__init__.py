"""A run: what happens between ``kd train`` and its last checkpoint.

Here: the processes and where each sits (``launch``, ``placement``), the set-up of a run
(``build``: data, models, teacher, precision, backend), the loop and its rules (``loop``: the
step, non-finite losses, unreadable images, stops, logging, checkpoints), several students on one
teacher forward (``plan`` reads them, ``lanes`` trains them), the step's record and hooks
(``step``), device-side sums (``meter``), accuracy over a split across processes (``accuracy``),
checkpoints, signals, the run's log, optimizer and schedules, and the student and teacher sides
as modules (``sides``, ``features``).

May import: ``kd.config``, ``kd.models``, ``kd.data``, ``kd.losses``, ``kd.precision``,
``kd.teacher``, ``backends`` and the top-level helpers; never ``kd.commands`` (which calls it).
"""
