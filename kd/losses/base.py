"""The protocol every KD method implements.

A method is a pure function on tensors (easy to test against the paper's formula)
plus a thin :class:`DistillLoss` module, registered by name with its card in :mod:`kd.losses`.
Loss modules see tensors only: logits, features, labels; never models or backends.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from kd.errors import KDError
from kd.losses.card import MethodCard
from kd.losses.logits import float32_or_wider

# The label term every method has, and its defaults (a method may change the weight's default).
LABEL_TERM: Dict[str, Any] = {"ce_weight": 1.0, "label_smoothing": 0.0}
#: The keys of the loss's two parts, the weighted label term and the distillation part, which
#: :meth:`DistillLoss.forward` also returns where ``split_parts`` is set (DOT steps them apart).
TASK_PART, DISTILL_PART = "_task_part", "_distill_part"

log = logging.getLogger("kd")


def deprecation(message: str) -> None:
    """One ``kd: warning:`` line on stderr, from the first process of a multi-process start only."""
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        log.warning(f"kd: warning: {message}")


@dataclass
class DistillInputs:
    """What a loss sees for one batch.

    ``labels`` are class indices (N,) or class probabilities (N, C), as cross-entropy takes
    them. ``teacher_logits`` is float32 (or None with ``--no-teacher``): the teacher may run in
    reduced precision, but its logits are cast up before the softmax of the KD term.
    ``student_feats`` / ``teacher_feats`` map a layer name to that module's output, for the
    methods with ``uses_features``. ``progress`` is the training progress in epochs, for
    warm-ups such as DKD's: the engine gives its whole part, the epochs completed (an int, so that
    a compiled step is one graph; every method reads the epoch, ``floor(progress) + 1``), to methods
    whose card ``reads_progress`` only (0.0 to the others), and ``step`` likewise (``reads_step``).

    The engine sets the student's fields from its forward and every other field by name from one
    record per step (:func:`kd.run.record.step_inputs`): a new per-batch input is a field here, set
    there, and read by the method that needs it.
    """

    student_logits: torch.Tensor
    labels: torch.Tensor
    teacher_logits: Optional[torch.Tensor] = None
    student_feats: Dict[str, torch.Tensor] = field(default_factory=dict)
    teacher_feats: Dict[str, torch.Tensor] = field(default_factory=dict)
    progress: float = 0.0
    #: the samples' indices in the training set (int64, on the loss's device), for methods with
    #: ``uses_samples``; None otherwise
    indices: Optional[torch.Tensor] = None
    #: the optimizer step this batch trains (counted from 0 over the whole run)
    step: int = 0
    #: the student's and the teacher's logits on each sample's second view (the strong augmentation,
    #: :mod:`kd.data.views`) for methods with ``views = 2``; None otherwise
    second_student_logits: Optional[torch.Tensor] = None
    second_teacher_logits: Optional[torch.Tensor] = None
    #: the student's linear classifier, for methods with ``uses_classifier`` (its scores of the
    #: final map's cells train it); None otherwise
    student_classifier: Optional[nn.Module] = None
    #: the distillation head's logits of a student with a distillation token (timm's distilled DeiT) for
    #: methods with ``reads_distill_head``, whose student returns both heads; ``student_logits`` is then
    #: the class head's. None otherwise
    distill_logits: Optional[torch.Tensor] = None


def kd_divergence(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: Union[float, torch.Tensor]
) -> torch.Tensor:
    """T^2 * KL(softmax(t/T) || softmax(s/T)), averaged over the batch, in float32; no gradient to t.

    A tensor ``temperature`` (a learned one, 0-dim) gets its gradient through both softmaxes and T^2.
    """
    t = temperature
    log_p_s = F.log_softmax(float32_or_wider(student_logits) / t, dim=1)
    log_p_t = F.log_softmax(float32_or_wider(teacher_logits.detach()) / t, dim=1)
    return F.kl_div(log_p_s, log_p_t, reduction="batchmean", log_target=True) * (t * t)


class DistillLoss(nn.Module):
    """Base class of the registered KD methods: the label term plus the method's own part.

    The loss is ``ce_weight * CE(student, labels; label_smoothing) + distillation part``. The
    base owns the label term for every method: ``ce_weight`` and ``label_smoothing`` are in
    every method's ``defaults`` (first, with :data:`LABEL_TERM`'s values unless the method sets
    its own default weight). A subclass sets ``defaults`` (its hyper-parameters and their
    default values; the config's ``loss_args`` override them, unknown keys are an error) and
    implements :meth:`distill`; :meth:`forward` returns ``{"loss": total, "ce": CE, **terms}``:
    ``"loss"`` is back-propagated, the other entries are logged as they are. With ``split_parts``
    set (``--dot``) it also returns the two summands of ``"loss"`` under :data:`TASK_PART` and
    :data:`DISTILL_PART`, for an optimizer that steps their gradients apart.

    Hyper-parameter names: ``temperature`` for every softmax temperature, ``<what>_weight``
    for every weight. ``renamed`` maps a method's former names to the current ones; a former
    name is accepted with one deprecation line, a former name together with its current one is
    an error. A method whose former name was not a plain rename overrides :meth:`translate_old`.

    What a method needs from a run is its :class:`~kd.losses.card.MethodCard` (``card``, given with its
    registration in :mod:`kd.losses`); the hooks below are how it takes it. A ``uses_features`` method
    has the modules named by ``--feature-layers`` (or :meth:`default_layers`) tapped with forward hooks
    and :meth:`setup_features` called once with the feature shapes, before the optimizer is built, so
    connectors created there are trained, checkpointed and all-reduced with the student. Their
    parameters belong to the student side and are dropped on export.

    ``tap_point = "pre_relu"`` taps each named stage before its final ReLU (OFD, ReviewKD;
    :meth:`side_tap_point` where each side may choose); ``uses_pooled`` adds the pooled feature (the
    classifier's input, (N, C)) as the last entry of both feature dicts; ``reads_teacher_norms`` has
    :meth:`setup_teacher` called with the teacher's BatchNorm before each tapped stage's ReLU (OFD's
    margin). ``uses_classifier`` methods (SDD) read each side's final feature map (the only entry of
    each feature dict) and classifier: :meth:`setup_classifiers` gets the student's classifier's name
    and a copy of the teacher's, and :attr:`DistillInputs.student_classifier` is the student's own at
    each step. ``uses_samples`` methods (CRD) see each sample's index in the training set
    (:attr:`DistillInputs.indices`): :meth:`setup_samples` gets every training sample's class first, and
    :meth:`after_step` runs after each optimizer step. ``views = 2`` methods (:class:`TwoViewLoss`: MLKD,
    CRLD) see a second, strongly augmented view of each sample: the loaders make it, the teacher and the
    student forward it too (:attr:`DistillInputs.second_student_logits`). ``reads_distill_head`` methods
    (DeiT) need a student with a distillation token and see its two heads apart
    (:attr:`DistillInputs.distill_logits`); every other method sees such a student as timm trains it by
    default, the two heads' average.
    """

    #: computed in float32 at every opt level: the precisions keep its parameters and inputs float32
    #: (kd.precision.native.keeps_float32)
    float32_only = True

    defaults: ClassVar[Dict[str, Any]] = dict(LABEL_TERM)
    renamed: ClassVar[Dict[str, str]] = {}
    #: what the method is (set with its registration, :meth:`kd.losses.card.Methods.get`): an unregistered
    #: subclass is a logit method that needs a teacher, and is handed the progress and the step (it may
    #: read them: a registered method's card says whether it does)
    card: ClassVar[MethodCard] = MethodCard(reads_progress=True, reads_step=True)
    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        cls.defaults = {**LABEL_TERM, **cls.defaults}  # the label term first, then the method's own

    def __init__(self, num_classes: int, **hparams: Any):
        super().__init__()
        self.num_classes = num_classes
        hparams = self.upgrade_args(hparams)
        unknown = sorted(set(hparams) - set(self.defaults))
        if unknown:
            valid = ", ".join(sorted(self.defaults)) or "none"
            raise KDError(f"KD loss {self.name!r} has no hyper-parameter {', '.join(unknown)}; valid: {valid}")
        self.hparams: Dict[str, Any] = {**self.defaults, **hparams}
        self.split_parts = False
        #: the label term's loss where it is not the softmax cross-entropy (``--bce-loss``: timm's
        #: BinaryCrossEntropy, :meth:`use_bce`), logged under :attr:`label_name`
        self.label_loss: Optional[nn.Module] = None
        self.label_name = "ce"

    @classmethod
    def translate_old(cls, old: str, value: Any) -> Optional[Dict[str, Any]]:
        """The current hyper-parameters that the former ``old=value`` stands for; None when
        ``old`` is no former name. A plain rename through ``renamed`` unless overridden."""
        return {cls.renamed[old]: value} if old in cls.renamed else None

    @classmethod
    def upgrade_args(cls, args: Dict[str, Any]) -> Dict[str, Any]:
        """``args`` with former names replaced by the current ones, one deprecation line each.

        KDError when a former name comes with a current name it maps to (in the same ``args``).
        """
        out = {k: v for k, v in args.items()}
        for old in list(args):
            new = cls.translate_old(old, args[old])
            if new is None:
                continue
            del out[old]
            clash = [k for k in new if k in out]
            if clash:
                raise KDError(
                    f"KD loss {cls.name!r}: {old!r} is the former name of {clash[0]}; give one of them, not both"
                )
            out.update(new)
            mapped = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in new.items())
            deprecation(
                f"KD loss {cls.name!r}: {old!r} is deprecated, use {' and '.join(new)} ({old}={args[old]} -> {mapped})"
            )
        return out

    @classmethod
    def default_layers(cls, student_layers: List[str], teacher_layers: List[str]) -> List[str]:
        """Layer names to tap when the user names none (feature methods override this)."""
        return []

    def side_tap_point(self, side: str) -> str:
        """Where the engine taps the stages of ``side`` (``student`` or ``teacher``): its card's
        ``tap_point``, unless the method lets each side choose (ReviewKD)."""
        return self.card.tap_point

    def setup_features(self, student_shapes: Dict[str, torch.Size], teacher_shapes: Dict[str, torch.Size]) -> None:
        """Create connectors once the feature shapes are known (feature methods override this)."""

    def setup_teacher(self, norms: Dict[str, Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """(weight, bias) of the teacher's BatchNorm before each tapped stage's final ReLU, by teacher
        feature key, float32 copies (``reads_teacher_norms`` methods override this)."""

    def setup_classifiers(
        self, student_head: str, teacher_weight: torch.Tensor, teacher_bias: Optional[torch.Tensor]
    ) -> None:
        """The student's linear classifier (its module name) and float32 copies of the teacher's weight
        and bias (``uses_classifier`` methods override this)."""

    def setup_samples(
        self, labels: torch.Tensor, seed: int, gather: Callable[[torch.Tensor], torch.Tensor]
    ) -> Optional[str]:
        """Every training sample's class (int64, dataset order), the run's seed and ``gather(t)``, which
        concatenates ``t`` over every process of the run in rank order (a collective), once before
        training (``uses_samples`` methods override this); returns a line for the log, or None."""
        return None

    def after_step(self) -> None:
        """Runs on the loss after each optimizer step, on every process (``uses_samples`` methods
        override this)."""

    def use_bce(self, target_threshold: Optional[float] = None) -> None:
        """The label term becomes timm's ``BinaryCrossEntropy`` (``--bce-loss``, as timm's train.py builds it:
        a sigmoid per class, the mean over samples and classes; ``label_smoothing`` smooths hard labels,
        mixed targets come smoothed by the mixer; ``target_threshold``: targets above it 1, the rest 0),
        logged as ``bce``."""
        from timm.loss import BinaryCrossEntropy

        self.label_loss = BinaryCrossEntropy(
            smoothing=self.hparams["label_smoothing"], target_threshold=target_threshold
        )
        self.label_name = "bce"

    def labels_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The label term of one head's float ``logits`` (indices or probabilities as labels)."""
        if self.label_loss is not None:
            return self.label_loss(logits, labels)
        return F.cross_entropy(logits, labels, label_smoothing=self.hparams["label_smoothing"])

    def label_term(self, x: DistillInputs) -> torch.Tensor:
        """Cross-entropy (or ``--bce-loss``'s binary cross-entropy) of the student on the labels."""
        return self.labels_loss(x.student_logits.float(), x.labels)

    def distill(self, x: DistillInputs) -> Tuple[Optional[torch.Tensor], Dict[str, torch.Tensor]]:  # pragma: no cover
        """(the weighted distillation part added to the label term, or None; the named terms to log)."""
        raise NotImplementedError

    def forward(self, x: DistillInputs) -> Dict[str, torch.Tensor]:
        part, terms = self.distill(x)
        ce = self.label_term(x)
        task = self.hparams["ce_weight"] * ce
        total = task if part is None else task + part
        if self.split_parts and part is not None:
            return {"loss": total, self.label_name: ce, **terms, TASK_PART: task, DISTILL_PART: part}
        return {"loss": total, self.label_name: ce, **terms}


class TwoViewLoss(DistillLoss):
    """Base of the methods on a weak and a strong view of each sample (their cards' ``views = 2``: the
    loaders make the strong view, :mod:`kd.data.views`; the student and the teacher forward both). The
    label term is the cross-entropy of both views, summed, as the official trainers of MLKD and CRLD sum it."""

    def label_term(self, x: DistillInputs) -> torch.Tensor:
        assert x.second_student_logits is not None  # a views = 2 method always gets the second view
        weak = self.labels_loss(float32_or_wider(x.student_logits), x.labels)
        return weak + self.labels_loss(float32_or_wider(x.second_student_logits), x.labels)
