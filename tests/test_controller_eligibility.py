"""Which nodes Slurm may start a pending job on (controller/eligibility.py), from the literal squeue,
sinfo and scontrol output captured on the demo cluster (tests/test_slurm_parsers.py)."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from slurm_mig.controller.eligibility import eligible_nodes, feature_matcher
from slurm_mig.slurm import parsers
from slurm_mig.slurm.parsers import SlurmJob, SlurmNode, SlurmReservation

from tests.test_slurm_parsers import SCONTROL_RES, SINFO_JSON_WHERE, SQUEUE_JSON_WHERE

NODES = parsers.parse_sinfo_json(json.loads(SINFO_JSON_WHERE))  # capacity, n1, n2, n3 (n3: "fast", in "other")
RES = parsers.parse_reservations(SCONTROL_RES)  # r1 active on n2; maint1 on n1 from r1's end
NOW = RES[0].start + 60


@pytest.mark.parametrize("expr, node, expect", [
    ("fast", {"fast"}, True),
    ("fast", {"slow"}, False),
    ("fast&nvlink", {"fast"}, False),
    ("fast&nvlink", {"fast", "nvlink"}, True),
    ("a100|h100", {"h100"}, True),
    ("a100|h100", {"v100"}, False),
    ("[a100|h100]", {"a100"}, True),
    ("ib&(a100|h100)", {"ib", "h100"}, True),
    ("ib&(a100|h100)", {"h100"}, False),
    ("gpu-80gb", {"gpu-80gb"}, True),
])
def test_constraint_expressions(expr, node, expect):
    match = feature_matcher(expr)
    assert match is not None and match(frozenset(node)) is expect


@pytest.mark.parametrize("expr", ["", "  ", "a*2", "[a*2&b*1]", "a&b|c", "!a", "a&", "(a|b", "a)", "a||b"])
def test_constraints_it_does_not_read_restrict_nothing(expr):
    assert feature_matcher(expr) is None


def test_jobs_from_the_demo_cluster():
    jobs = {j.job_id: j for j in parsers.parse_squeue_json(json.loads(SQUEUE_JSON_WHERE))}
    where = {i: eligible_nodes(j, NODES, RES, NOW) for i, j in jobs.items()}
    # --exclude=n1,n2, no time limit: n3 (and the placeholder, which has no GPU) -- not n2 (r1's either way)
    assert where[1] == ("capacity", "n3")
    # -C fast: the node with the feature active
    assert where[3] == ("n3",)
    # --reservation=r1 (and -w n2): r1's node, although maint1 would keep others off n1
    assert where[4] == ("n2",)
    # -p debug,other without a limit: not n1 (maint1 starts within any limit), not n2 (r1 holds it)
    assert where[5] == ("capacity", "n3")


def test_nothing_restricting_a_job_is_none():
    job = SlurmJob(job_id=9, state="PENDING", partition="debug", time_limit_min=30)
    assert eligible_nodes(job, NODES, [], NOW) is None
    # a 30-minute job ends before maint1 starts (50 minutes away); r1 still holds n2
    assert eligible_nodes(job, NODES, RES, NOW) == ("capacity", "n1", "n3")
    # a 2-hour one does not
    longer = SlurmJob(job_id=9, state="PENDING", partition="debug", time_limit_min=120)
    assert eligible_nodes(longer, NODES, RES, NOW) == ("capacity", "n3")


def test_partitions():
    job = SlurmJob(job_id=9, state="PENDING", partition="other", time_limit_min=30)
    assert eligible_nodes(job, NODES, [], NOW) == ("capacity", "n3")
    # a partition sinfo does not list (hidden from the controller's user) says nothing of its nodes
    unknown = SlurmJob(job_id=9, state="PENDING", partition="nosuch")
    assert eligible_nodes(unknown, NODES, [], NOW) is None
    assert eligible_nodes(SlurmJob(job_id=9, state="PENDING", partition="nosuch,other"), NODES, [], NOW) == \
        ("capacity", "n3")
    # nodes that do not say their partitions (an older sinfo): partitions restrict nothing
    bare = [SlurmNode(name=n.name, state="idle") for n in NODES]
    assert eligible_nodes(job, bare, [], NOW) is None


def test_reservation_flags_and_ends():
    job = SlurmJob(job_id=9, state="PENDING", partition="debug")
    magnetic = SlurmReservation("m", NOW - 60, NOW + 3600, frozenset({"n1"}), frozenset({"MAGNETIC"}), True)
    ended = SlurmReservation("old", NOW - 7200, NOW - 3600, frozenset({"n1"}), frozenset(), True)
    assert eligible_nodes(job, NODES, [magnetic, ended], NOW) is None
    flex = SlurmReservation("f", NOW - 60, NOW + 3600, frozenset({"n2"}), frozenset({"FLEX"}), True)
    inside = SlurmJob(job_id=9, state="PENDING", partition="debug", reservation="f")
    assert eligible_nodes(inside, NODES, [flex], NOW) is None  # FLEX: its nodes and any other
    strict = SlurmReservation("f", NOW - 60, NOW + 3600, frozenset({"n2"}), frozenset(), True)
    assert eligible_nodes(inside, NODES, [strict], NOW) == ("n2",)
    # a reservation that is not in Slurm's answer (deleted since): nothing to hold the job to
    assert eligible_nodes(inside, NODES, [], NOW) is None


def test_a_job_asking_for_a_list_of_reservations_may_use_any_of_them():
    """sbatch --reservation=a,b (Slurm 23.02+): "If the job can use more than one reservation specify their
    names in a comma separate list ... All reservations will be listed in scontrol/squeue" (sbatch.html
    #OPT_reservation). Read as one name, neither matched, and both were taken from the job: it could run
    nowhere Slurm would start it."""
    ra = SlurmReservation("a", NOW - 60, NOW + 3600, frozenset({"n1"}), frozenset(), True)
    rb = SlurmReservation("b", NOW - 60, NOW + 3600, frozenset({"n2"}), frozenset(), True)
    job = SlurmJob(job_id=9, state="PENDING", partition="debug", reservation="a,b", time_limit_min=30)
    assert eligible_nodes(job, NODES, [ra, rb], NOW) == ("n1", "n2")
    # one of them FLEX: any node (outside other reservations)
    flex = SlurmReservation("b", NOW - 60, NOW + 3600, frozenset({"n2"}), frozenset({"FLEX"}), True)
    assert eligible_nodes(job, NODES, [ra, flex], NOW) is None
    # one name of the list unknown to Slurm's answer: the others still hold the job
    only = SlurmJob(job_id=9, state="PENDING", partition="debug", reservation="a,gone", time_limit_min=30)
    assert eligible_nodes(only, NODES, [ra, rb], NOW) == ("n1",)


def test_a_reservation_of_some_cores_leaves_its_nodes_to_other_jobs():
    """scontrol create reservation CoreCnt=2 Nodes=n1: Slurm's job_test_resv takes only the reserved cores
    from other jobs ("reservation %s uses partial nodes"), and only a reservation of whole nodes
    (RESV_CTLD_FULL_NODE) takes the nodes (src/slurmctld/reservation.c). Taking n1 kept jobs off it."""
    nodes = [replace(n, cpus=8) for n in NODES]
    job = SlurmJob(job_id=9, state="PENDING", partition="debug", time_limit_min=30)
    text = SCONTROL_RES.split("\n\n")[0]  # r1: active on n2, TRES=cpu=8 (all of n2's 8)
    assert parsers.parse_reservations(text)[0].cpus == 8
    assert eligible_nodes(job, nodes, parsers.parse_reservations(text), NOW) == ("capacity", "n1", "n3")
    cores = parsers.parse_reservations(text.replace("CoreCnt=8", "CoreCnt=2").replace("TRES=cpu=8", "TRES=cpu=2"))
    assert cores[0].cpus == 2
    assert eligible_nodes(job, nodes, cores, NOW) is None
    # node CPUs unknown: the whole node, as before
    assert eligible_nodes(job, NODES, cores, NOW) == ("capacity", "n1", "n3")


def test_a_node_without_the_cpus_a_job_asks_for_is_not_its():
    """On the demo cluster, -c 4, -n 2 -c 3 and --exclusive jobs were carved on n1 beside a -c 6 job
    (2 CPUs free) and waited for it to end while n2 idled."""
    from tests.test_slurm_parsers import SINFO_JSON_CPUS, SQUEUE_JSON_CPUS

    nodes = parsers.parse_sinfo_json(json.loads(SINFO_JSON_CPUS))
    jobs = {j.job_id: j for j in parsers.parse_squeue_json(json.loads(SQUEUE_JSON_CPUS))}
    assert [eligible_nodes(jobs[i], nodes, [], NOW) for i in (2, 3, 4)] == [("capacity", "n2")] * 3
    two = SlurmJob(job_id=9, state="PENDING", partition="debug", cpus=2)
    assert eligible_nodes(two, nodes, [], NOW) is None  # n1 has 2 free
    # a site whose GPU partitions oversubscribe CPUs turns it off ([controller] cpu_full_nodes_wait = false)
    assert eligible_nodes(jobs[2], nodes, [], NOW, cpus_fit=False) is None
    # CPUs unknown (an older sinfo): nothing to go by
    bare = [SlurmNode(name=n.name, state="idle", partitions=n.partitions) for n in nodes]
    assert eligible_nodes(jobs[4], bare, [], NOW) is None


BERLIN_0230_CEST = 1792888200  # 2026-10-25 02:30:00 CEST; the clock shows 02:30:00 again an hour later (CET)


@pytest.mark.parametrize("case", ["starts", "ends"])
def test_a_reservation_in_the_hour_the_clock_goes_back_is_never_shorter_than_it_may_be(monkeypatch, case):
    """scontrol prints a reservation's times in local time without a zone, and mktime read 02:30:00 on the night
    the clock goes back as either instant (glibc follows its previous call). maint1 starting at 02:30 was read
    an hour late, so a job whose 45 minutes from 02:00 CEST run into it was placed on its node; r1, active at
    the second 02:00 and ending at 02:30, was read as ended half an hour before, and its node given to jobs.
    Slurm keeps such jobs off those nodes. A reservation's start is read as the earlier instant, its end as
    the later."""
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        if case == "starts":
            text = ("ReservationName=maint1 StartTime=2026-10-25T02:30:00 EndTime=2026-10-25T05:00:00 "
                    "Nodes=n1 Flags=MAINT State=INACTIVE")
            now, prime = BERLIN_0230_CEST - 1800, "2026-12-01T12:00:00"  # 02:00 CEST; glibc's next guess: CET
        else:
            text = ("ReservationName=r1 StartTime=2026-10-25T01:00:00 EndTime=2026-10-25T02:30:00 "
                    "Nodes=n1 Flags=MAINT State=ACTIVE")
            now, prime = BERLIN_0230_CEST + 1800, "2026-07-01T12:00:00"  # 02:00 CET; glibc's next guess: CEST
        time.mktime(time.strptime(prime, "%Y-%m-%dT%H:%M:%S"))
        (r,) = parsers.parse_reservations(text)
        assert (r.start, r.end) == ((BERLIN_0230_CEST, 1792900800) if case == "starts"
                                    else (1792882800, BERLIN_0230_CEST + 3600))
        job = SlurmJob(job_id=9, state="PENDING", partition="debug", time_limit_min=45)
        assert "n1" not in eligible_nodes(job, NODES, [r], now)
    finally:
        monkeypatch.undo()
        time.tzset()
