"""Tensor parallelism's primitives, as the model uses them: which slice of each weight a rank
holds and the vocabulary-parallel embedding (sharding.py); the torch.distributed group, its
collectives and rank 0's step messages (group.py). The processes themselves (rank 0's
launcher, the workers' loop) are conveyor.parallel's."""
