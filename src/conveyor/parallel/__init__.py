"""Tensor parallelism over torch.distributed: sharding rules (sharding.py), the group and its
step messages (group.py), rank 0's launcher and watchdog (launch.py), the worker (worker.py)."""
