"""Tensor parallelism (``serve --tensor-parallel N``): one model split over N processes.

Megatron-style: attention heads with their key/value heads, GDN key heads with their value heads,
and the MLP are split across ranks (column-parallel in, row-parallel out, one all-reduce per
block), the embedding and the head by vocabulary rows. Each rank's state pool holds its own heads'
state, so snapshots and rollbacks stay per rank. Rank 0 runs the scheduler, sampling and the
drafter, and sends each step (and each rollback and snapshot copy) to the other ranks, which run
it in lockstep. NCCL on GPUs, gloo on CPUs.

This package knows no model family: ``group.py``, the group and its collectives; ``peers.py``,
rank 0's calls to the others; ``worker.py``, the loop of ranks > 0; ``snapshots.py``,
prompt-cache snapshots across ranks; ``launch.py``, starting the group and loading the shards. A
family that splits (:attr:`~headstart.models.contract.ModelFamily.split`) says how: Qwen3.5's
``models/qwen35/shard.py`` (which part of each checkpoint tensor a rank keeps) and
``models/qwen35/parallel.py`` (the rank's model and its collectives).
"""
