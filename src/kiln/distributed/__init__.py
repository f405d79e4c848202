"""Scale-out on torch.distributed: the process group and mesh (world.py), parallelism applied
to a plain model (parallelize.py) and the ``kiln launch`` wrapper over torchrun (launch.py)."""

from kiln.distributed.world import World, close_world, in_torchrun, init_world

__all__ = ["World", "close_world", "in_torchrun", "init_world"]
