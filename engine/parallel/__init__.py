"""Tensor parallelism inside one pod (docs/tensor_parallel.md): the rank
group (`group.TPGroup`), how a model's weights split across its ranks
(`shard.ShardLayout`), and the processes that run the ranks in lockstep."""
