"""Run configuration: defaults < recipe < command-line options < ``--set key=value``.

A :class:`RunConfig` is plain data. Recipes are YAML files with the same keys
(``yaml.safe_load`` only); the resolved config is saved as ``OUT/config.yaml``.
Every problem found here raises :class:`~kd.errors.KDError`.

This package gives its modules' public names; each module holds one role:
:mod:`~kd.config.schema` (RunConfig, its fields and choices), :mod:`~kd.config.options` (kd train's
option table), :mod:`~kd.config.recipes` (recipe files), :mod:`~kd.config.rules` (the checks) and
:mod:`~kd.config.resolution` (the sources resolved and validated; config.yaml saved and read).
Modules deep in kd's engine (:mod:`kd.run.resume`) import the module they need rather than the
package, which keeps the chain of imports from the command line short.
"""

from __future__ import annotations

from kd.config.options import TRAIN_OPTIONS, Option, cli_flag, cli_value
from kd.config.recipes import RECIPE_DIR, find_recipe, load_yaml
from kd.config.resolution import (
    RETIRED,
    TEACHER_OPTIONS,
    apply,
    load,
    parse_set,
    refuse_unused,
    resolve,
    save,
    scale_schedule,
    validate,
)
from kd.config.schema import (
    AMP_DTYPES,
    AMP_IMPLS,
    COMPILE_MODES,
    DEVICES,
    FIELDS,
    FORMER_ALPHA,
    INTERPOLATIONS,
    LOSS_OPTIONS,
    LR_SCHEDULES,
    MP_CONTEXTS,
    OPT_LEVELS,
    SOFT_LABEL_DTYPES,
    TEACHER_PRECISIONS,
    RunConfig,
    coerce,
    field_type,
)
from kd.errors import KDError

__all__ = [
    "AMP_DTYPES",
    "AMP_IMPLS",
    "COMPILE_MODES",
    "DEVICES",
    "FIELDS",
    "FORMER_ALPHA",
    "KDError",
    "INTERPOLATIONS",
    "LOSS_OPTIONS",
    "LR_SCHEDULES",
    "MP_CONTEXTS",
    "OPT_LEVELS",
    "RECIPE_DIR",
    "RETIRED",
    "SOFT_LABEL_DTYPES",
    "TEACHER_OPTIONS",
    "TEACHER_PRECISIONS",
    "TRAIN_OPTIONS",
    "Option",
    "RunConfig",
    "apply",
    "cli_flag",
    "cli_value",
    "coerce",
    "field_type",
    "find_recipe",
    "load",
    "load_yaml",
    "parse_set",
    "refuse_unused",
    "resolve",
    "save",
    "scale_schedule",
    "validate",
]
