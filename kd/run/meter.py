"""Loss and counter sums kept on the device, read only when reduced; the epoch line of the log, and
the line that says a run is not learning."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch


class Meter:
    """Sums of the loss parts and counters, kept on the device and read only when reduced."""

    def __init__(self, device: torch.device):
        self.device = device
        self.streak = torch.zeros((), device=device)
        self.sources = torch.zeros((), device=device)  # non-finite flags seen during the current streak
        self.next_epoch()

    def next_epoch(self) -> None:
        """Sums and counters from zero; a non-finite streak and its sources span epochs."""
        self.sums: Dict[str, torch.Tensor] = {}
        self.count = torch.zeros((), device=self.device)  # images
        self.finite = torch.zeros((), device=self.device)  # images of steps with a finite loss: the means' weight
        self.skipped = torch.zeros((), device=self.device)
        self.worst = torch.zeros((), device=self.device)
        self.wait = 0.0

    def add(
        self,
        parts: Dict[str, torch.Tensor],
        n: int,
        skipped: Optional[torch.Tensor],
        flags: Optional[torch.Tensor] = None,
    ) -> None:
        """One step: its loss parts (0-dim), images, skipped flag and non-finite flags (a
        :class:`kd.run.step.StepOutput`'s, whose ``skipped`` and ``flags`` may be None). Unreadable files
        are counted by the loop, once each (:meth:`kd.run.loop.Trainer.after_step`)."""
        finite = torch.isfinite(parts["loss"].detach())
        for k, v in parts.items():  # the means are over the steps with a finite loss
            self.sums[k] = self.sums.get(k, 0.0) + torch.where(finite, v.detach() * n, 0.0)
        self.count += n
        self.finite += finite * n
        good = finite  # a step counts against --max-nonfinite-steps if its loss was not finite or it was skipped
        if skipped is not None:
            self.skipped += skipped.float()
            good = finite & ~skipped
        self.streak = torch.where(good, torch.zeros_like(self.streak), self.streak + 1)
        self.worst = torch.maximum(self.worst, self.streak)
        if flags is not None:
            if self.sources.shape != flags.shape:  # the first step (or a checkpoint of an older kd)
                self.sources = torch.zeros_like(flags)
            self.sources = torch.where(good, torch.zeros_like(flags), torch.maximum(self.sources, flags))

    def reduce(self, backend, extra=()) -> Dict[str, Any]:
        """Means of the parts over every process, and summed counters (one collective); with ``extra``,
        their sums as a list under ``"_extra"``."""
        keys = sorted(self.sums)
        tail = [self.count, self.finite, self.skipped]
        tail += [torch.as_tensor(x, dtype=torch.float32, device=self.device) for x in extra]
        vec = torch.stack([self.sums[k] for k in keys] + tail)
        backend.all_reduce_sum(vec)
        values = vec.tolist()
        count, finite, skipped = values[len(keys) : len(keys) + 3]
        out = {k: values[i] / finite if finite else float("nan") for i, k in enumerate(keys)}
        out.update(images=count, skipped_steps=skipped)
        if extra:
            out["_extra"] = values[len(keys) + 3 :]
        return out

    def global_state(self, backend) -> dict:
        """:meth:`state_dict` with the sums and counters added up over every process (a collective)."""
        keys = sorted(self.sums)
        vec = torch.stack([self.sums[k] for k in keys] + [self.count, self.finite, self.skipped])
        backend.all_reduce_sum(vec)
        state = self.state_dict()
        state["sums"] = {k: vec[i].cpu() for i, k in enumerate(keys)}
        state["count"], state["finite"], state["skipped"] = (vec[len(keys) + i].cpu() for i in range(3))
        return state

    def state_dict(self) -> dict:
        return {
            "sums": {k: v.cpu() for k, v in self.sums.items()},
            "count": self.count.cpu(),
            "finite": self.finite.cpu(),
            "skipped": self.skipped.cpu(),
            "streak": self.streak.cpu(),
            "worst": self.worst.cpu(),
            "sources": self.sources.cpu(),
            "wait": self.wait,
        }

    def load_state_dict(self, state: dict) -> None:
        self.sums = {k: v.to(self.device) for k, v in state["sums"].items()}
        self.count = state["count"].to(self.device)
        self.finite = state.get("finite", state["count"]).to(self.device)
        self.sources = state.get("sources", torch.zeros(())).to(self.device)
        self.skipped = state["skipped"].to(self.device)
        self.streak = state["streak"].to(self.device)
        self.worst = state["worst"].to(self.device)
        self.wait = state["wait"]


def nonfinite_flags(
    parts: Dict[str, torch.Tensor],
    t_logits: Optional[torch.Tensor],
    terms: List[str],
    buffers_finite: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """1 for each source (the teacher's logits, the student's, each loss term of ``terms``, the
    student's buffers) not finite in this step, on the device; takes the student's logits sum
    (``LOGITS_SUM``) out of ``parts``. The engine appends one more: skipped on the gradients alone."""
    from kd.run.step import LOGITS_SUM

    student = parts.pop(LOGITS_SUM)
    zero = torch.zeros((), device=student.device)
    teacher = t_logits.sum() if t_logits is not None else zero
    flags = (~torch.isfinite(torch.stack([teacher, student, *[parts[k] for k in terms]]))).float()
    buffers = (~buffers_finite).float() if buffers_finite is not None else zero
    return torch.cat([flags, buffers.reshape(1)])


GRADIENTS = "the gradients (with a finite loss)"


def val_count(record: Dict[str, Any]) -> str:
    """`` (20 images, 2 unreadable)``: what a record's accuracy is over ("" where it has no count)."""
    if "val_images" not in record:
        return ""
    return f" ({record['val_images']:.0f} images, {record.get('val_unreadable', 0):.0f} unreadable)"


def format_record(record: Dict[str, float], epochs: int) -> str:
    parts = [f"epoch {record['epoch']}/{epochs}", f"loss {record.get('train_loss', float('nan')):.4f}"]
    if "val_top1" in record:
        parts.append(f"val top-1 {record['val_top1']:.2f} top-5 {record['val_top5']:.2f}{val_count(record)}")
    if "val_top1_ema" in record:
        parts.append(f"ema top-1 {record['val_top1_ema']:.2f} top-5 {record['val_top5_ema']:.2f}")
    parts.append(f"{record['img_per_s']:.0f} img/s")
    parts.append(f"{record['seconds']:.1f}s")
    return " | ".join(parts)


def nonfinite_message(
    how_long: str,
    hits: List[float],
    loss_terms: List[str],
    epoch: int,
    step: int,
    teacher: Optional[Tuple[str, str]],
    last: Path,
) -> str:
    """The error for a run whose loss stayed non-finite: which sources were (``hits``, in the order of
    the teacher's logits, the student's, then ``loss_terms``), and what to do. ``teacher`` is its
    (name, dtype) or None."""
    names = ["the teacher's logits", "the student's logits"] + [f"the loss term {k!r}" for k in loss_terms]
    names += ["the student's BatchNorm statistics", GRADIENTS]
    found = [name for name, hit in zip(names, hits) if hit > 0]
    if found and found[0] == "the teacher's logits" and teacher:
        hint = (
            f"the teacher {teacher[0]} runs in {teacher[1]}: try --teacher-precision float32, "
            "and check --teacher-weights"
        )
    elif found == [GRADIENTS]:
        hint = (
            "a loss whose value is finite gave non-finite gradients (a norm or standard deviation at zero, "
            "say): check the method's hyper-parameters (--loss-arg), lower --lr, or try --amp-dtype bfloat16"
        )
    elif found and found[0] == "the student's logits":
        hint = "lower --lr, add --warmup-epochs or --grad-clip, or use --opt O0 or --amp-dtype bfloat16"
    else:
        hint = "check the method's hyper-parameters (--loss-arg) and lower --lr"
    source = f"{' and '.join(found)} {'was' if len(found) == 1 else 'were'} not finite" if found else "source unknown"
    kept = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint was written"
    what = "the gradients were" if found == [GRADIENTS] else "the loss was"
    return (
        f"{what} not finite {how_long} (epoch {epoch}, step {step}): {source}; "
        f"those steps were skipped and the run stopped, {kept}; {hint}"
    )


class LearningWatch:
    """Says once, while a run trains, that its training cross-entropy shows it is not learning: still
    at chance (log C, with val top-1 near chance) after two epochs, or far above chance (the steps
    too large: MLKD at KD's lr reached 16.6 on a small folder), with what to try."""

    #: a cross-entropy this many times log C is far above chance (a fresh network starts at log C)
    FAR_ABOVE = 3.0
    #: at chance: a cross-entropy above this share of log C, and val top-1 below this many times 100/C
    STILL, NEAR_CHANCE = 0.95, 1.5

    def __init__(self, classes: int, cfg: Any):
        self.chance = math.log(classes) if classes > 1 else 0.0
        self.classes = classes
        self.lr = cfg.lr
        self.cfg = cfg  # what the run already does is not advised again
        self.said = False

    def _try(self, *options: Tuple[str, str, Any]) -> str:
        """``--flag value`` for each (flag, config key, value) the run does not already have."""
        missing = [(flag, v) for flag, key, v in options if getattr(self.cfg, key, None) != v]
        return " ".join(f"{flag} {v:g}" if isinstance(v, float) else f"{flag} {v}" for flag, v in missing)

    def see(self, record: Dict[str, Any]) -> Optional[str]:
        """The line to print after the epoch of ``record`` (a metrics.jsonl record), or None."""
        if "train_bce" in record:  # --bce-loss: no softmax cross-entropy to hold against log C
            return None
        ce = record.get("train_ce", record.get("train_loss"))
        if self.said or not self.chance or ce is None or not math.isfinite(ce):
            return None
        at = f"training cross-entropy {ce:.2f} after {record['epoch']} epoch(s)"
        chance = f"chance is log {self.classes} = {self.chance:.2f}"
        if ce > self.FAR_ABOVE * self.chance:
            self.said = True
            steadier = self._try(("--warmup-epochs", "warmup_epochs", 1.0), ("--grad-clip", "grad_clip", 5.0))
            return (
                f"not learning: {at}, far above where it started ({chance}): the steps are too large; "
                f"try --lr {self.lr / 10:g} (a tenth){', or ' + steadier if steadier else ''}"
            )
        top1 = record.get("val_top1")
        near = top1 is None or top1 <= self.NEAR_CHANCE * 100.0 / self.classes
        if record["epoch"] >= 2 and ce >= self.STILL * self.chance and near:
            self.said = True
            shown = f", val top-1 {top1:.2f}" if top1 is not None else ""
            rest = self._try(
                ("--lr-schedule", "lr_schedule", "cosine"),
                ("--warmup-epochs", "warmup_epochs", 1.0),
                ("--min-crop-scale", "min_crop_scale", 0.25),
            )
            return (
                f"not learning: {at} is still at chance ({chance}){shown}; on a small folder try "
                f"--lr {self.lr / 2:g}{' ' + rest if rest else ''}"
            )
        return None
