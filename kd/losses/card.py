"""What a KD method is, read without importing torch: its :class:`MethodCard` (what it needs from a run,
how papers print its name), and :class:`Methods`, the registry that holds each method's card beside its class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

from kd.registry import Registry


@dataclass(frozen=True)
class MethodCard:
    """What a KD method is: how papers print its name, and what it needs from a run, which the run
    provides (the engine, the teacher source and the loaders read it; the config refuses options that
    cannot give it). A method's class carries its card as ``card`` (:meth:`Methods.get`); the
    behaviour behind each need is its class's hooks (:class:`kd.losses.base.DistillLoss`)."""

    #: the method's name as papers print it (``kd report --format``'s rows)
    title: str = ""
    #: reads the teacher's logits (live, or from a store: ``--soft-labels``); ``ce`` alone does not
    needs_teacher: bool = True
    #: reads intermediate features: the engine taps the layers of ``--feature-layers`` (or the method's
    #: ``default_layers``) on both sides and calls ``setup_features`` with their shapes; never from a store
    uses_features: bool = False
    #: where the engine taps each stage: ``output``, or ``pre_relu`` (before the stage's final ReLU);
    #: a method may choose per side (``side_tap_point``)
    tap_point: str = "output"
    #: the pooled feature (the classifier's input, (N, C)) is the last entry of both feature dicts
    uses_pooled: bool = False
    #: ``setup_teacher`` gets the teacher's BatchNorm before each tapped stage's ReLU (OFD's margins)
    reads_teacher_norms: bool = False
    #: reads each side's final feature map and classifier (``setup_classifiers``; the student's own at
    #: each step): SDD
    uses_classifier: bool = False
    #: reads each sample's index in the training set (``setup_samples``, ``after_step``): a memory keyed
    #: by sample, so a mixed image (two samples) is refused
    uses_samples: bool = False
    #: 2: reads a second, strongly augmented view of each sample (the loaders make it, both sides forward
    #: it), which a store does not hold
    views: int = 1
    #: reads the distillation head of a student with a distillation token apart from its class head (DeiT)
    reads_distill_head: bool = False
    #: reads each sample's target class from the labels (DKD's, NKD's split): mixup's and cutmix's soft
    #: targets have none, so they are refused, unless ``class_of_mixed``
    class_labels: bool = False
    #: under mixup and cutmix, takes a mixed sample's target class as the larger part of its mixed target
    #: (its argmax), as the method's official code does with mixed targets (cls_KD's NKD)
    class_of_mixed: bool = False
    #: reads the training progress in epochs (a warm-up ramp, a curriculum), handed as the epochs completed
    #: (an int); a method that does not is not handed it, so its compiled step does not depend on it
    reads_progress: bool = False
    #: reads the optimizer step it trains (CRD's draw of negatives); likewise handed only where read
    reads_step: bool = False


class Methods(Registry):
    """The KD methods by name (``--kd-loss NAME``): each one's class, imported when first got, and its
    card, read without importing it. The order in which they are added is the order of the rows of the
    papers' tables (``kd report --format``)."""

    def __init__(self) -> None:
        super().__init__("KD loss")
        self._cards: Dict[str, MethodCard] = {}

    def add(self, name: str, target: str, card: MethodCard) -> None:
        """The method ``name``: its :class:`kd.losses.base.DistillLoss` subclass at ``target``
        (``package.module:Class``) and its card."""
        self.register_lazy(name, target)
        self._cards[name] = card

    def card(self, name: str) -> MethodCard:
        """The card of the method ``name`` (of one registered otherwise, as its class declares it); a KDError
        naming the near names where there is no such method."""
        name = self.check(name)
        return self._cards[name] if name in self._cards else self.get(name).card

    def get(self, name: str):
        """The class of the method ``name``, imported where it was not yet, with its card as ``card``."""
        cls = super().get(name)
        if name in self._cards:
            cls.card = self._cards[name]
        return cls

    def in_table_order(self) -> List[str]:
        """The methods' names in the order of the rows of the papers' tables."""
        return list(self._cards)
