"""Tensor parallelism (the paper's section 4.6): one scheduler and one block table on rank 0, the model split by
heads across ``tensor_parallel_size`` processes, each holding its heads' slice of every KV block."""
