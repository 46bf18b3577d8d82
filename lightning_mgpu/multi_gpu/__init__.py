"""MultiGPUStrategy (one device, DataParallel, DDP or FSDP) and the strategy names registered with Lightning."""
