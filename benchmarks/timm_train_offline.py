"""timm's own train.py, run where no hub can be reached: its distillation teacher loads a local file.

Usage: KD_TIMM_TEACHER=teacher.pth python benchmarks/timm_train_offline.py .timm/train.py [train.py's options]

train.py (the timm release's script, taken from its repository into the ignored .timm/, never committed)
builds the teacher of ``--kd-model-name`` with ``pretrained=True`` and no way to name a file; this wrapper
passes KD_TIMM_TEACHER (a plain state dict, e.g. from ``kd export``) as that teacher's pretrained file.
"""

from __future__ import annotations

import os
import runpy
import sys

import timm.task.distillation as distillation


def main() -> None:
    teacher_file = os.environ["KD_TIMM_TEACHER"]
    build = distillation.DistillationTeacher.__init__

    def from_file(self, model_name_or_module, num_classes=None, in_chans=3, pretrained_path=None, **kwargs):
        build(self, model_name_or_module, num_classes, in_chans, pretrained_path or teacher_file, **kwargs)

    distillation.DistillationTeacher.__init__ = from_file  # type: ignore[method-assign]
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
