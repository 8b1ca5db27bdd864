"""visiontune: fine-tune torchvision image classifiers on a folder of images,
on one CPU or many GPUs, with the same command.

Python API: ``visiontune.train(TrainConfig(data=..., ...)) -> summary dict``.
"""

from visiontune.config import TrainConfig, UserError

__version__ = "0.1.0"
__all__ = ["TrainConfig", "UserError", "train", "__version__"]


def train(config: TrainConfig) -> dict:
    """Run one training job in this process (see ``visiontune.trainer.train``)."""
    from visiontune.trainer import train as _train

    return _train(config)
