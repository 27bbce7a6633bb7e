"""`tf.train`'s checkpoint names, so `tf.train.Checkpoint` ports as `dtape.train.Checkpoint`.

Names, not copies: `dtape.train.Checkpoint is dtape.checkpoint.Checkpoint`.
"""
from dtape.checkpoint import Checkpoint, latest_checkpoint
from dtape.checkpoint_management import CheckpointManager

__all__ = ["Checkpoint", "CheckpointManager", "latest_checkpoint"]
