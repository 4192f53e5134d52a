"""The frozen teacher: set up once per run and shared by every student of it.

Here: its precision, chosen apart from the student's opt level and checked on a few validation
batches before training (``precision``), its inference rewrite (``fuse``: BatchNorm folding, fused
convolutions), and the set-up teacher itself (``frozen``: on its device, fused, its precision
chosen, its feature taps, its forward and its validation), and ``store``: its outputs kept on
disk by ``kd teach`` and read by ``kd train --soft-labels`` in place of its forward. Both are
teacher sources (``source``): the loop asks either for a batch's targets.

May import: ``kd.models``, ``kd.precision``, ``kd.data`` (its own val crops), ``kd.utils`` and the
top-level helpers; never the engine (``kd.run``) or ``kd.commands`` (tests/test_imports.py holds
the table).
"""
