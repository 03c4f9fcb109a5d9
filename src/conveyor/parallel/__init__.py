"""Tensor parallelism's processes over torch.distributed: rank 0's launcher and watchdog
(launch.py), the worker (worker.py); the slices and collectives they use are the model's
(conveyor.model.distributed)."""
