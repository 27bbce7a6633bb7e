"""OneDeviceStrategy: the strategy API on a single device, run inline.

Source: tf.distribute.OneDeviceStrategy.
"""
from dtape.distribute import context
from dtape.distribute.distribute_lib import ReplicaContext, Strategy, StrategyExtended
from dtape.distribute.values import select_replica
from dtape.tensor import normalize_device


class OneDeviceStrategy(Strategy):
    """Places variables and computation on one device; `run` calls fn on the calling thread.

    Args:
      device: a device name, e.g. "cuda:0" or "cpu".
    """

    def __init__(self, device):
        super().__init__(StrategyExtended(self, (str(device),)))
        self._device = normalize_device(device)

    def _create_variable(self, next_creator, **kwargs):
        return next_creator(**dict(kwargs, device=kwargs.get("device") or self._device))

    def run(self, fn, args=(), kwargs=None):
        """Runs `fn(*args, **kwargs)` once, in this strategy's replica context; returns its result."""
        args, kwargs = select_replica(0, args), select_replica(0, kwargs or {})
        with self.scope(), context.enter_mode(self, ReplicaContext(self, 0)):
            return fn(*args, **kwargs)
