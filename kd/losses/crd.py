"""Tian et al. 2020, "Contrastive Representation Distillation" (ICLR), https://arxiv.org/abs/1910.10699."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from kd.errors import KDError
from kd.losses.base import DistillInputs, DistillLoss

#: added to the denominators of the contrast loss, as the official code does
EPS = 1e-7
_M32 = 0xFFFFFFFF


class Embed(nn.Module):
    """Linear projection of the pooled feature, then each row divided by its L2 norm (without an
    epsilon, as the official code: a zero row would give NaN, which a projected feature never is)."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.linear = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.linear(x.flatten(1))
        return v / v.pow(2).sum(1, keepdim=True).sqrt()


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 tensors (values kept below 2^32, so no product overflows)."""
    x = x & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def contrast_loss(scores: torch.Tensor, n_data: int) -> torch.Tensor:
    """The official NCE-style loss of (B, 1 + K) normalised scores, the positive first:
    ``-(sum log P/(P + K/N + eps) over positives + sum log (K/N)/(P + K/N + eps) over negatives) / B``."""
    k = scores.shape[1] - 1
    noise = k / n_data
    positive = torch.log(scores[:, 0] / (scores[:, 0] + noise + EPS))
    negative = torch.log(noise / (scores[:, 1:] + noise + EPS))
    return -(positive.sum() + negative.sum()) / scores.shape[0]


def momentum_rows(bank: torch.Tensor, v: torch.Tensor, momentum: float) -> torch.Tensor:
    """The official memory update of the rows ``bank`` with embeddings ``v``: ``m * bank + (1 - m) * v``,
    then each row divided by its L2 norm (no epsilon)."""
    mixed = bank * momentum + v * (1 - momentum)
    return mixed / mixed.pow(2).sum(1, keepdim=True).sqrt()


class CRD(DistillLoss):
    """CRD: ``ce_weight * CE + crd_weight * (contrast loss of the student's embedding against the
    teacher's memory + the teacher's against the student's)``.

    The pooled features (the classifiers' inputs) of both models are projected to ``feat_dim`` by
    an :class:`Embed` head each (trained with the student, dropped on export). Two memory banks of
    one unit row per training sample (``N x feat_dim``, float32, on the student's device; 2 x 1.28 M
    x 128 x 4 B = 1.3 GB on ImageNet) hold each sample's past embeddings; each step scores every
    sample's embedding against the other model's bank at its own row and at ``negatives`` rows of
    samples of other classes, drawn uniformly with replacement (the official ImageNet sampling),
    as ``exp(<v, row> / temperature) / Z``. ``Z`` is fixed from the first step's scores (their mean
    times N), and after each optimizer step the rows of the step's samples move to
    ``momentum * row + (1 - momentum) * v``, renormalised. Defaults are the official code's and
    mdistiller's (feature weight 0.8, 128 dimensions, 16,384 negatives, T 0.07, momentum 0.5).

    Several processes give what one process gives with the same global batch: the negatives of
    a sample are a function of the run's seed, the step and the sample's index (not of the process
    that holds it), ``Z`` is the mean over every process's scores, and each memory update applies
    every process's samples. The banks and ``Z`` are training state, kept in the checkpoint (as
    the loss's extra state, not buffers: torch DDP would broadcast buffers at every step).
    """

    defaults = {
        "ce_weight": 1.0,
        "crd_weight": 0.8,
        "feat_dim": 128,
        "negatives": 16384,
        "temperature": 0.07,
        "momentum": 0.5,
    }

    def __init__(self, num_classes: int, **hparams: Any):
        super().__init__(num_classes, **hparams)
        self.embed_student: Optional[Embed] = None
        self.embed_teacher: Optional[Embed] = None
        # one dict object, shared by DataParallel's replicas (they copy __dict__ shallowly):
        # the banks, Z, the class index and the embeddings of the step not yet written to the banks
        self.shared: Dict[str, Any] = {"memory": None, "z": None, "pending": []}
        self.gather: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
        self.seed = 0

    @classmethod
    def default_layers(cls, student_layers: List[str], teacher_layers: List[str]) -> List[str]:
        return []  # the pooled features only

    def setup_features(self, student_shapes: Dict[str, torch.Size], teacher_shapes: Dict[str, torch.Size]) -> None:
        if len(student_shapes) != 1 or len(teacher_shapes) != 1:
            raise KDError(
                "KD loss 'crd' distils the pooled features (the classifiers' inputs) only; leave out --feature-layers"
            )
        (s_shape,), (t_shape,) = student_shapes.values(), teacher_shapes.values()
        dim = int(self.hparams["feat_dim"])
        self.embed_student = Embed(math.prod(s_shape[1:]), dim)
        self.embed_teacher = Embed(math.prod(t_shape[1:]), dim)

    def setup_samples(
        self, labels: torch.Tensor, seed: int, gather: Callable[[torch.Tensor], torch.Tensor]
    ) -> Optional[str]:
        n = labels.numel()
        counts = torch.bincount(labels)
        if n == 0 or int(counts.max()) == n:
            raise KDError(
                "KD loss 'crd' contrasts samples of other classes: the training data needs two classes or more"
            )
        dim = int(self.hparams["feat_dim"])
        stdv = 1.0 / math.sqrt(dim / 3)
        generator = torch.Generator().manual_seed(seed)
        memory = torch.rand(2, n, dim, generator=generator).mul_(2 * stdv).sub_(stdv)  # the official init
        self.shared.update(
            memory=memory,  # [0]: the student's bank, [1]: the teacher's
            labels=labels,
            order=torch.argsort(labels, stable=True),  # sample indices grouped by class
            counts=counts,
            starts=torch.cumsum(counts, 0) - counts,
            # each draw's own key, hashed once here: written in the step, inductor's Triton code adds the
            # constant to a 32-bit index and fails to compile ("Scalar 2654435769 is out of range for type int32")
            draw_keys=_mix(torch.arange(int(self.hparams["negatives"])) + 0x9E3779B9),
        )
        self.seed = seed
        self.gather = gather
        k, fewest = int(self.hparams["negatives"]), n - int(counts.max())
        if k <= fewest:
            return None
        return (
            f"crd: {k:,} negatives a sample from {fewest:,} samples of other classes (the fewest of a class): "
            "drawn with replacement, so each recurs; --loss-arg negatives=N draws fewer"
        )

    @property
    def n_data(self) -> int:
        return int(self.shared["labels"].numel())

    def _on(self, device: torch.device) -> torch.device:
        """The device of the banks and class index: moved from the CPU to ``device`` at the first step,
        then kept there (DataParallel's replicas on other GPUs read from it)."""
        if self.shared["memory"].device.type == "cpu" and device.type != "cpu":
            # the memory last: a replica that finds it on the device reads the rest there
            for key in ("labels", "order", "counts", "starts", "draw_keys", "memory"):
                self.shared[key] = self.shared[key].to(device)
        return self.shared["memory"].device

    def contrast_indices(self, indices: torch.Tensor, step: int) -> torch.Tensor:
        """(B, 1 + negatives): each sample's own index, then indices of samples of other classes, drawn
        uniformly with replacement from a hash of (seed, step, sample index, draw)."""
        s = self.shared
        key = _mix(_mix(torch.tensor(self.seed) ^ _mix(torch.tensor(step))).to(indices.device) ^ indices)
        draws = _mix(_mix(key[:, None] ^ s["draw_keys"][None, :]))
        label = s["labels"][indices]
        others = (self.n_data - s["counts"][label])[:, None]
        r = draws % others  # a position among the samples of other classes, in class order
        start, count = s["starts"][label][:, None], s["counts"][label][:, None]
        r = r + torch.where(r >= start, count, torch.zeros_like(count))
        return torch.cat([indices[:, None], s["order"][r]], dim=1)

    def distill(self, x: DistillInputs):
        assert self.embed_student is not None and self.embed_teacher is not None, "setup_features comes first"
        if x.indices is None:
            raise KDError("KD loss 'crd' needs each sample's index in the training set")
        h = self.hparams
        (f_s,), (f_t,) = x.student_feats.values(), x.teacher_feats.values()
        with torch.autocast(f_s.device.type, enabled=False):
            dtype = self.embed_student.linear.weight.dtype  # float32 (float64 in tests)
            v_s = self.embed_student(f_s.to(dtype))
            v_t = self.embed_teacher(f_t.detach().to(dtype))
            home = self._on(v_s.device)
            memory = self.shared["memory"]
            contrast = self.contrast_indices(x.indices.to(home), x.step)
            # each embedding against the other model's bank (rows read before this step's update)
            rows_t, rows_s = memory[1][contrast].to(v_s.device), memory[0][contrast].to(v_s.device)
            out_s = torch.exp(torch.bmm(rows_t, v_s[:, :, None])[:, :, 0] / h["temperature"])
            out_t = torch.exp(torch.bmm(rows_s, v_t[:, :, None])[:, :, 0] / h["temperature"])
            z = self._normaliser(out_s.detach(), out_t.detach())
            s_loss = contrast_loss(out_s / z[0], self.n_data)
            t_loss = contrast_loss(out_t / z[1], self.n_data)
        self.shared["pending"].append((x.indices, v_s.detach(), v_t.detach()))
        crd = s_loss + t_loss
        return h["crd_weight"] * crd, {"crd": crd}

    def _normaliser(self, out_s: torch.Tensor, out_t: torch.Tensor) -> torch.Tensor:
        """(Z_s, Z_t): fixed at the first step, the mean score over every process's batch times N."""
        if self.shared["z"] is None:
            sums = torch.stack([out_s.sum(), out_t.sum(), torch.tensor(float(out_s.numel()), device=out_s.device)])
            total = self.gather(sums[None].double()).sum(0)
            self.shared["z"] = (total[:2] / total[2] * self.n_data).to(out_s.dtype)
        return self.shared["z"].to(out_s.device)

    def after_step(self) -> None:
        """This step's embeddings into the banks, every process's (rows of non-finite embeddings stay)."""
        pending, self.shared["pending"] = self.shared["pending"], []
        if not pending:
            return
        memory = self.shared["memory"]
        device = memory.device
        indices = torch.cat([p[0].to(device) for p in pending])
        v = torch.cat([torch.stack([p[1], p[2]]).to(device) for p in pending], dim=1)  # (2, B, D)
        indices = self.gather(indices)
        v = self.gather(v.transpose(0, 1).contiguous()).transpose(0, 1)
        with torch.no_grad():
            for bank in (0, 1):
                old = memory[bank][indices]
                new = momentum_rows(old, v[bank], self.hparams["momentum"])
                keep = torch.isfinite(new).all(1, keepdim=True)
                memory[bank].index_copy_(0, indices, torch.where(keep, new, old))

    def get_extra_state(self) -> torch.Tensor:
        """The banks and Z as one tensor of the banks' dtype (Z = -1 before the first step)."""
        memory = self.shared["memory"]
        if memory is None:
            return torch.zeros(0)
        z = self.shared["z"] if self.shared["z"] is not None else torch.full((2,), -1.0)
        return torch.cat([memory.reshape(-1), z.to(memory.device, memory.dtype)])

    def set_extra_state(self, state: torch.Tensor) -> None:
        memory = self.shared["memory"]
        if memory is None or state.numel() == 0:
            return
        if state.numel() != memory.numel() + 2:
            raise KDError(
                f"the checkpoint's CRD memory holds {(state.numel() - 2) // (2 * memory.shape[2])} samples, "
                f"this training set {memory.shape[1]}"
            )
        state = state.to(memory.device)
        memory.copy_(state[:-2].view_as(memory))
        self.shared["z"] = None if bool(state[-1] < 0) else state[-2:].clone()
