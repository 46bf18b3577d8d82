"""Sharded data parallelism: the FSDP2 strategy, the memory plan that chooses it, sharded state, checkpoint export."""
