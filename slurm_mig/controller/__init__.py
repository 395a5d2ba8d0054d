"""The controller on the Slurm head node: sync with Slurm, ask the policy, serve the node hooks."""
