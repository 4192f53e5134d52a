"""The students of a run, one or several, and where each starts: the one currency of a training.

A run is always :class:`Students`. One student alone lives in its run folder ``OUT``; several
(``kd train --kd-loss kd,dkd,dist,lskd`` or ``--recipe A --recipe B``, for the table a rebuttal
asks for) live in ``OUT/<name>/`` beside ``OUT/students.yaml``, which names them and those a
non-finite loss stopped (a resume continues the others). Each student's folder is a normal run
folder that ``kd report``, ``kd eval`` and ``kd train --resume --out OUT/<name>`` read as any other.

* Same seed, same result: each student is initialised from ``--seed`` as its own run would be,
  and draws its dropout / drop-path masks from its own generators (swapped in around its
  calls), so on the CPU it ends bit for bit equal to its separate run.
* A loss that stays non-finite stops that student only (its last good checkpoint stays); the
  others train on, and the command ends with exit code 2 naming it.
* Backends: each student is wrapped by a :meth:`backends.base.Backend.fork` of the run's
  backend (its own DDP module and gradient buckets); the teacher is wrapped forward-only once,
  so under dp its outputs are computed once and scattered with the batch to every student.

Resuming is decided here, once, for the command line and Python alike (:func:`for_command`):
each student's checkpoint is named in :attr:`Students.resume`, and the engine reads each once.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from kd import config as kd_config
from kd.errors import KDError
from kd.run.resume import resumed_config
from kd.runfolder import RunFolder

STUDENTS_FILE = "students.yaml"


@dataclass(frozen=True)
class Students:
    """The students of one run: their names, resolved configs and run folders, and where each
    starts. Several students live in ``out/<name>/`` beside ``out/students.yaml``; one alone is
    its run folder."""

    out: Path
    names: Tuple[str, ...]
    cfgs: Tuple[Any, ...]
    #: each student's checkpoint to continue from (None: it starts afresh); empty for a fresh run
    resume: Tuple[Optional[Path], ...] = ()
    #: students a non-finite loss stopped in an earlier part of the run: name -> why (not resumed)
    stopped: Dict[str, str] = field(default_factory=dict)

    @functools.cached_property  # asked at every step of the loop
    def grouped(self) -> bool:
        """Whether they live in ``out/<name>/`` beside ``out/students.yaml`` (not a plain run's folder)."""
        return Path(self.cfgs[0].out) != self.out

    @property
    def first(self):
        """The first student's config: what the students share (data, teacher, hardware) is read here."""
        return self.cfgs[0]

    @property
    def resuming(self) -> bool:
        return any(path is not None for path in self.resume)

    def folder(self, name: str) -> Path:
        return self.out / name if self.grouped else self.out

    def folders(self) -> List[Path]:
        """Every folder the run writes: the students' own where several, and each student's."""
        return [*([self.out] if self.grouped else []), *(Path(c.out) for c in self.cfgs)]

    def checkpoint(self, name: str) -> Optional[Path]:
        """The checkpoint ``name`` continues from, or None."""
        return self.resume[self.names.index(name)] if self.resume else None

    def training(self) -> List[Tuple[str, Any]]:
        """(name, config) of the students that train: all but those a non-finite loss stopped."""
        return [(n, c) for n, c in zip(self.names, self.cfgs) if n not in self.stopped]

    @classmethod
    def alone(cls, cfg, resume: Optional[Path] = None) -> Students:
        """The one student of a plain ``kd train``, in ``cfg.out``, continuing from ``resume`` where given."""
        out = Path(cfg.out)
        return cls(out, (out.name,), (cfg,), (resume,) if resume is not None else ())

    def record(self, stopped: Dict[str, str]) -> None:
        """Several students: ``out``/students.yaml names them and those a non-finite loss stopped."""
        if self.grouped:
            write_students(self.out, self.names, stopped)

    def written(self) -> str:
        """Where a stop's checkpoints went, in words."""
        if self.grouped:
            return f"every student's checkpoint written below {self.out}"
        return f"checkpoint written to {RunFolder(self.out).last}"

    def from_last_checkpoints(self) -> Optional[Students]:
        """These students continuing from their own last.pt (a restarted process group), or None
        where a student that trains has none yet."""
        stopped = stopped_students(self.out) if self.grouped else {}
        last = [RunFolder(c.out).last for c in self.cfgs]
        if not all(path.is_file() for name, path in zip(self.names, last) if name not in stopped):
            return None
        return dataclasses.replace(self, resume=tuple(last), stopped=stopped)

    def finished(self) -> Optional[str]:
        """Where every resumed student has trained its epochs already: the line that says so (nothing
        to do), else None. Reads only each checkpoint's header (memory-mapped)."""
        from kd.run.checkpoint import finished_epochs

        if not self.resuming:
            return None
        done = []
        for name, cfg in self.training():
            path = self.checkpoint(name)
            epochs = finished_epochs(path, cfg.epochs) if path is not None else None
            if epochs is None:
                return None
            done.append(epochs)
        what = f"{self.out} already finished ({done[0]} epochs)" if done else f"every student of {self.out} stopped"
        return f"kd: {what}; raise --epochs to continue"


def is_students_folder(out: Path) -> bool:
    return (Path(out) / STUDENTS_FILE).is_file()


def stopped_students(out: Path) -> Dict[str, str]:
    """The students of the run in ``out`` that a non-finite loss stopped: name -> why."""
    return read_students_file(out)[1] if is_students_folder(out) else {}


def student_folders(out: Path) -> List[str]:
    """The names of the folders below ``out`` that hold a student's run (its config or checkpoints)."""
    runs = (RunFolder(p) for p in Path(out).iterdir() if p.is_dir())
    return sorted(run.root.name for run in runs if run.config.is_file() or run.last.is_file())


def read_students_file(out: Path) -> Tuple[Tuple[str, ...], Dict[str, str]]:
    """``out``/students.yaml: the students' names and those stopped, checked against the students'
    folders beside it (a cut or edited list would leave students behind without a word)."""
    path = Path(out) / STUDENTS_FILE
    folders = student_folders(out)
    restore = f"restore it (students: [{', '.join(folders)}]) or resume each student alone with --out {out}/NAME"
    try:
        content = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise KDError(f"{path} is damaged (not YAML: {type(exc).__name__}); {restore}") from None
    names = content.get("students") if isinstance(content, dict) else None
    stopped = (content.get("stopped") or {}) if isinstance(content, dict) else {}
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise KDError(f"{path} is damaged (it holds no list of students); {restore}")
    if not isinstance(stopped, dict):
        raise KDError(f"{path} is damaged (its stopped students are not a mapping); {restore}")
    if sorted(names) != folders:
        unnamed = [f for f in folders if f not in names]
        absent = [n for n in names if n not in folders]
        what = "; ".join(
            [*([f"it leaves out {', '.join(unnamed)}, whose folders are in {out}"] if unnamed else []),
             *([f"it names {', '.join(absent)}, which has no run folder in {out}"] if absent else [])]
        )  # fmt: skip
        raise KDError(f"{path} does not list the students of the run: {what}; {restore}")
    return tuple(names), {str(k): str(v) for k, v in stopped.items()}


def write_students(out: Path, names: Sequence[str], stopped: Dict[str, str]) -> None:
    """``out``/students.yaml: the students, and those stopped (a resume continues the others)."""
    out.mkdir(parents=True, exist_ok=True)
    content = {"students": list(names), **({"stopped": dict(stopped)} if stopped else {})}
    tmp = out / f".{STUDENTS_FILE}.tmp"
    tmp.write_text(yaml.safe_dump(content))
    tmp.replace(out / STUDENTS_FILE)


# ----------------------------------------------------------------------------- one entry
DEFAULT_OUT = kd_config.RunConfig.out


def for_command(
    recipes: Sequence[str],
    options: Dict[str, Any],
    sets: Sequence[str] = (),
    resume: Optional[str] = None,
    overwrite: bool = False,
) -> Students:
    """The students of ``kd train`` with these recipes, options (``--set`` items in ``sets``) and
    ``--resume`` (None, ``"last"`` or a checkpoint's path): planned afresh, or those of ``--out``
    continued with the options applied (a single run's config.yaml is the base its options change).
    ``kd.train`` with a dict of options comes here too, so Python and the command line agree."""
    if resume and overwrite:
        raise KDError("--resume and --overwrite contradict each other; give one")
    out = Path(options.get("out") or DEFAULT_OUT)
    several = len(recipes) > 1 or "," in str(options.get("kd_loss") or "")
    if several or (resume and is_students_folder(out)):
        return _resume_students(out, recipes, options, sets, resume) if resume else plan(recipes, options, sets)
    if resume:
        run = RunFolder(options.get("out") or (Path(resume).parent.parent if resume != "last" else DEFAULT_OUT))
        checkpoint = checkpoint_to_resume(run.root, resume)
        recipe = recipes[0] if recipes else None
        return Students.alone(resumed_config(run.root, checkpoint, options, sets, recipe), checkpoint)
    cfg = kd_config.resolve(recipe=recipes[0] if recipes else None, options=options, sets=list(sets))
    return Students.alone(cfg)


def checkpoint_to_resume(out: Path, resume: str) -> Path:
    """The checkpoint ``--resume`` names (``"last"``: ``OUT/checkpoints/last.pt``), which must exist."""
    run = RunFolder(out)
    path = run.last if resume == "last" else Path(resume)
    if not path.is_file():
        held = "" if run.config.is_file() else f" ({run.root} holds no run; start it without --resume)"
        raise KDError(f"nothing to resume: {path} does not exist{held}")
    return path


def _resume_students(out: Path, recipes: Sequence[str], options: Dict[str, Any], sets, resume: str) -> Students:
    """The students ``--out`` holds, continued from their own last.pt with ``options`` applied; the
    same command again with ``--resume`` is fine where it names the same students."""
    if resume != "last":
        raise KDError(f"--resume {resume}: several students resume from their own last.pt; give --out {out} --resume")
    held = load(out) if is_students_folder(out) else None
    if recipes or options.get("kd_loss"):
        methods = [m for m in str(options.get("kd_loss") or "").split(",") if m]
        asked = methods if len(methods) > 1 or not recipes else [Path(r).stem for r in recipes]
        names = list(held.names) if held is not None else []
        if sorted(asked) != sorted(names):
            raise KDError(
                f"--resume continues the students --out {out} holds ({', '.join(names) or 'none'}), "
                f"not {', '.join(asked)}; leave out --recipe and --kd-loss, or name the same ones"
            )
        options = {k: v for k, v in options.items() if k != "kd_loss"}
    students = resumed(out, options, sets, held)
    continued = students.from_last_checkpoints()
    if continued is None:  # a student that trains has no last.pt
        stopped = stopped_students(out)
        lasts = [RunFolder(c.out).last for n, c in zip(students.names, students.cfgs) if n not in stopped]
        raise KDError(f"nothing to resume: {next(last for last in lasts if not last.is_file())} does not exist")
    if not continued.training():
        raise KDError(f"every student of {out} stopped on a non-finite loss; nothing to resume")
    return continued


# ----------------------------------------------------------------------------- planning
#: The keys each student may set for itself; every other key is shared by the run's students.
PER_STUDENT = (
    "student",
    "student_weights",
    "student_data",
    "kd_loss",
    "ce_weight",
    "label_smoothing",
    "bce_loss",
    "bce_target_thresh",
    "temperature",
    "standardise",
    "loss_args",
    "feature_layers",
    "lr",
    "lr_for_batch",  # each recipe's own batch for its lr
    "schedule_note",  # each student's schedule, scaled to the run's epochs
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
#: per-student keys that are not options (what a recipe or kd set), left out of the refusal's list
NOT_OPTIONS = ("recipe", "description", "out", "lr_for_batch", "schedule_note")
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
        if len({repr(getattr(c, key)) for _, c in group}) > 1:
            differ.append(_disagreement(key, group))
    if differ:
        raise KDError(
            f"the students of one run share what they train on, and these differ: {'; '.join(differ)} "
            "(each student keeps its own model, method and optimisation)"
        )


def _disagreement(key: str, group: Sequence[Tuple[str, Any]]) -> str:
    """``--batch-size (crd: 256, dkd: 512): give one --batch-size`` in kd train's words: its option,
    each student's value as the command line writes it, and the option that makes them one."""
    option = next((o for o in kd_config.TRAIN_OPTIONS if o.field == key), None)
    if option is None:
        flag, fix = f"{key}", f"--set {key}=VALUE"
    elif option.switch and "/" in option.flags[0]:
        flag, _, off = option.flags[0].partition("/")
        fix = f"{flag} or {off}"
    else:
        flag = kd_config.cli_flag(key)
        fix = f"one {flag}"
    values = ", ".join(f"{name}: {kd_config.cli_value(getattr(cfg, key))}" for name, cfg in group)
    return f"{flag} ({values}): give {fix}"


def load(out: Path) -> Students:
    """The students of the run in ``out`` (its students.yaml), each with the config it trained with
    (its last checkpoint's, checked against its config.yaml; its config.yaml where it has none yet)
    in its folder below ``out`` wherever ``out`` is now (a copied or moved run continues in place)."""
    names, stopped = read_students_file(out)
    cfgs = []
    for name in names:
        run = RunFolder(Path(out) / name)
        if run.last.is_file():
            cfgs.append(resumed_config(run.root, run.last, {}, ()))
        elif run.config.is_file():
            cfgs.append(dataclasses.replace(kd_config.load(run.config), out=str(run.root)))
        else:
            raise KDError(f"{out}/{STUDENTS_FILE} names {name}, but {run.root} holds no config.yaml or checkpoint")
    return Students(Path(out), names, tuple(cfgs), stopped=stopped)


def resumed(out: Path, options: Dict[str, Any], sets: Sequence[str], held: Optional[Students] = None) -> Students:
    """The students ``out`` holds (``held``, where already loaded), with the options of ``kd train
    --resume`` (``--epochs``, say) applied to each as :func:`kd.run.resume.continued` allows."""
    from kd.run.resume import continued

    students = held if held is not None else load(out)
    cfgs = [continued(cfg, options, sets) for cfg in students.cfgs]
    check_shared(students.names, cfgs)
    return dataclasses.replace(students, cfgs=tuple(cfgs))
