"""Node side of slurm-mig: the Slurm hooks, the local binding cache and the outbox."""
