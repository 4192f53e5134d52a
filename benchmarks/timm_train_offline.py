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
import timm.task.token_distillation as token_distillation


def teacher_from(teacher_file: str, cls: type) -> None:
    """``cls``'s teachers built from ``teacher_file`` where train.py names no file."""
    build = cls.__init__

    def from_file(self, model_name_or_module, num_classes=None, in_chans=3, pretrained_path=None, **kwargs):
        build(self, model_name_or_module, num_classes, in_chans, pretrained_path or teacher_file, **kwargs)

    cls.__init__ = from_file  # type: ignore[method-assign]


def main() -> None:
    teacher_file = os.environ["KD_TIMM_TEACHER"]
    teacher_from(teacher_file, distillation.DistillationTeacher)
    # some timm releases (1.0.29) build the token distillation's teacher with a class of its own
    if hasattr(token_distillation, "TokenDistillationTeacher"):
        teacher_from(teacher_file, token_distillation.TokenDistillationTeacher)
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
