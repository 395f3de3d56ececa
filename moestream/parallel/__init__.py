"""Tensor parallelism (`--tp-size N`): one process per rank, the same forward in lockstep.

cores    disjoint CPU core sets per rank, pinning (CPU expert threads must not share cores)
group    a rank's process groups and collectives; the hooks Engine calls to build its shard
shard    the model sharded in place: heads, MLP widths and vocab split, row-parallel all-reduces
experts  routed experts split by intermediate dimension (why: see its docstring), sliced at load
launch   spawn and drive the ranks: rank 0 schedules, samples and broadcasts each step

Sizes are checked before any process starts (`validate_tp`): every sharded width must divide by N,
each rank needs its own GPU (CUDA) and its own cores.
"""
from .launch import TPEngine, TPWorkers, exit_with_group, validate_tp

__all__ = ["TPEngine", "TPWorkers", "exit_with_group", "validate_tp"]
