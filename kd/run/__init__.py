"""A run: what happens between ``kd train`` and its last checkpoint.

Here: the students of a run, one or several, and where each resumes (``students``: the one
currency, resolved once from a command's options); what each process runs, as the command chose
it (``jobs``: train or teach); the processes (``launch``); the one loop (``loop``: one data
pipeline and one teacher source per batch for every student of the run, the run folders); one
student, a *lane* (``lane``: its step and the rules around it, non-finite losses, unreadable
images, stops, logging, checkpoints; ``build``: its parts; ``state``: where its training stands);
``kd teach``'s run (``teach``); the step's record, hooks and update policy (``step``:
``apply_gradients``); the moving average of a student's weights (``ema``); device-side sums
(``meter``); a lane's checkpoints (``checkpoint``), the run's log, optimizer and schedules, the
machine's facts (``runtime``), the benchmark timer
(``timing``), the student side as one module (``sides``), and the paper setting a run resembles
(``paper_setting``). Where each process sits, stops,
accuracy across processes, feature taps and checkpoint file I/O are below every package, in
``kd.utils``.

May import: ``kd.config``, ``kd.models``, ``kd.data``, ``kd.losses``, ``kd.precision``,
``kd.teacher``, ``backends``, ``kd.utils`` and the top-level helpers; never ``kd.commands`` (which
calls it).
"""
