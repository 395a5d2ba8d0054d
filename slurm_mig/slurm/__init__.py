"""Everything that talks to Slurm.

* :mod:`.runner` - the one way Slurm commands run (argv lists, timeouts, SLURM_CONF) and SlurmClient.
* :mod:`.parsers` - pure parsers of squeue/sinfo JSON and scontrol text (22.05 and later shapes).
* :mod:`.gres` - MIG GRES type names (1g 1gme 1gdm 2g 2gme 3g 4g 7g) and Gres string helpers.
* :mod:`.localcluster` - a real slurmctld/slurmd/munged cluster on this machine for tests and demos.
* :mod:`.cli` - ``slurm-mig cluster up|down|status``.

The Slurm-side pieces live in etc/: job_submit.lua and slurm.conf.snippet.
"""
