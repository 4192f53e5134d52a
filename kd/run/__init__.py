"""A run: what happens between ``kd train`` and its last checkpoint.

Here: the processes and where each sits (``launch``, ``placement``); the one loop (``loop``: one
data pipeline and one teacher forward per batch for every student of the run, the teacher's
preparation, the run folders); one student, a *lane* (``lane``: its step and the rules around it,
non-finite losses, unreadable images, stops, logging, checkpoints; ``build``: its parts); the
students of a run (``students``, and ``plan``, which reads several from methods or recipes); the
step's record, hooks and update policy (``step``: ``apply_gradients``); device-side sums
(``meter``); accuracy over a split across processes (``accuracy``); checkpoints, signals, the
run's log, optimizer and schedules, the machine's facts (``runtime``), the benchmark timer
(``timing``), and the student and teacher sides as modules (``sides``, ``features``).

May import: ``kd.config``, ``kd.models``, ``kd.data``, ``kd.losses``, ``kd.precision``,
``kd.teacher``, ``backends`` and the top-level helpers; never ``kd.commands`` (which calls it).
"""
