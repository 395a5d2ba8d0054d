"""The controller's `gres` event ("n1: Slurm had ..., set ...") on `sinfo --json` answers captured from the demo
cluster (Slurm 22.05.8, 3 nodes x 2 simulated H100s; documents cut down to n1, nothing else changed).

Slurm really does change a node's counts behind slurm-mig's back: slurmctld asks every node to register now and
then (every 20th ping, SlurmdTimeout/3 apart: ~200 s on the demo cluster), and a registration puts slurm.conf's
mix back; so do a slurmd start, a slurmctld restart and `scontrol reconfigure`. slurmctld's log says nothing of
it at its default level and still shows the `gres set to` of slurm-mig's last update, which made such events
read as stale. The event says what Slurm last held as set, and when, and is stamped with the time Slurm's
answer was read, not the time the tick began (seconds earlier while slurmctld restarts).
"""

from __future__ import annotations

import json
import time

import pytest

from slurm_mig.config import Config
from slurm_mig.controller.service import Controller
from slurm_mig.slurm.gres import format_node_gres
from slurm_mig.slurm.parsers import parse_sinfo_json
from slurm_mig.store import open_store

# 16:43:26.880: n1 holds the counts slurm-mig set at 16:40:18 (GPU 0: 7g, GPU 1: 4g+2g+1g), padded to 14.
SINFO_SET = r"""{"meta":{"plugin":{"type":"openapi/v0.0.38","name":"Slurm OpenAPI v0.0.38"},"Slurm":{"version":{"major":22,"micro":8,"minor":5},"release":"22.05.8"}},"errors":[],"nodes":[{"architecture":"x86_64","burstbuffer_network_address":"","boards":1,"boot_time":1795707194,"comment":"","cores":8,"cpu_binding":0,"cpu_load":40,"extra":"","free_memory":23075,"cpus":8,"last_busy":1795711217,"features":"","active_features":"","gres":"mig:1g:1,mig:1gme:0,mig:1gdm:0,mig:2g:1,mig:2gme:0,mig:3g:0,mig:4g:1,mig:7g:1,mig:pad:10","gres_drained":"N/A","gres_used":"mig:1g:0,mig:1gme:0,mig:1gdm:0,mig:2g:0,mig:2gme:0,mig:3g:0,mig:4g:0,mig:7g:1,mig:pad:0","mcs_label":"","name":"n1","next_state_after_reboot":"invalid","address":"127.0.0.1","hostname":"localhost","state":"mixed","state_flags":[],"next_state_after_reboot_flags":[],"operating_system":"Linux 6.18.44-fc-v595 #1 SMP PREEMPT_DYNAMIC @0","owner":null,"partitions":["debug"],"port":17001,"real_memory":16000,"reason":"","reason_changed_at":0,"reason_set_by_user":null,"slurmd_start_time":1795711216,"sockets":1,"threads":1,"temporary_disk":0,"weight":1,"tres":"cpu=8,mem=16000M,billing=8","slurmd_version":"22.05.8","alloc_memory":0,"alloc_cpus":1,"idle_cpus":7,"tres_used":"cpu=1","tres_weighted":1.0}]}"""
# 16:43:27.877, no disturbance: slurmctld's log shows "Spawning registration agent for capacity,n[1-3] 4 hosts" at
# 16:43:27.638, and n1's mix is slurm.conf's again (1g:2,2g:2,3g:2, pad:8) beside the counts of 4g and 7g.
SINFO_REGISTERED = r"""{"meta":{"plugin":{"type":"openapi/v0.0.38","name":"Slurm OpenAPI v0.0.38"},"Slurm":{"version":{"major":22,"micro":8,"minor":5},"release":"22.05.8"}},"errors":[],"nodes":[{"architecture":"x86_64","burstbuffer_network_address":"","boards":1,"boot_time":1795707193,"comment":"","cores":8,"cpu_binding":0,"cpu_load":39,"extra":"","free_memory":23037,"cpus":8,"last_busy":1795711217,"features":"","active_features":"","gres":"mig:1g:2,mig:1gme:0,mig:1gdm:0,mig:2g:2,mig:2gme:0,mig:3g:2,mig:4g:1,mig:7g:1,mig:pad:8","gres_drained":"N/A","gres_used":"mig:1g:0,mig:1gme:0,mig:1gdm:0,mig:2g:0,mig:2gme:0,mig:3g:0,mig:4g:0,mig:7g:1,mig:pad:0","mcs_label":"","name":"n1","next_state_after_reboot":"invalid","address":"127.0.0.1","hostname":"localhost","state":"mixed","state_flags":[],"next_state_after_reboot_flags":[],"operating_system":"Linux 6.18.44-fc-v595 #1 SMP PREEMPT_DYNAMIC @0","owner":null,"partitions":["debug"],"port":17001,"real_memory":16000,"reason":"","reason_changed_at":0,"reason_set_by_user":null,"slurmd_start_time":1795711216,"sockets":1,"threads":1,"temporary_disk":0,"weight":1,"tres":"cpu=8,mem=16000M,billing=8","slurmd_version":"22.05.8","alloc_memory":0,"alloc_cpus":1,"idle_cpus":7,"tres_used":"cpu=1","tres_weighted":1.0}]}"""

GPUS = [{"gpu": i, "uuid": f"GPU-{i}", "model": "H100-80GB", "mig_enabled": True} for i in (0, 1)]
INSTANCES = [{"gpu": 0, "profile": "7g.80gb", "start": 0, "uuid": "MIG-a", "in_use": True},
             {"gpu": 1, "profile": "4g.40gb", "start": 0, "uuid": "MIG-b", "in_use": False},
             {"gpu": 1, "profile": "2g.20gb", "start": 4, "uuid": "MIG-c", "in_use": False},
             {"gpu": 1, "profile": "1g.10gb", "start": 6, "uuid": "MIG-d", "in_use": False}]


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


class CapturedSlurm:
    """Slurm answering ``sinfo --json`` with a captured document; Gres written as SlurmClient writes it."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.sinfo = SINFO_SET
        self.squeue_s = 0.0  # how long squeue takes (slurmctld restarting: seconds)
        self.written: list[tuple[str, str]] = []

    def jobs(self):
        self.clock.t += self.squeue_s
        return []

    def nodes(self):
        return parse_sinfo_json(json.loads(self.sinfo))

    def reservations(self):
        return []

    def job_detail(self, job_id):
        return None

    def update_node_gres(self, node, counts, *, pad_to=None, **kw):
        value = format_node_gres(counts, include_all=True, pad_to=pad_to)
        self.written.append((node, value))
        return value


@pytest.fixture
def rig(tmp_path):
    clock = Clock(1795711406.880)
    store = open_store(tmp_path / "state.db")
    store.replace_observed("n1", GPUS, INSTANCES, now=clock.t)
    slurm = CapturedSlurm(clock)
    ctl = Controller(Config(), store, slurm, clock=clock)
    yield ctl, slurm, clock
    store.close()


def _hms(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def test_counts_slurm_reset_at_a_registration_are_named_as_such(rig):
    ctl, slurm, clock = rig
    ctl.tick()
    assert slurm.written == [] and ctl.store.recent_events(10, kind="gres") == []  # Slurm holds the layouts' counts
    clock.t, slurm.sinfo = 1795711407.877, SINFO_REGISTERED
    ctl.tick()
    assert slurm.written == [("n1", "mig:1g:1,mig:1gme:0,mig:1gdm:0,mig:2g:1,mig:2gme:0,mig:3g:0,mig:4g:1,"
                                    "mig:7g:1,mig:pad:10")]
    (event,) = ctl.store.recent_events(10, kind="gres")
    assert event.message == (
        f"n1: Slurm had 1g:2,2g:2,3g:2,4g:1,7g:1, set 1g:1,2g:1,4g:1,7g:1 (it held 1g:1,2g:1,4g:1,7g:1, as set, "
        f"at {_hms(1795711406.880)}; since then a node registration (slurmctld asks for one now and then), a "
        f"slurmctld restart or `scontrol reconfigure` (each puts slurm.conf's counts back) or an `scontrol update` "
        f"by hand changed them)")
    assert ctl.metrics.counters[("slurm_mig_gres_reasserted_total", (("node", "n1"),))] == 1
    # Set again, Slurm holds them: nothing more to say.
    clock.t, slurm.sinfo = 1795711408.879, SINFO_SET
    ctl.tick()
    assert len(ctl.store.recent_events(10, kind="gres")) == 1


def test_a_slurmd_start_since_the_counts_were_set_is_named(rig):
    ctl, slurm, clock = rig
    ctl.tick()
    # The registered answer, but from a slurmd started at 16:43:27 (the only change to the captured document).
    clock.t = 1795711407.877
    slurm.sinfo = SINFO_REGISTERED.replace('"slurmd_start_time":1795711216', '"slurmd_start_time":1795711407')
    assert slurm.sinfo != SINFO_REGISTERED
    ctl.tick()
    (event,) = ctl.store.recent_events(10, kind="gres")
    assert event.message.endswith(f"; since then slurmd started at {_hms(1795711407)} and the node registered, "
                                  f"which puts slurm.conf's counts back)"), event.message


def test_the_event_is_stamped_when_slurm_answered_not_when_the_tick_began(rig):
    """The tick after a slurmctld restart began 3 s before slurmctld answered (its squeue waited): stamped at
    the tick's start, "Slurm had slurm.conf's counts" fell before slurmctld was even up."""
    ctl, slurm, clock = rig
    clock.t, slurm.squeue_s, slurm.sinfo = 1795711404.812, 3.065, SINFO_REGISTERED
    ctl.tick()
    (event,) = ctl.store.recent_events(10, kind="gres")
    assert event.message.startswith("n1: Slurm had 1g:2,2g:2,3g:2,4g:1,7g:1, set 1g:1,2g:1,4g:1,7g:1")
    assert event.time == pytest.approx(1795711407.877, rel=0, abs=0.001)


def test_a_slurmd_start_time_no_clock_can_show_does_not_fail_the_tick(rig):
    """A node whose clock is far off can report a slurmd start time localtime() cannot show (year > 9999):
    naming it in the gres event raised OverflowError/OSError inside the tick, every tick."""
    ctl, slurm, clock = rig
    ctl.tick()
    clock.t = 1795711407.877
    slurm.sinfo = SINFO_REGISTERED.replace('"slurmd_start_time":1795711216', '"slurmd_start_time":1e300')
    ctl.tick()
    (event,) = ctl.store.recent_events(10, kind="gres")
    assert "slurmd started at ?" in event.message, event.message
