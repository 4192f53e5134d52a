"""A tiny student whose step draws random masks (``timm:kd_drop_net``), and the options of a run of it
teaching itself on the CPU: for tests that hold runs bit for bit equal to each other."""

from __future__ import annotations

import timm
from timm.models import register_model
from torch import nn


class DropNet(nn.Module):
    """A BatchNorm, a global pool (SDD reads its input) and a dropout before the linear classifier:
    a student whose step draws random masks, as real ones do."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.global_pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Sequential(nn.Dropout(0.3), nn.Linear(8, num_classes))

    def get_classifier(self) -> nn.Module:
        return self.fc

    def forward(self, x):
        return self.fc(self.global_pool(self.body(x)))


if "kd_drop_net" not in timm.list_models():

    @register_model
    def kd_drop_net(pretrained=False, num_classes=10, **kwargs):
        return DropNet(num_classes)


#: :class:`DropNet` teaching itself (random weights), 16 px, batch 4, three steps and one val batch of one epoch
DROP_RUN = dict(
    image_size=16,
    batch_size=4,
    workers=0,
    lr=0.05,
    device="cpu",
    log_every=1,
    seed=5,
    epochs=1,
    limit_train_batches=3,
    limit_val_batches=1,
    progress_bar=False,
    teacher="timm:kd_drop_net",
    teacher_weights="none",
    student="timm:kd_drop_net",
)
