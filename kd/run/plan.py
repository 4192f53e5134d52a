"""Several students in one run: one input pipeline and one teacher forward per batch, for the
table a rebuttal asks for (``kd train --kd-loss kd,dkd,dist,lskd`` or ``--recipe A --recipe B``).

Each student is a :class:`kd.run.loop.Trainer` built with a :class:`Shared` (the data, the
teacher's model, the stop flag): its own optimizer, schedule, precision and scaler, connectors,
meters, logger, checkpoints and run folder ``OUT/<name>/``, a normal run folder that ``kd
report``, ``kd eval`` and ``kd train --resume --out OUT/<name>`` read as any other. ``OUT/students.yaml``
names them, so ``kd train --out OUT --resume`` continues them all.

* Same seed, same result: each student is initialised from ``--seed`` as its own run would be,
  and draws its dropout / drop-path masks from its own generators (swapped in around its
  calls), so on the CPU it ends bit for bit equal to its separate run.
* A loss that stays non-finite stops that student only (its last good checkpoint stays); the
  others train on, and the command ends with exit code 2 naming it.
* Backends: each student is wrapped by a :meth:`backends.base.Backend.fork` of the run's
  backend (its own DDP module and gradient buckets); the teacher is wrapped forward-only once,
  so under dp its outputs are computed once and scattered with the batch to every student.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

from kd import config as kd_config
from kd.errors import KDError
from kd.run.students import STUDENTS_FILE, Students
from kd.runfolder import RunFolder

#: The keys each student may set for itself; every other key is shared by the run's students.
PER_STUDENT = (
    "student",
    "student_weights",
    "student_data",
    "kd_loss",
    "ce_weight",
    "label_smoothing",
    "temperature",
    "loss_args",
    "feature_layers",
    "lr",
    "momentum",
    "nesterov",
    "weight_decay",
    "wd_bn_bias",
    "lr_schedule",
    "lr_milestones",
    "lr_gamma",
    "warmup_epochs",
    "grad_clip",
    "fused_optimizer",
    "eval_every",
    "save_every_steps",
    "keep_last",
    "max_nonfinite_steps",
    "recipe",
    "description",
    "reference",
    "out",
    # a student trained alone on the labels (a baseline row) needs no teacher of its own
    "no_teacher",
)
TEACHER_KEYS = ("teacher", "teacher_weights", "teacher_precision", "teacher_data")


# ----------------------------------------------------------------------------- planning
def plan(recipes: Sequence[str], options: Dict[str, Any], sets: Sequence[str]) -> Students:
    """The students of ``--recipe A --recipe B ...`` or ``--kd-loss a,b,...`` (not both), each
    resolved as its own ``kd train`` would be, then checked to agree on every shared key.

    With ``--kd-loss a,b`` and one recipe, the recipe's method hyper-parameters go to its own
    method only; the others take their defaults (and what the command line gives)."""
    methods = [m.strip() for m in str(options.get("kd_loss") or "").split(",") if m.strip()]
    if len(recipes) > 1 and len(methods) > 1:
        raise KDError("give several --recipe or a list of --kd-loss methods, not both")
    if len(set(methods)) < len(methods) or len(set(recipes)) < len(recipes):
        raise KDError("a method or recipe is named twice; each student needs its own")
    parent = Path(options.get("out") or kd_config.RunConfig.out)
    cfgs: List[Any] = []
    names: List[str] = []
    for recipe in recipes if len(recipes) > 1 else [recipes[0] if recipes else None] * len(methods):
        method = methods[len(cfgs)] if len(methods) > 1 else None
        cfg = kd_config.resolve(
            recipe=recipe, options={**options, **({"kd_loss": method} if method else {})}, sets=list(sets)
        )
        if method and recipe:
            cfg = _method_defaults(cfg, recipe, options, sets)
        if method:
            names.append(method)
        else:
            assert recipe is not None  # with one method or none, the students are the recipes
            names.append(Path(recipe).stem)
        cfgs.append(cfg)
    if len(set(names)) < len(names):
        raise KDError(f"two students would share a folder name ({', '.join(names)}); give recipes of different names")
    check_shared(names, cfgs)
    cfgs = [dataclasses.replace(cfg, out=str(parent / name)) for name, cfg in zip(names, cfgs)]
    return Students(parent, tuple(names), tuple(cfgs))


def _method_defaults(cfg, recipe: str, options: Dict[str, Any], sets: Sequence[str]):
    """``cfg`` without the recipe's method hyper-parameters where the recipe was written for another method."""
    own = kd_config.resolve(
        recipe=recipe, options={k: v for k, v in options.items() if k != "kd_loss"}, sets=list(sets)
    )
    if own.kd_loss == cfg.kd_loss:
        return cfg
    given = set(options.get("loss_args") or {}) | set(kd_config.parse_set(list(sets)).get("loss_args", {}))
    given |= {k for k in kd_config.LOSS_OPTIONS if options.get(k) is not None}
    changes: Dict[str, Any] = {k: None for k in kd_config.LOSS_OPTIONS if k not in given and k not in options}
    changes["loss_args"] = {k: v for k, v in cfg.loss_args.items() if k in given}
    return kd_config.validate(dataclasses.replace(cfg, **changes))


def check_shared(names: Sequence[str], cfgs: Sequence[Any]) -> None:
    """Refuse students that disagree on a key they share (data, teacher, batch, image size, epochs,
    seed, hardware, precision...), naming each such key and its values."""
    teachers = [c for c in cfgs if not c.no_teacher]
    if not teachers:
        raise KDError("several students need a teacher to share; without one, train each with its own kd train")
    differ = []
    for key in kd_config.FIELDS:
        if key in PER_STUDENT:
            continue
        group = [(n, c) for n, c in zip(names, cfgs) if key not in TEACHER_KEYS or not c.no_teacher]
        values = {repr(getattr(c, key)) for _, c in group}
        if len(values) > 1:
            differ.append(f"{key} ({', '.join(f'{n}: {getattr(c, key)}' for n, c in group)})")
    if differ:
        raise KDError(
            f"the students disagree on what they share: {'; '.join(differ)}. Students of one run share the "
            f"data, the teacher, the batch, image size, epochs, seed, hardware and precision; each may set "
            f"only {', '.join(k for k in PER_STUDENT if k not in ('recipe', 'description', 'out'))}"
        )


def load(out: Path) -> Students:
    """The students of the run in ``out`` (its students.yaml and each student's config.yaml)."""
    names = tuple((yaml.safe_load((Path(out) / STUDENTS_FILE).read_text()) or {}).get("students") or ())
    cfgs = []
    for name in names:
        config = RunFolder(Path(out) / name).config
        if not config.is_file():
            raise KDError(f"{out}/{STUDENTS_FILE} names the student {name}, but {config} does not exist")
        cfgs.append(kd_config.load(config))
    return Students(Path(out), names, tuple(cfgs))


def resumed(out: Path, options: Dict[str, Any], sets: Sequence[str]) -> Students:
    """The students ``out`` holds, with the options of ``kd train --resume`` (``--epochs``, say) applied to each."""
    students = load(out)
    cfgs = [kd_config.resolve(options={**options, "out": cfg.out}, sets=list(sets), base=cfg) for cfg in students.cfgs]
    check_shared(students.names, cfgs)
    return dataclasses.replace(students, cfgs=tuple(cfgs))


def train(students: Students, resume: Optional[str] = None, overwrite: bool = False) -> Dict[str, float]:
    """Train ``students`` together (from Python: ``kd.run.plan.train(kd.run.plan.plan(...))``)."""
    from kd.run.launch import train as launch_train

    return launch_train(students.cfgs[0], resume=resume, overwrite=overwrite, students=students)
