"""Which nodes Slurm may start a pending job on: its partitions, ``--nodelist``, ``--exclude``,
``--constraint`` and reservations.

The policy carves a job's instances on one node, and Slurm starts the job only on a node it may use.
Carved on another, the instances sat idle and the job waited until some other job happened to take
them: seen on the demo cluster, a ``mig:2g`` job with ``--exclude=n1,n2`` was carved on n1 and waited
(``ReqNodeNotAvail``) beside an idle n3, and so did jobs submitted to a partition without n1, and jobs
without a time limit while a maintenance reservation was to start on n1 within the hour.

What is read here is what Slurm's own answer says (squeue, sinfo, ``scontrol show reservation``), so a
rule it applies that is not modelled (a constraint with counts, a reservation's user list) leaves the
job unrestricted, as before: never a job kept from a node Slurm would start it on for a rule slurm-mig
guessed.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Iterable

from slurm_mig.slurm.parsers import SlurmJob, SlurmNode, SlurmReservation

_TOKEN = re.compile(r"\s*(?:([A-Za-z0-9_.:\-]+)|([&|()\[\]]))")


def feature_matcher(expr: str) -> Callable[[frozenset[str]], bool] | None:
    """A test of a node's features for a ``--constraint`` expression; None for an empty one, or one
    this does not read (counts ``a*2``, ``!a``, ``&`` and ``|`` mixed without brackets): unrestricted.

    Reads names joined by ``&`` (all of them) or ``|`` (any), with ``( )`` or ``[ ]`` around groups
    (``[a|b]``, Slurm's matching OR, is "any" for a one-node job)."""
    expr = (expr or "").strip()
    if not expr:
        return None
    tokens: list[str] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None or m.end() == pos:
            return None
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    at = 0

    def group(close: str | None):
        nonlocal at
        terms, op = [], None
        while True:
            if at >= len(tokens):
                return None
            t = tokens[at]
            at += 1
            if t in ("(", "["):
                sub = group(")" if t == "(" else "]")
                if sub is None:
                    return None
                terms.append(sub)
            elif t in "&|)]":
                return None
            else:
                terms.append(lambda f, name=t: name in f)
            if at >= len(tokens):
                if close is not None:
                    return None
                break
            t = tokens[at]
            at += 1
            if t == close:
                break
            if t not in ("&", "|") or (op is not None and t != op):
                return None
            op = t
        if op == "|":
            return lambda f: any(term(f) for term in terms)
        return lambda f: all(term(f) for term in terms)

    test = group(None)
    return test if test is not None and at == len(tokens) else None


def eligible_nodes(job: SlurmJob, nodes: Iterable[SlurmNode], reservations: Iterable[SlurmReservation],
                   now: float, *, cpus_fit: bool = True) -> tuple[str, ...] | None:
    """The nodes (sorted names) Slurm may start ``job`` on now, or None when nothing restricts it.

    * its partitions ("a,b": either), when sinfo says which partitions each node is in;
    * ``--nodelist`` and ``--exclude``;
    * ``--constraint``, matched against each node's active features (see :func:`feature_matcher`);
    * ``--reservation``: that reservation's nodes (unless it is FLEX); with a list (``a,b``), any of theirs;
    * every other reservation's nodes while it is active, or if it starts before the job's time limit
      would end (a job without a limit never fits before one; one holding only some of its nodes' cores
      leaves them usable), as Slurm's backfill does. MAGNETIC
      reservations, which take jobs that did not ask for them, are left out;
    * with ``cpus_fit`` (``[controller] cpu_full_nodes_wait``), nodes with fewer free CPUs than the job
      asks for (``-c``, ``-n``), or any allocated CPU for an ``--exclusive`` job: Slurm starts it on none
      of them until CPUs free (a necessary condition only: whole cores and memory are not counted, so
      a node kept is not sure to fit; the CPUs of this tick's other jobs are counted by the policy,
      from PendingJob.cpus and ClusterState.free_cpus).
    """
    nodes = list(nodes)
    names = {n.name for n in nodes}
    allowed = set(names)
    parts = {p.strip() for p in (job.partition or "").split(",") if p.strip()}
    # Only partitions sinfo lists restrict: one it does not show (a hidden partition, as seen by a user
    # other than root or SlurmUser) says nothing of its nodes, and reading it as "no node" would keep the
    # job waiting for good.
    if parts & {p for n in nodes for p in n.partitions}:
        allowed = {n.name for n in nodes if parts & set(n.partitions)}
    if job.required_nodes:
        allowed &= set(job.required_nodes)
    allowed -= set(job.excluded_nodes)
    match = feature_matcher(job.features)
    if match is not None:
        features = {n.name: n.features for n in nodes}
        allowed = {n for n in allowed if match(features.get(n, frozenset()))}
    limit = job.time_limit_min
    end = now + limit * 60.0 if limit else math.inf
    # --reservation=a,b (Slurm 23.02+): the job may use any of them, and squeue lists them all.
    asked = {name.strip() for name in (job.reservation or "").split(",") if name.strip()}
    own = [r for r in reservations if r.name in asked]
    if own and all(r.nodes and "FLEX" not in r.flags for r in own):
        allowed &= frozenset().union(*(r.nodes for r in own))
    cpus = {n.name: n.cpus for n in nodes}
    for r in reservations:
        if r.name not in asked and "MAGNETIC" not in r.flags and r.end > now and (r.active or r.start < end) \
                and not _some_cores(r, cpus):
            allowed -= r.nodes
    if cpus_fit and (job.cpus or job.exclusive):
        for n in nodes:
            if n.name in allowed and n.cpus is not None and n.alloc_cpus is not None and (
                    n.cpus - n.alloc_cpus < (job.cpus or 1) or (job.exclusive and n.alloc_cpus > 0)):
                allowed.discard(n.name)
    if allowed == names:
        return None
    return tuple(sorted(allowed))


def _some_cores(r: SlurmReservation, cpus: dict[str, int | None]) -> bool:
    """Whether ``r`` holds only some cores of its nodes (``CoreCnt=`` at creation): Slurm keeps other jobs
    off those cores, not off the nodes (reservation.c job_test_resv: "reservation %s uses partial nodes")."""
    total = [cpus.get(n) for n in r.nodes]
    return r.cpus is not None and bool(total) and all(total) and r.cpus < sum(total)
