"""slurm-mig: dynamic NVIDIA Multi-Instance GPU partitioning for Slurm."""

__version__ = "0.1.0"
