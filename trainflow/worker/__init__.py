"""Worker processes: one per rank, launched by the node agent (or by raw torchrun)."""
