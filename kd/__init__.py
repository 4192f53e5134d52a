"""kd: knowledge distillation for image classification at ImageNet scale.

``kd.train(config)`` runs a training (a :class:`kd.config.RunConfig`, or a dict of options);
the ``kd`` command line is a thin layer over it.
"""

from kd.version import __version__

__all__ = ["__version__", "train"]


def train(config, resume=None, overwrite=False):
    """Train with ``config``; returns the main process's last epoch's metrics (empty where a resumed
    run had trained its epochs already).

    ``config``: a dict of ``kd train``'s options (as the command line resolves them: a comma list
    of methods trains several students; ``resume`` continues ``out``'s run, with the options
    applied to its saved config), or a :class:`kd.config.RunConfig`, taken as it is. ``resume``:
    ``"last"`` (``--resume``) or a checkpoint's path."""
    from kd import config as kd_config
    from kd.errors import KDError
    from kd.run.jobs import TrainJob
    from kd.run.launch import train as launch
    from kd.run.students import Students, checkpoint_to_resume, for_command
    from kd.siblings import own

    own("backends")  # which the run imports: another package's is one line here
    if isinstance(config, dict):
        students = for_command([], config, [], resume, overwrite)
    else:
        if resume and overwrite:
            raise KDError("--resume and --overwrite contradict each other; give one")
        config = kd_config.validate(config)
        students = Students.alone(config, checkpoint_to_resume(config.out, resume) if resume else None)
    return launch(TrainJob(students), overwrite=overwrite) or {}
