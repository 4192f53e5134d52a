"""The frozen teacher: set up once per run and shared by every student of it.

Here: its precision, chosen apart from the student's opt level and checked on a few validation
batches before training (``probe``), its inference rewrite (``fuse``: BatchNorm folding, fused
convolutions), and the set-up teacher itself (``frozen``: on its device, fused, its precision
chosen, its feature taps, its forward and its validation), and ``store``: its outputs kept on
disk by ``kd teach`` and read by ``kd train --soft-labels`` in place of its forward.

May import: ``kd.models``, ``kd.precision``, ``kd.run``'s sides, accuracy and signals, and the
top-level helpers; never ``kd.commands``.
"""
