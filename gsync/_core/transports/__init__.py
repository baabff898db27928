"""The collectives behind gsync's public ones: NCCL in one process, torch.distributed process groups across processes."""
