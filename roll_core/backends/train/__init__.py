"""Train backends behind one interface, chosen by `actor_train.backend`."""

from roll_core.backends.train.base import TrainBackend
from roll_core.backends.train.torch_backend import TorchTrainBackend

TRAIN_BACKENDS: dict[str, type] = {"torch": TorchTrainBackend}
"""Backend name -> class. The schema's Literal keeps the names in step with this registry."""

__all__ = ["TRAIN_BACKENDS", "TorchTrainBackend", "TrainBackend"]
