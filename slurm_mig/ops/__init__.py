"""Operator tools: the data behind `slurm-mig status|jobs|nodes|decisions|explain` and the `top` dashboard.

* :mod:`slurm_mig.ops.views`: pure functions that read the controller's state database and build
  plain, JSON-ready dicts (what status, jobs, nodes and decisions print with ``--json``);
* :mod:`slurm_mig.ops.explain`: the same for ``explain`` (a job's decisions, options, timeline, verdict);
* :mod:`slurm_mig.ops.fmt`: the values' formatting (durations, clock times, exit statuses, ``--json``);
* :mod:`slurm_mig.ops.render`: text rendering of those views (GPU slice bars, tables, the timeline);
* :mod:`slurm_mig.ops.top`: the rich Live dashboard;
* :mod:`slurm_mig.ops.cli`: the subcommands.

Everything here only reads: the database is opened read-only, so the tools are safe to run next
to the controller, and by a user who may only read the file (``[controller].db_group``).
"""
