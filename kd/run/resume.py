"""What a resume continues: the config the run trained with (stored in its checkpoint), with only
the options that cannot change its result taken from the command line.

* The checkpoint's config is the run's. ``config.yaml`` must say the same (an edit or a cut is
  refused, naming what differs); deleted, it is written again from the checkpoint.
* :data:`RESUMABLE`: the options a resume may change: ``--epochs`` (to extend the run), where the
  data is, the machine (devices, backend, processes, precision, compilation, loader) and logging.
  Any other option given with ``--resume`` must repeat the run's own value (the same command again
  is fine); another value is refused in one line, as a new run in another ``--out`` is what it asks.
* The run folder may be copied or moved: its own path replaces the one recorded (``out``); so may
  the teacher's or the student's weights file, where the file at the new path holds the bytes the
  run read (the SHA-256 its provenance.json recorded).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from kd.config.options import cli_flag, cli_value
from kd.config.resolution import RETIRED, TEACHER_OPTIONS, apply, resolve, validate
from kd.config.resolution import load as load_config
from kd.config.schema import FIELDS, LOSS_OPTIONS, RunConfig
from kd.errors import KDError

#: options a resume may change (each continues the same training: where the data is, the machine,
#: how it is logged and saved), beside ``--epochs``, which extends it
RESUMABLE = frozenset(
    {
        "epochs",
        "out",
        "data",
        "soft_labels",
        "loader",
        "workers",
        "mp_context",
        "cpu_decode_share",
        "val_cache_gb",
        "max_bad_images",
        "device",
        "backend",
        "gpus",
        "nproc",
        "dist_backend",
        "dp_output_device",
        "find_unused_parameters",
        "static_graph",
        "opt",
        "amp_dtype",
        "amp_impl",
        "teacher_precision",
        "channels_last",
        "compile",
        "compile_mode",
        "cudnn_benchmark",
        "fuse_teacher",
        "fused_optimizer",
        "max_restarts",
        "log_every",
        "progress_bar",
        "eval_every",
        "save_every_steps",
        "keep_last",
        "max_nonfinite_steps",
    }
)
#: keys kd derives (from the recipe, the lr's batch, the schedule's scaling): never compared
DERIVED = frozenset({"recipe", "description", "reference", "lr_for_batch", "schedule_note"})
#: what a resume continues as it ran: every key neither resumable nor derived
FIXED = tuple(k for k in FIELDS if k not in DERIVED and k not in RESUMABLE)


def ran_config(state: Dict[str, Any], path: Path, out: Path) -> RunConfig:
    """The config the run of checkpoint ``path`` trained with (its ``state``), in the folder ``out``."""
    values = state.get("config")
    if not isinstance(values, dict):
        raise KDError(f"{path} holds no run config: it is not a kd training checkpoint; start a new run")
    kept = {k: v for k, v in values.items() if k not in RETIRED}  # as config.yaml is read
    return dataclasses.replace(apply(RunConfig(), kept, str(path)), out=str(out))


#: weights files a resume may find at another path, holding the same bytes
WEIGHTS = {"teacher_weights": "teacher", "student_weights": "student"}


def same_file(new: Optional[str], old: Optional[str], folder: Path, key: str) -> bool:
    """Whether weights file ``new`` holds what ``old`` held when the run read it (a moved file): the
    SHA-256 the run's provenance.json recorded for that side, or ``old``'s own where it still exists."""
    if not new or not old or new == old or not Path(new).is_file():
        return False
    from kd.run import provenance

    parts = provenance.load(folder)
    recorded = (parts[-1].get(WEIGHTS[key]) or {}).get("sha256") if parts else None
    if recorded is None and Path(old).is_file():
        recorded = provenance.sha256(Path(old))
    return recorded is not None and provenance.sha256(Path(new)) == recorded


#: the keys that carry the KD method's hyper-parameters
METHOD_KEYS = (*LOSS_OPTIONS, "loss_args")


def method_args(cfg: RunConfig) -> Dict[str, Any]:
    """The KD method's hyper-parameters as the run resolves them: its defaults, then what it was given
    (``--temperature`` and its kin, ``loss_args``): a None option is the method's default, not 'auto'."""
    from kd.losses import LOSSES

    return {**LOSSES.get("ce" if cfg.no_teacher else cfg.kd_loss).defaults, **cfg.loss_kwargs()}


def same_args(a: RunConfig, b: RunConfig) -> bool:
    """Whether two configs of one method give it the same hyper-parameters (``--temperature 4`` where the
    run left it to the method's default 4)."""
    return a.kd_loss == b.kd_loss and method_args(a) == method_args(b)


def run_value(cfg: RunConfig, key: str) -> str:
    """``key``'s value in the command line's words; a method's option left to its default shows that."""
    value = getattr(cfg, key)
    if value is None and key in LOSS_OPTIONS:
        value = method_args(cfg).get(key)
    return cli_value(value)


def differences(a: RunConfig, b: RunConfig, keys) -> list:
    return [k for k in keys if getattr(a, k) != getattr(b, k)]


def with_last_part(ran: RunConfig, config_file: Path, checkpoint: Path) -> RunConfig:
    """``ran`` with what the run's last part chose of :data:`RESUMABLE` (its config.yaml, written as a
    resume starts: ``--epochs 200`` stays asked where a stop came before the next checkpoint); every
    other key of ``config_file`` must say what the checkpoint's config says. A missing config.yaml is
    written again when the run starts."""
    if not config_file.exists():
        return ran
    try:
        saved = load_config(config_file)
    except KDError as exc:
        raise KDError(
            f"{config_file} is damaged ({str(exc).split(': ', 1)[-1]}); delete it and kd writes it again "
            f"from {checkpoint.name}"
        ) from None
    differ = differences(saved, ran, FIXED)
    if differ:
        value = cli_value
        shown = ", ".join(f"{k} ({value(getattr(saved, k))}; trained: {value(getattr(ran, k))})" for k in differ[:4])
        more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
        raise KDError(
            f"{config_file} differs from the config the run trained with (kept in {checkpoint.name}): "
            f"{shown}{more}; restore it, or delete it and kd writes it again"
        )
    return dataclasses.replace(ran, **{k: getattr(saved, k) for k in RESUMABLE if k != "out"})


def continued(ran: RunConfig, options: Dict[str, Any], sets: Sequence[str], recipe: Optional[str] = None) -> RunConfig:
    """``ran`` with the options of ``kd train --resume`` applied: those of :data:`RESUMABLE` taken,
    every other one refused in one line unless it repeats the run's value. ``recipe`` (the command
    run again with ``--resume``) must be the run's own; its values are the run's already (scaled to its
    epochs, as they were), so it is not applied again."""
    if recipe and Path(str(recipe)).stem != Path(str(ran.recipe or "")).stem:
        raise KDError(
            f"--resume continues the run of {'recipe ' + str(ran.recipe) if ran.recipe else 'no recipe'}, "
            f"not of recipe {recipe}; leave out --recipe, or start a new run in another --out"
        )
    asked = resolve(options={**options, "out": ran.out}, sets=list(sets), base=ran)
    moved = [k for k in WEIGHTS if same_file(getattr(asked, k), getattr(ran, k), Path(ran.out), k)]
    differ = [k for k in differences(asked, ran, FIXED) if k not in moved]
    if any(k in METHOD_KEYS for k in differ) and same_args(asked, ran):  # --temperature 4 where T was left at 4
        differ = [k for k in differ if k not in METHOD_KEYS]
    if differ:
        no_teacher = "no teacher, --no-teacher"  # a teacher option's default was never used
        shown = ", ".join(
            f"{cli_flag(k)} {run_value(asked, k)} "
            f"(run: {no_teacher if ran.no_teacher and k in TEACHER_OPTIONS else run_value(ran, k)})"
            for k in differ
        )
        raise KDError(
            f"--resume continues the run as it trained and cannot change {shown}; leave "
            f"{'it' if len(differ) == 1 else 'them'} out, or start a new run in another --out"
        )
    changes = {k: getattr(asked, k) for k in (*RESUMABLE, *moved)}
    return validate(dataclasses.replace(ran, **changes))


def resumed_config(
    folder: Path, checkpoint: Path, options: Dict[str, Any], sets: Sequence[str], recipe: Optional[str] = None
) -> RunConfig:
    """The config that continues the run in ``folder`` from ``checkpoint``: the one it trained with
    (checked against its config.yaml), with the options of ``kd train --resume`` applied."""
    from kd.run.checkpoint import load
    from kd.runfolder import RunFolder

    ran = ran_config(load(checkpoint), checkpoint, folder)
    ran = with_last_part(ran, RunFolder(folder).config, checkpoint)
    return continued(ran, options, sets, recipe)
