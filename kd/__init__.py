"""kd: knowledge distillation for image classification at ImageNet scale.

``kd.train(config)`` runs a training (a :class:`kd.config.RunConfig`, or a dict of options);
the ``kd`` command line is a thin layer over it.
"""

from kd.version import __version__

__all__ = ["__version__", "train"]


def train(config, resume=None, overwrite=False):
    """Train with ``config`` (RunConfig or dict of options); returns the last epoch's metrics."""
    from kd import config as kd_config
    from kd.run.launch import train as _train
    from kd.siblings import own

    own("backends")  # which the run imports: another package's is one line here

    if isinstance(config, dict):
        config = kd_config.resolve(options=config)
    else:
        config = kd_config.validate(config)
    return _train(config, resume=resume, overwrite=overwrite)
