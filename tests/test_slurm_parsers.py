"""Parsers and GRES helpers, on output captured from the real Slurm 22.05.8 local cluster.

The samples below are literal captures (the JSON re-serialised without
whitespace). Where a test feeds a hand-made shape (newer releases' JSON), it
says so.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from slurm_mig.errors import GeometryError
from slurm_mig.slurm import gres, parsers

# `squeue --json` on Debian Slurm 22.05.8 (local cluster, n3 drained). Jobs: 19 running
# mig:3g, 20 `-N2 --gres=mig:1g:2`, 21 held mig:3g.40gb:2 (rewritten by job_submit.lua),
# 22 pending on drained n3, 23 no gres. Re-serialised compactly, content unchanged.
SQUEUE_JSON_22_05 = r"""{"meta":{"plugin":{"type":"openapi/v0.0.38","name":"Slurm OpenAPI v0.0.38"},"Slurm":{"version":{"major":22,"micro":8,"minor":5},"release":"22.05.8"}},"errors":[],"jobs":[{"account":"","accrue_time":1795257118,"admin_comment":"","array_job_id":0,"array_task_id":null,"array_max_tasks":0,"array_task_string":"","association_id":0,"batch_features":"","batch_flag":true,"batch_host":"n1","flags":["JOB_WAS_RUNNING"],"burst_buffer":"","burst_buffer_state":"","cluster":"slurmmig","cluster_features":"","command":"","comment":"","container":"","contiguous":false,"core_spec":null,"thread_spec":null,"cores_per_socket":null,"billable_tres":1.0,"cpus_per_task":null,"cpu_frequency_minimum":null,"cpu_frequency_maximum":null,"cpu_frequency_governor":null,"cpus_per_tres":"","deadline":0,"delay_boot":0,"dependency":"","derived_exit_code":0,"eligible_time":1795257118,"end_time":1795258919,"excluded_nodes":"","exit_code":0,"features":"","federation_origin":"","federation_siblings_active":"","federation_siblings_viable":"","gres_detail":["mig:3g(CNT:1)"],"group_id":0,"group_name":"root","job_id":19,"job_resources":{"nodes":"n1","allocated_cores":1,"allocated_hosts":1,"allocated_nodes":[{"sockets":{"0":{"cores":{"0":"allocated"}}},"nodename":"n1","cpus_used":0,"memory_used":0,"memory_allocated":0}]},"job_state":"RUNNING","last_sched_evaluation":1795257119,"licenses":"","max_cpus":0,"max_nodes":0,"mcs_label":"","memory_per_tres":"","name":"train","nodes":"n1","nice":null,"tasks_per_core":null,"tasks_per_node":0,"tasks_per_socket":null,"tasks_per_board":0,"cpus":1,"node_count":1,"tasks":1,"het_job_id":0,"het_job_id_set":"","het_job_offset":0,"partition":"debug","prefer":"","memory_per_node":null,"memory_per_cpu":null,"minimum_cpus_per_node":1,"minimum_tmp_disk_per_node":0,"preempt_time":0,"pre_sus_time":0,"priority":4294901759,"profile":null,"qos":"","reboot":false,"required_nodes":"","requeue":true,"resize_time":0,"restart_cnt":0,"resv_name":"","shared":null,"show_flags":["SHOW_ALL","SHOW_DETAIL","SHOW_LOCAL"],"sockets_per_board":0,"sockets_per_node":null,"start_time":1795257119,"state_description":"","state_reason":"None","standard_error":"","standard_input":"/dev/null","standard_output":"","submit_time":1795257118,"suspend_time":0,"system_comment":"","time_limit":30,"time_minimum":0,"threads_per_core":null,"tres_bind":"","tres_freq":"","tres_per_job":"","tres_per_node":"gres:mig:3g:1","tres_per_socket":"","tres_per_task":"","tres_req_str":"cpu=1,mem=16000M,node=1,billing=1","tres_alloc_str":"cpu=1,node=1,billing=1","user_id":0,"user_name":"root","wckey":"","current_working_directory":"/tmp/cap"},{"account":"","accrue_time":1795257118,"admin_comment":"","array_job_id":0,"array_task_id":null,"array_max_tasks":0,"array_task_string":"","association_id":0,"batch_features":"","batch_flag":true,"batch_host":"n1","flags":["JOB_WAS_RUNNING"],"burst_buffer":"","burst_buffer_state":"","cluster":"slurmmig","cluster_features":"","command":"","comment":"","container":"","contiguous":false,"core_spec":null,"thread_spec":null,"cores_per_socket":null,"billable_tres":2.0,"cpus_per_task":null,"cpu_frequency_minimum":null,"cpu_frequency_maximum":null,"cpu_frequency_governor":null,"cpus_per_tres":"","deadline":0,"delay_boot":0,"dependency":"","derived_exit_code":0,"eligible_time":1795257118,"end_time":1826793119,"excluded_nodes":"","exit_code":0,"features":"","federation_origin":"","federation_siblings_active":"","federation_siblings_viable":"","gres_detail":["mig:1g(CNT:2)","mig:1g(CNT:2)"],"group_id":0,"group_name":"root","job_id":20,"job_resources":{"nodes":"n[1-2]","allocated_cores":2,"allocated_hosts":2,"allocated_nodes":[{"sockets":{"0":{"cores":{"1":"allocated"}}},"nodename":"n1","cpus_used":0,"memory_used":0,"memory_allocated":0},{"sockets":{"0":{"cores":{"0":"allocated"}}},"nodename":"n2","cpus_used":0,"memory_used":0,"memory_allocated":0}]},"job_state":"RUNNING","last_sched_evaluation":1795257119,"licenses":"","max_cpus":0,"max_nodes":0,"mcs_label":"","memory_per_tres":"","name":"multi","nodes":"n[1-2]","nice":null,"tasks_per_core":null,"tasks_per_node":0,"tasks_per_socket":null,"tasks_per_board":0,"cpus":2,"node_count":2,"tasks":2,"het_job_id":0,"het_job_id_set":"","het_job_offset":0,"partition":"debug","prefer":"","memory_per_node":null,"memory_per_cpu":null,"minimum_cpus_per_node":1,"minimum_tmp_disk_per_node":0,"preempt_time":0,"pre_sus_time":0,"priority":4294901758,"profile":null,"qos":"","reboot":false,"required_nodes":"","requeue":true,"resize_time":0,"restart_cnt":0,"resv_name":"","shared":null,"show_flags":["SHOW_ALL","SHOW_DETAIL","SHOW_LOCAL"],"sockets_per_board":0,"sockets_per_node":null,"start_time":1795257119,"state_description":"","state_reason":"None","standard_error":"","standard_input":"/dev/null","standard_output":"","submit_time":1795257118,"suspend_time":0,"system_comment":"","time_limit":525600,"time_minimum":0,"threads_per_core":null,"tres_bind":"","tres_freq":"","tres_per_job":"","tres_per_node":"gres:mig:1g:2","tres_per_socket":"","tres_per_task":"","tres_req_str":"cpu=2,mem=32000M,node=2,billing=2","tres_alloc_str":"cpu=2,node=2,billing=2","user_id":0,"user_name":"root","wckey":"","current_working_directory":"/tmp/cap"},{"account":"","accrue_time":0,"admin_comment":"","array_job_id":0,"array_task_id":null,"array_max_tasks":0,"array_task_string":"","association_id":0,"batch_features":"","batch_flag":true,"batch_host":"","flags":[],"burst_buffer":"","burst_buffer_state":"","cluster":"slurmmig","cluster_features":"","command":"","comment":"","container":"","contiguous":false,"core_spec":null,"thread_spec":null,"cores_per_socket":null,"billable_tres":null,"cpus_per_task":null,"cpu_frequency_minimum":null,"cpu_frequency_maximum":null,"cpu_frequency_governor":null,"cpus_per_tres":"","deadline":0,"delay_boot":0,"dependency":"","derived_exit_code":0,"eligible_time":0,"end_time":0,"excluded_nodes":"","exit_code":0,"features":"","federation_origin":"","federation_siblings_active":"","federation_siblings_viable":"","gres_detail":[],"group_id":0,"group_name":"root","job_id":21,"job_state":"PENDING","last_sched_evaluation":1795257118,"licenses":"","max_cpus":0,"max_nodes":0,"mcs_label":"","memory_per_tres":"","name":"held","nodes":"","nice":null,"tasks_per_core":null,"tasks_per_node":0,"tasks_per_socket":null,"tasks_per_board":0,"cpus":1,"node_count":1,"tasks":1,"het_job_id":0,"het_job_id_set":"","het_job_offset":0,"partition":"debug","prefer":"","memory_per_node":null,"memory_per_cpu":null,"minimum_cpus_per_node":1,"minimum_tmp_disk_per_node":0,"preempt_time":0,"pre_sus_time":0,"priority":0,"profile":null,"qos":"","reboot":false,"required_nodes":"","requeue":true,"resize_time":0,"restart_cnt":0,"resv_name":"","shared":null,"show_flags":["SHOW_ALL","SHOW_DETAIL","SHOW_LOCAL"],"sockets_per_board":0,"sockets_per_node":null,"start_time":0,"state_description":"","state_reason":"JobHeldUser","standard_error":"","standard_input":"/dev/null","standard_output":"","submit_time":1795257118,"suspend_time":0,"system_comment":"","time_limit":10,"time_minimum":0,"threads_per_core":null,"tres_bind":"","tres_freq":"","tres_per_job":"","tres_per_node":"gres:mig:3g:2","tres_per_socket":"","tres_per_task":"","tres_req_str":"cpu=1,mem=16000M,node=1,billing=1","tres_alloc_str":"","user_id":0,"user_name":"root","wckey":"","current_working_directory":"/tmp/cap"},{"account":"","accrue_time":1795257118,"admin_comment":"","array_job_id":0,"array_task_id":null,"array_max_tasks":0,"array_task_string":"","association_id":0,"batch_features":"","batch_flag":true,"batch_host":"","flags":[],"burst_buffer":"","burst_buffer_state":"","cluster":"slurmmig","cluster_features":"","command":"","comment":"","container":"","contiguous":false,"core_spec":null,"thread_spec":null,"cores_per_socket":null,"billable_tres":null,"cpus_per_task":null,"cpu_frequency_minimum":null,"cpu_frequency_maximum":null,"cpu_frequency_governor":null,"cpus_per_tres":"","deadline":0,"delay_boot":0,"dependency":"","derived_exit_code":0,"eligible_time":1795257118,"end_time":0,"excluded_nodes":"","exit_code":0,"features":"","federation_origin":"","federation_siblings_active":"","federation_siblings_viable":"","gres_detail":[],"group_id":0,"group_name":"root","job_id":22,"job_state":"PENDING","last_sched_evaluation":1795257119,"licenses":"","max_cpus":0,"max_nodes":0,"mcs_label":"","memory_per_tres":"","name":"waits","nodes":"","nice":null,"tasks_per_core":null,"tasks_per_node":0,"tasks_per_socket":null,"tasks_per_board":0,"cpus":1,"node_count":1,"tasks":1,"het_job_id":0,"het_job_id_set":"","het_job_offset":0,"partition":"debug","prefer":"","memory_per_node":null,"memory_per_cpu":null,"minimum_cpus_per_node":1,"minimum_tmp_disk_per_node":0,"preempt_time":0,"pre_sus_time":0,"priority":4294901757,"profile":null,"qos":"","reboot":false,"required_nodes":"n3","requeue":true,"resize_time":0,"restart_cnt":0,"resv_name":"","shared":null,"show_flags":["SHOW_ALL","SHOW_DETAIL","SHOW_LOCAL"],"sockets_per_board":0,"sockets_per_node":null,"start_time":0,"state_description":"ReqNodeNotAvail, UnavailableNodes:n3","state_reason":"ReqNodeNotAvail","standard_error":"","standard_input":"/dev/null","standard_output":"","submit_time":1795257118,"suspend_time":0,"system_comment":"","time_limit":null,"time_minimum":0,"threads_per_core":null,"tres_bind":"","tres_freq":"","tres_per_job":"","tres_per_node":"gres:mig:2g:1","tres_per_socket":"","tres_per_task":"","tres_req_str":"cpu=1,mem=16000M,node=1,billing=1","tres_alloc_str":"","user_id":0,"user_name":"root","wckey":"","current_working_directory":"/tmp/cap"},{"account":"","accrue_time":1795257118,"admin_comment":"","array_job_id":0,"array_task_id":null,"array_max_tasks":0,"array_task_string":"","association_id":0,"batch_features":"","batch_flag":true,"batch_host":"n1","flags":["JOB_WAS_RUNNING"],"burst_buffer":"","burst_buffer_state":"","cluster":"slurmmig","cluster_features":"","command":"","comment":"","container":"","contiguous":false,"core_spec":null,"thread_spec":null,"cores_per_socket":null,"billable_tres":1.0,"cpus_per_task":null,"cpu_frequency_minimum":null,"cpu_frequency_maximum":null,"cpu_frequency_governor":null,"cpus_per_tres":"","deadline":0,"delay_boot":0,"dependency":"","derived_exit_code":0,"eligible_time":1795257118,"end_time":1826793119,"excluded_nodes":"","exit_code":0,"features":"","federation_origin":"","federation_siblings_active":"","federation_siblings_viable":"","gres_detail":[],"group_id":0,"group_name":"root","job_id":23,"job_resources":{"nodes":"n1","allocated_cores":1,"allocated_hosts":1,"allocated_nodes":[{"sockets":{"0":{"cores":{"2":"allocated"}}},"nodename":"n1","cpus_used":0,"memory_used":0,"memory_allocated":0}]},"job_state":"RUNNING","last_sched_evaluation":1795257119,"licenses":"","max_cpus":0,"max_nodes":0,"mcs_label":"","memory_per_tres":"","name":"plain","nodes":"n1","nice":null,"tasks_per_core":null,"tasks_per_node":0,"tasks_per_socket":null,"tasks_per_board":0,"cpus":1,"node_count":1,"tasks":1,"het_job_id":0,"het_job_id_set":"","het_job_offset":0,"partition":"debug","prefer":"","memory_per_node":null,"memory_per_cpu":null,"minimum_cpus_per_node":1,"minimum_tmp_disk_per_node":0,"preempt_time":0,"pre_sus_time":0,"priority":4294901756,"profile":null,"qos":"","reboot":false,"required_nodes":"","requeue":true,"resize_time":0,"restart_cnt":0,"resv_name":"","shared":null,"show_flags":["SHOW_ALL","SHOW_DETAIL","SHOW_LOCAL"],"sockets_per_board":0,"sockets_per_node":null,"start_time":1795257119,"state_description":"","state_reason":"None","standard_error":"","standard_input":"/dev/null","standard_output":"","submit_time":1795257118,"suspend_time":0,"system_comment":"","time_limit":525600,"time_minimum":0,"threads_per_core":null,"tres_bind":"","tres_freq":"","tres_per_job":"","tres_per_node":"","tres_per_socket":"","tres_per_task":"","tres_req_str":"cpu=1,mem=16000M,node=1,billing=1","tres_alloc_str":"cpu=1,node=1,billing=1","user_id":0,"user_name":"root","wckey":"","current_working_directory":"/tmp/cap"}]}"""

# `sinfo --json` at the same moment.
SINFO_JSON_22_05 = r"""{"meta":{"plugin":{"type":"openapi/v0.0.38","name":"Slurm OpenAPI v0.0.38"},"Slurm":{"version":{"major":22,"micro":8,"minor":5},"release":"22.05.8"}},"errors":[],"nodes":[{"architecture":"x86_64","burstbuffer_network_address":"","boards":1,"boot_time":1795256448,"comment":"","cores":8,"cpu_binding":0,"cpu_load":5,"extra":"","free_memory":23733,"cpus":8,"last_busy":1795257117,"features":"","active_features":"","gres":"mig:1g:4,mig:1gme:0,mig:1gdm:0,mig:2g:2,mig:2gme:0,mig:3g:2,mig:4g:0,mig:7g:0","gres_drained":"N/A","gres_used":"mig:1g:2,mig:1gme:0,mig:1gdm:0,mig:2g:0,mig:2gme:0,mig:3g:1,mig:4g:0,mig:7g:0","mcs_label":"","name":"n1","next_state_after_reboot":"invalid","address":"127.0.0.1","hostname":"localhost","state":"mixed","state_flags":[],"next_state_after_reboot_flags":[],"operating_system":"Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0","owner":null,"partitions":["debug"],"port":17005,"real_memory":16000,"reason":"","reason_changed_at":0,"reason_set_by_user":null,"slurmd_start_time":1795257117,"sockets":1,"threads":1,"temporary_disk":0,"weight":1,"tres":"cpu=8,mem=16000M,billing=8","slurmd_version":"22.05.8","alloc_memory":0,"alloc_cpus":3,"idle_cpus":5,"tres_used":"cpu=3","tres_weighted":3.0},{"architecture":"x86_64","burstbuffer_network_address":"","boards":1,"boot_time":1795256449,"comment":"","cores":8,"cpu_binding":0,"cpu_load":5,"extra":"","free_memory":23734,"cpus":8,"last_busy":1795257118,"features":"","active_features":"","gres":"mig:1g:4,mig:1gme:0,mig:1gdm:0,mig:2g:2,mig:2gme:0,mig:3g:2,mig:4g:0,mig:7g:0","gres_drained":"N/A","gres_used":"mig:1g:2,mig:1gme:0,mig:1gdm:0,mig:2g:0,mig:2gme:0,mig:3g:0,mig:4g:0,mig:7g:0","mcs_label":"","name":"n2","next_state_after_reboot":"invalid","address":"127.0.0.1","hostname":"localhost","state":"mixed","state_flags":[],"next_state_after_reboot_flags":[],"operating_system":"Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0","owner":null,"partitions":["debug"],"port":17006,"real_memory":16000,"reason":"","reason_changed_at":0,"reason_set_by_user":null,"slurmd_start_time":1795257117,"sockets":1,"threads":1,"temporary_disk":0,"weight":1,"tres":"cpu=8,mem=16000M,billing=8","slurmd_version":"22.05.8","alloc_memory":0,"alloc_cpus":1,"idle_cpus":7,"tres_used":"cpu=1","tres_weighted":1.0},{"architecture":"x86_64","burstbuffer_network_address":"","boards":1,"boot_time":1795256448,"comment":"","cores":8,"cpu_binding":0,"cpu_load":5,"extra":"","free_memory":23733,"cpus":8,"last_busy":1795257117,"features":"","active_features":"","gres":"mig:1g:4,mig:1gme:0,mig:1gdm:0,mig:2g:2,mig:2gme:0,mig:3g:2,mig:4g:0,mig:7g:0","gres_drained":"N/A","gres_used":"mig:1g:0,mig:1gme:0,mig:1gdm:0,mig:2g:0,mig:2gme:0,mig:3g:0,mig:4g:0,mig:7g:0","mcs_label":"","name":"n3","next_state_after_reboot":"invalid","address":"127.0.0.1","hostname":"localhost","state":"idle","state_flags":["DRAIN"],"next_state_after_reboot_flags":[],"operating_system":"Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0","owner":null,"partitions":["debug"],"port":17007,"real_memory":16000,"reason":"mig reconfig in progress","reason_changed_at":1795257118,"reason_set_by_user":"root","slurmd_start_time":1795257117,"sockets":1,"threads":1,"temporary_disk":0,"weight":1,"tres":"cpu=8,mem=16000M,billing=8","slurmd_version":"22.05.8","alloc_memory":0,"alloc_cpus":0,"idle_cpus":8,"tres_used":null,"tres_weighted":0.0}]}"""

# `scontrol -d show job` at the same moment (multi-line form).
SCONTROL_JOBS_D = r"""JobId=19 JobName=train
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   Priority=4294901759 Nice=0 Account=(null) QOS=(null)
   JobState=RUNNING Reason=None Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0
   DerivedExitCode=0:0
   RunTime=00:00:00 TimeLimit=00:30:00 TimeMin=N/A
   SubmitTime=2026-11-21T10:31:58 EligibleTime=2026-11-21T10:31:58
   AccrueTime=2026-11-21T10:31:58
   StartTime=2026-11-21T10:31:59 EndTime=2026-11-21T11:01:59 Deadline=N/A
   SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-21T10:31:59 Scheduler=Backfill
   Partition=debug AllocNode:Sid=localhost:1988
   ReqNodeList=(null) ExcNodeList=(null)
   NodeList=n1
   BatchHost=n1
   NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   TRES=cpu=1,node=1,billing=1
   Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=*
   JOB_GRES=mig:3g:1
     Nodes=n1 CPU_IDs=0 Mem=0 GRES=mig:3g(CNT:1)
   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0
   Features=(null) DelayBoot=00:00:00
   OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null)
   Command=(null)
   WorkDir=/tmp/cap
   StdErr=/tmp/cap/slurm-19.out
   StdIn=/dev/null
   StdOut=/tmp/cap/slurm-19.out
   Power=
   TresPerNode=gres:mig:3g:1
   

JobId=20 JobName=multi
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   Priority=4294901758 Nice=0 Account=(null) QOS=(null)
   JobState=RUNNING Reason=None Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0
   DerivedExitCode=0:0
   RunTime=00:00:00 TimeLimit=365-00:00:00 TimeMin=N/A
   SubmitTime=2026-11-21T10:31:58 EligibleTime=2026-11-21T10:31:58
   AccrueTime=2026-11-21T10:31:58
   StartTime=2026-11-21T10:31:59 EndTime=2027-11-21T10:31:59 Deadline=N/A
   SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-21T10:31:59 Scheduler=Backfill
   Partition=debug AllocNode:Sid=localhost:1988
   ReqNodeList=(null) ExcNodeList=(null)
   NodeList=n[1-2]
   BatchHost=n1
   NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   TRES=cpu=2,node=2,billing=2
   Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=*
   JOB_GRES=mig:1g:4
     Nodes=n1 CPU_IDs=1 Mem=0 GRES=mig:1g(CNT:2)
     Nodes=n2 CPU_IDs=0 Mem=0 GRES=mig:1g(CNT:2)
   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0
   Features=(null) DelayBoot=00:00:00
   OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null)
   Command=(null)
   WorkDir=/tmp/cap
   StdErr=/tmp/cap/slurm-20.out
   StdIn=/dev/null
   StdOut=/tmp/cap/slurm-20.out
   Power=
   TresPerNode=gres:mig:1g:2
   

JobId=21 JobName=held
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   Priority=0 Nice=0 Account=(null) QOS=(null)
   JobState=PENDING Reason=JobHeldUser Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0
   DerivedExitCode=0:0
   RunTime=00:00:00 TimeLimit=00:10:00 TimeMin=N/A
   SubmitTime=2026-11-21T10:31:58 EligibleTime=Unknown
   AccrueTime=Unknown
   StartTime=Unknown EndTime=Unknown Deadline=N/A
   SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-21T10:31:58 Scheduler=Main
   Partition=debug AllocNode:Sid=localhost:1988
   ReqNodeList=(null) ExcNodeList=(null)
   NodeList=
   NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   TRES=cpu=1,mem=16000M,node=1,billing=1
   Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=*
   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0
   Features=(null) DelayBoot=00:00:00
   OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null)
   Command=(null)
   WorkDir=/tmp/cap
   StdErr=/tmp/cap/slurm-21.out
   StdIn=/dev/null
   StdOut=/tmp/cap/slurm-21.out
   Power=
   TresPerNode=gres:mig:3g:2
   

JobId=22 JobName=waits
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   Priority=4294901757 Nice=0 Account=(null) QOS=(null)
   JobState=PENDING Reason=ReqNodeNotAvail,_UnavailableNodes:n3 Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0
   DerivedExitCode=0:0
   RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A
   SubmitTime=2026-11-21T10:31:58 EligibleTime=2026-11-21T10:31:58
   AccrueTime=2026-11-21T10:31:58
   StartTime=Unknown EndTime=Unknown Deadline=N/A
   SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-21T10:31:59 Scheduler=Backfill:*
   Partition=debug AllocNode:Sid=localhost:1988
   ReqNodeList=n3 ExcNodeList=(null)
   NodeList=
   NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   TRES=cpu=1,mem=16000M,node=1,billing=1
   Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=*
   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0
   Features=(null) DelayBoot=00:00:00
   OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null)
   Command=(null)
   WorkDir=/tmp/cap
   StdErr=/tmp/cap/slurm-22.out
   StdIn=/dev/null
   StdOut=/tmp/cap/slurm-22.out
   Power=
   TresPerNode=gres:mig:2g:1
   

JobId=23 JobName=plain
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   Priority=4294901756 Nice=0 Account=(null) QOS=(null)
   JobState=RUNNING Reason=None Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0
   DerivedExitCode=0:0
   RunTime=00:00:00 TimeLimit=365-00:00:00 TimeMin=N/A
   SubmitTime=2026-11-21T10:31:58 EligibleTime=2026-11-21T10:31:58
   AccrueTime=2026-11-21T10:31:58
   StartTime=2026-11-21T10:31:59 EndTime=2027-11-21T10:31:59 Deadline=N/A
   SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-21T10:31:59 Scheduler=Backfill
   Partition=debug AllocNode:Sid=localhost:1988
   ReqNodeList=(null) ExcNodeList=(null)
   NodeList=n1
   BatchHost=n1
   NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   TRES=cpu=1,node=1,billing=1
   Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=*
   JOB_GRES=(null)
     Nodes=n1 CPU_IDs=2 Mem=0 GRES=
   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0
   Features=(null) DelayBoot=00:00:00
   OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null)
   Command=(null)
   WorkDir=/tmp/cap
   StdErr=/tmp/cap/slurm-23.out
   StdIn=/dev/null
   StdOut=/tmp/cap/slurm-23.out
   Power=
   

"""

# `scontrol -d -o show job 20` (one-line form).
SCONTROL_JOB20_D_ONELINE = r"""JobId=20 JobName=multi UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901758 Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 DerivedExitCode=0:0 RunTime=00:00:06 TimeLimit=365-00:00:00 TimeMin=N/A SubmitTime=2026-11-21T10:31:58 EligibleTime=2026-11-21T10:31:58 AccrueTime=2026-11-21T10:31:58 StartTime=2026-11-21T10:31:59 EndTime=2027-11-21T10:31:59 Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-21T10:31:59 Scheduler=Backfill Partition=debug AllocNode:Sid=localhost:1988 ReqNodeList=(null) ExcNodeList=(null) NodeList=n[1-2] BatchHost=n1 NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=2,node=2,billing=2 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* JOB_GRES=mig:1g:4   Nodes=n1 CPU_IDs=1 Mem=0 GRES=mig:1g(CNT:2)   Nodes=n2 CPU_IDs=0 Mem=0 GRES=mig:1g(CNT:2) MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=(null) WorkDir=/tmp/cap StdErr=/tmp/cap/slurm-20.out StdIn=/dev/null StdOut=/tmp/cap/slurm-20.out Power= TresPerNode=gres:mig:1g:2 
"""

# `scontrol show node` (no -d: no GresUsed).
SCONTROL_NODES = r"""NodeName=n1 Arch=x86_64 CoresPerSocket=8 
   CPUAlloc=3 CPUEfctv=8 CPUTot=8 CPULoad=0.05
   AvailableFeatures=(null)
   ActiveFeatures=(null)
   Gres=mig:1g:4,mig:1gme:0,mig:1gdm:0,mig:2g:2,mig:2gme:0,mig:3g:2,mig:4g:0,mig:7g:0
   NodeAddr=127.0.0.1 NodeHostName=localhost Port=17005 Version=22.05.8
   OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0 
   RealMemory=16000 AllocMem=0 FreeMem=23733 Sockets=1 Boards=1
   State=MIXED ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   Partitions=debug 
   BootTime=2026-11-21T10:20:48 SlurmdStartTime=2026-11-21T10:31:57
   LastBusyTime=2026-11-21T10:31:57
   CfgTRES=cpu=8,mem=16000M,billing=8
   AllocTRES=cpu=3
   CapWatts=n/a
   CurrentWatts=0 AveWatts=0
   ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s

NodeName=n2 Arch=x86_64 CoresPerSocket=8 
   CPUAlloc=1 CPUEfctv=8 CPUTot=8 CPULoad=0.05
   AvailableFeatures=(null)
   ActiveFeatures=(null)
   Gres=mig:1g:4,mig:1gme:0,mig:1gdm:0,mig:2g:2,mig:2gme:0,mig:3g:2,mig:4g:0,mig:7g:0
   NodeAddr=127.0.0.1 NodeHostName=localhost Port=17006 Version=22.05.8
   OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0 
   RealMemory=16000 AllocMem=0 FreeMem=23734 Sockets=1 Boards=1
   State=MIXED ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   Partitions=debug 
   BootTime=2026-11-21T10:20:49 SlurmdStartTime=2026-11-21T10:31:57
   LastBusyTime=2026-11-21T10:31:58
   CfgTRES=cpu=8,mem=16000M,billing=8
   AllocTRES=cpu=1
   CapWatts=n/a
   CurrentWatts=0 AveWatts=0
   ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s

NodeName=n3 Arch=x86_64 CoresPerSocket=8 
   CPUAlloc=0 CPUEfctv=8 CPUTot=8 CPULoad=0.05
   AvailableFeatures=(null)
   ActiveFeatures=(null)
   Gres=mig:1g:4,mig:1gme:0,mig:1gdm:0,mig:2g:2,mig:2gme:0,mig:3g:2,mig:4g:0,mig:7g:0
   NodeAddr=127.0.0.1 NodeHostName=localhost Port=17007 Version=22.05.8
   OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0 
   RealMemory=16000 AllocMem=0 FreeMem=23733 Sockets=1 Boards=1
   State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   Partitions=debug 
   BootTime=2026-11-21T10:20:48 SlurmdStartTime=2026-11-21T10:31:57
   LastBusyTime=2026-11-21T10:31:57
   CfgTRES=cpu=8,mem=16000M,billing=8
   AllocTRES=
   CapWatts=n/a
   CurrentWatts=0 AveWatts=0
   ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s
   Reason=mig reconfig in progress [root@2026-11-21T10:31:58]

"""

# `scontrol -d show node n1` (with GresUsed).
SCONTROL_NODE_N1_D = r"""NodeName=n1 Arch=x86_64 CoresPerSocket=8 
   CPUAlloc=3 CPUEfctv=8 CPUTot=8 CPULoad=0.05
   AvailableFeatures=(null)
   ActiveFeatures=(null)
   Gres=mig:1g:4,mig:1gme:0,mig:1gdm:0,mig:2g:2,mig:2gme:0,mig:3g:2,mig:4g:0,mig:7g:0
   GresDrain=N/A
   GresUsed=mig:1g:2,mig:1gme:0,mig:1gdm:0,mig:2g:0,mig:2gme:0,mig:3g:1,mig:4g:0,mig:7g:0
   NodeAddr=127.0.0.1 NodeHostName=localhost Port=17005 Version=22.05.8
   OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0 
   RealMemory=16000 AllocMem=0 FreeMem=23733 Sockets=1 Boards=1
   State=MIXED ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   Partitions=debug 
   BootTime=2026-11-21T10:20:48 SlurmdStartTime=2026-11-21T10:31:57
   LastBusyTime=2026-11-21T10:31:57
   CfgTRES=cpu=8,mem=16000M,billing=8
   AllocTRES=cpu=3
   CapWatts=n/a
   CurrentWatts=0 AveWatts=0
   ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s

"""

# `scontrol show node -o n3` (drained, reason with spaces).
SCONTROL_NODE_N3_ONELINE = r"""NodeName=n3 Arch=x86_64 CoresPerSocket=8  CPUAlloc=0 CPUEfctv=8 CPUTot=8 CPULoad=0.05 AvailableFeatures=(null) ActiveFeatures=(null) Gres=mig:1g:4,mig:1gme:0,mig:1gdm:0,mig:2g:2,mig:2gme:0,mig:3g:2,mig:4g:0,mig:7g:0 NodeAddr=127.0.0.1 NodeHostName=localhost Port=17007 Version=22.05.8 OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=16000 AllocMem=0 FreeMem=23733 Sockets=1 Boards=1 State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=debug  BootTime=2026-11-21T10:20:48 SlurmdStartTime=2026-11-21T10:31:57 LastBusyTime=2026-11-21T10:31:57 CfgTRES=cpu=8,mem=16000M,billing=8 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s Reason=mig reconfig in progress [root@2026-11-21T10:31:58]
"""


ALL_TYPES_0 = {t: 0 for t in gres.GRES_TYPES}
BOOT = {**ALL_TYPES_0, "1g": 4, "2g": 2, "3g": 2}


# -- squeue --json ----------------------------------------------------------------


def test_squeue_json_jobs():
    jobs = {j.job_id: j for j in parsers.parse_squeue_json(json.loads(SQUEUE_JSON_22_05))}
    assert sorted(jobs) == [19, 20, 21, 22, 23]
    j = jobs[19]
    assert (j.name, j.user, j.user_id, j.state, j.partition) == ("train", "root", 0, "RUNNING", "debug")
    assert j.nodes == ["n1"] and j.node_count == 1
    assert j.mig == {"3g": 1} and j.tres_per_node == "gres:mig:3g:1" and j.wants_mig
    assert j.submit_time == 1795257118 and j.start_time == 1795257119
    assert j.time_limit_min == 30 and j.priority == 4294901759
    assert j.state_reason == ""  # Slurm writes "None"
    assert j.restart_cnt == 0


def test_squeue_json_multi_node_pending_held_plain():
    jobs = {j.job_id: j for j in parsers.parse_squeue_json(json.loads(SQUEUE_JSON_22_05))}
    assert jobs[20].nodes == ["n1", "n2"] and jobs[20].mig == {"1g": 2}  # per node
    # A running job without a limit shows 365 days; the same while pending is null.
    assert jobs[20].time_limit_min == 525600
    assert jobs[22].time_limit_min is None
    held = jobs[21]
    assert held.pending and held.held and held.mig == {"3g": 2} and held.start_time is None
    assert held.state_reason == "JobHeldUser"
    assert jobs[22].pending and not jobs[22].held and jobs[22].state_reason == "ReqNodeNotAvail"
    assert jobs[22].nodes == []
    assert jobs[23].mig == {} and not jobs[23].wants_mig and jobs[23].tres_per_node == ""


def test_squeue_json_tolerates_newer_and_missing_fields():
    # Hand-made in the shape of Slurm 23.02+ (lists for state, number objects, gres/ prefix).
    doc = {"jobs": [
        {"job_id": 7, "job_state": ["PENDING", "REQUEUED"], "tres_per_node": "gres/mig:2g:3",
         "time_limit": {"set": True, "infinite": False, "number": 60},
         "priority": {"set": True, "infinite": False, "number": 100},
         "submit_time": {"set": True, "infinite": False, "number": 1700000000},
         "start_time": {"set": False, "infinite": False, "number": 0},
         "user_name": "alice", "nodes": "", "restart_cnt": 2},
        {"job_id": 8, "job_state": "RUNNING", "gres": "mig:7g:1", "time_limit": {"set": True, "infinite": True,
                                                                              "number": 0}},
        {"name": "no id: skipped"},
        {"job_id": 9},
    ]}
    jobs = {j.job_id: j for j in parsers.parse_squeue_json(doc)}
    assert sorted(jobs) == [7, 8, 9]
    assert jobs[7].state == "PENDING" and "REQUEUED" in jobs[7].flags
    assert jobs[7].mig == {"2g": 3} and jobs[7].time_limit_min == 60 and jobs[7].priority == 100
    assert jobs[7].submit_time == 1700000000 and jobs[7].start_time is None
    assert jobs[7].restart_cnt == 2 and jobs[8].restart_cnt == 0  # requeued twice; absent: never
    assert jobs[8].mig == {"7g": 1} and jobs[8].time_limit_min is None
    assert jobs[9].state == "" and jobs[9].mig == {} and jobs[9].nodes == []
    assert parsers.parse_squeue_json({}) == []


# -- sinfo --json / scontrol show node ----------------------------------------------


def test_sinfo_json_nodes():
    nodes = {n.name: n for n in parsers.parse_sinfo_json(json.loads(SINFO_JSON_22_05))}
    assert sorted(nodes) == ["n1", "n2", "n3"]
    n1 = nodes["n1"]
    assert n1.state == "mixed" and not n1.flags and n1.available
    assert n1.gres == BOOT
    assert n1.gres_used == {**ALL_TYPES_0, "1g": 2, "3g": 1}
    assert n1.gres_free == {**ALL_TYPES_0, "1g": 2, "2g": 2, "3g": 1}
    assert n1.partitions == ["debug"] and n1.cpus == 8 and n1.alloc_cpus == 3
    assert (n1.address, n1.hostname) == ("127.0.0.1", "localhost")  # NodeAddr: where a node's requests come from
    n3 = nodes["n3"]
    assert n3.state == "idle" and n3.drained and not n3.available
    assert n3.reason == "mig reconfig in progress"


def test_slurmd_start_time_from_sinfo_and_scontrol():
    """When the node's slurmd started: a start registers the node, which puts slurm.conf's Gres mix back."""
    nodes = {n.name: n for n in parsers.parse_sinfo_json(json.loads(SINFO_JSON_22_05))}
    assert nodes["n1"].slurmd_start_time == 1795257117
    (n3,) = parsers.parse_scontrol_nodes(SCONTROL_NODE_N3_ONELINE)  # local time, as scontrol prints it
    assert n3.slurmd_start_time == parsers.local_epoch("2026-11-21T10:31:57") is not None
    (bare,) = parsers.parse_scontrol_nodes("NodeName=gpu7 State=IDLE")
    assert bare.slurmd_start_time is None


def test_scontrol_nodes_multiline_oneline_and_detail():
    nodes = parsers.parse_scontrol_nodes(SCONTROL_NODES)
    assert [n.name for n in nodes] == ["n1", "n2", "n3"]
    assert all(n.gres == BOOT for n in nodes)
    assert nodes[0].gres_used is None  # not printed without -d
    assert nodes[0].state == "mixed" and nodes[0].cpus == 8 and nodes[0].alloc_cpus == 3
    assert nodes[2].drained and nodes[2].reason == "mig reconfig in progress"
    (n3,) = parsers.parse_scontrol_nodes(SCONTROL_NODE_N3_ONELINE)
    assert (n3.name, n3.state, n3.flags, n3.reason) == ("n3", "idle", frozenset({"DRAIN"}),
                                                        "mig reconfig in progress")
    (n1,) = parsers.parse_scontrol_nodes(SCONTROL_NODE_N1_D)
    assert n1.gres_used == {**ALL_TYPES_0, "1g": 2, "3g": 1}
    assert all((n.address, n.hostname) == ("127.0.0.1", "localhost") for n in [*nodes, n3, n1])
    (bare,) = parsers.parse_scontrol_nodes("NodeName=gpu7 NodeAddr=(null) State=IDLE")
    assert bare.address == "" and bare.hostname == ""  # the origin check then resolves the node's name


@pytest.mark.parametrize("state,flags,base,expect", [
    ("IDLE+DRAIN", None, "idle", {"DRAIN"}),
    ("DOWN*", None, "down", {"NOT_RESPONDING"}),
    ("MIXED+DRAIN+INVALID_REG", None, "mixed", {"DRAIN", "INVALID_REG"}),
    ("idle*", None, "idle", {"NOT_RESPONDING"}),
    ("drained", None, "idle", {"DRAIN"}),
    ("draining", None, "allocated", {"DRAIN"}),
    ("idle", ["DRAIN"], "idle", {"DRAIN"}),  # 22.05 JSON
    (["IDLE", "DRAIN"], None, "idle", {"DRAIN"}),  # 23.02+ JSON
    ("idle~", None, "idle", {"POWERED_DOWN"}),
    ("", None, "unknown", set()),
    (None, None, "unknown", set()),
])
def test_node_state(state, flags, base, expect):
    assert parsers.parse_node_state(state, flags) == (base, frozenset(expect))


# -- scontrol -d show job ------------------------------------------------------------


def test_scontrol_jobs_detail():
    jobs = {j.job_id: j for j in parsers.parse_scontrol_jobs(SCONTROL_JOBS_D)}
    assert sorted(jobs) == [19, 20, 21, 22, 23]
    j = jobs[19]
    assert (j.name, j.user, j.state, j.partition, j.nodes, j.batch_host) == (
        "train", "root", "RUNNING", "debug", ["n1"], "n1")
    assert j.job_gres_raw == "mig:3g:1" and j.job_gres == {"3g": 1}
    assert j.node_gres == {"n1": {"3g": 1}} and j.mig == {"3g": 1}
    assert j.time_limit == "00:30:00" and j.fields["TRES"] == "cpu=1,node=1,billing=1"
    # JOB_GRES is the total over nodes; the split is per node.
    m = jobs[20]
    assert m.job_gres == {"1g": 4} and m.mig == {"1g": 2}
    assert m.node_gres == {"n1": {"1g": 2}, "n2": {"1g": 2}} and m.nodes == ["n1", "n2"]
    assert jobs[21].held and jobs[21].job_gres == {} and jobs[21].mig == {"3g": 2}
    assert jobs[22].reason == "ReqNodeNotAvail,_UnavailableNodes:n3" and jobs[22].time_limit == "UNLIMITED"
    assert jobs[23].job_gres == {} and jobs[23].node_gres == {} and jobs[23].mig == {}


def test_scontrol_job_oneline_matches_multiline():
    (one,) = parsers.parse_scontrol_jobs(SCONTROL_JOB20_D_ONELINE)
    multi = {j.job_id: j for j in parsers.parse_scontrol_jobs(SCONTROL_JOBS_D)}[20]
    assert one.node_gres == multi.node_gres and one.job_gres == multi.job_gres
    assert one.tres_per_node == multi.tres_per_node == "gres:mig:1g:2"


def test_scontrol_no_jobs():
    assert parsers.parse_scontrol_jobs("No jobs in the system\n") == []
    assert parsers.parse_scontrol_nodes("") == []


def test_kv_values_with_spaces_and_colon_keys():
    pairs = dict(parsers.parse_kv("OS=Linux 6.1 #1 SMP ReqB:S:C:T=0:0:*:* CPUs/Task=1 TRES=cpu=1,node=1 "
                                  "Reason=a b c [root@2026-01-01T00:00:00]"))
    assert pairs == {"OS": "Linux 6.1 #1 SMP", "ReqB:S:C:T": "0:0:*:*", "CPUs/Task": "1",
                     "TRES": "cpu=1,node=1", "Reason": "a b c [root@2026-01-01T00:00:00]"}


@pytest.mark.parametrize("expr,expect", [
    ("n[1-3,5],gpu01", ["n1", "n2", "n3", "n5", "gpu01"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("n1", ["n1"]),
    ("", []),
    ("(null)", []),
    ("n[1-x],m2", ["n[1-x]", "m2"]),  # not a range Slurm prints: kept as text, no exception
    ("n[1-999999999]", ["n[1-999999999]"]),  # no billion names
    ("n[1-2,4-]", ["n[1-2,4-]"]),
])
def test_expand_hostlist(expr, expect):
    assert parsers.expand_hostlist(expr) == expect


def test_detail_gres_forms():
    assert parsers._detail_gres("mig:1g(CNT:2),mig:3g(IDX:0-1),gpu:a100(IDX:0)") == {"1g": 2, "3g": 2}
    assert parsers._detail_gres("") == {}


def test_mig_request():
    assert parsers.mig_request("gres:mig:3g:2,gres:foo:1") == {"3g": 2}
    assert parsers.mig_request("gres/mig:1g:1,gres/mig:1g:2") == {"1g": 3}
    assert parsers.mig_request("gres:mig:2") == {}  # untyped: not a MIG size request
    assert parsers.mig_request("gres:mig:3g:1k") == {}  # unparsable count skipped
    assert parsers.mig_request(None) == {}


# -- gres.py -------------------------------------------------------------------------


def test_format_node_gres():
    assert gres.format_node_gres({"1g": 2, "3g": 1}) == "mig:1g:2,mig:3g:1"
    assert gres.format_node_gres({"3g": 1, "1g": 2}) == "mig:1g:2,mig:3g:1"  # stable order
    assert gres.format_node_gres({"7g": 0}) == ""
    assert gres.format_node_gres({"1g": 1}, include_all=True) == (
        "mig:1g:1,mig:1gme:0,mig:1gdm:0,mig:2g:0,mig:2gme:0,mig:3g:0,mig:4g:0,mig:7g:0")
    assert gres.format_node_gres({"2g": 1}, other=["gpu:2"]) == "mig:2g:1,gpu:2"
    with pytest.raises(GeometryError):
        gres.format_node_gres({"5g": 1})
    with pytest.raises(GeometryError):
        gres.format_node_gres({"1g": -1})


def test_numbers_that_are_not_finite_read_as_unknown():
    assert parsers._num(float("inf")) is None and parsers._num(float("nan")) is None
    assert parsers._num({"set": True, "number": float("-inf")}) is None


def test_format_node_gres_with_padding_keeps_the_total():
    value = gres.format_node_gres({"1g": 2, "3g": 1}, include_all=True, pad_to=14)
    assert value.endswith(",mig:7g:0,mig:pad:11")
    parsed = gres.parse_node_gres(value)
    assert gres.mig_total(parsed) == 14 and parsed[gres.PAD_TYPE] == 11
    # A pad key in the counts is ignored when padding, formatted as is otherwise.
    assert gres.format_node_gres({"7g": 1, "pad": 3}, pad_to=7) == "mig:7g:1,mig:pad:6"
    assert gres.format_node_gres({"7g": 1, "pad": 3}) == "mig:7g:1,mig:pad:3"
    assert gres.format_node_gres({}, pad_to=0) == "mig:pad:0"
    with pytest.raises(GeometryError, match="do not fit"):
        gres.format_node_gres({"1g": 8}, pad_to=7)
    assert gres.padded_total(2) == 14


def test_parse_node_gres():
    assert gres.parse_node_gres("mig:1g:2,mig:3g:1(S:0)") == {"1g": 2, "3g": 1}
    assert gres.parse_node_gres("mig:1g:2(S:0-1),gpu:a100:1(S:0),mig:1g:1") == {"1g": 3}
    assert gres.parse_node_gres("mig:7g:0") == {"7g": 0}
    assert gres.parse_node_gres("(null)") == {} and gres.parse_node_gres(None) == {}
    assert gres.parse_node_gres("mig:1g:4(IDX:N/A)") == {"1g": 4}
    # format and parse round-trip
    counts = {"1g": 3, "1gdm": 1, "4g": 1}
    assert gres.parse_node_gres(gres.format_node_gres(counts)) == counts


def test_other_gres_and_split():
    assert gres.split_gres("mig:1g:2(S:0-1),gpu:1") == ["mig:1g:2(S:0-1)", "gpu:1"]
    assert gres.other_gres("mig:1g:2(S:0),gpu:a100:1(S:0),foo:3") == ["gpu:a100:1", "foo:3"]


@pytest.mark.parametrize("name,gtype", [
    ("3g.40gb", "3g"), ("MIG 3g.40gb", "3g"), ("3G.40GB", "3g"), ("1g.10gb", "1g"), ("1g.20gb", "1gdm"),
    ("1g.5gb+me", "1gme"), ("1g.5gb", "1g"), ("3g.71gb", "3g"), ("1g.6gb", "1g"), ("2g.12gb", "2g"),
    ("2g.12gb+me", "2gme"), ("4g.24gb", "4g"), ("7g.180gb", "7g"), ("1gdm", "1gdm"), ("7g", "7g"),
])
def test_profile_to_gres(name, gtype):
    assert gres.gres_type_for_profile(name) == gtype


def test_profile_table_covers_facts_and_has_no_dots_in_types():
    for model, table in gres.PROFILES_BY_MODEL.items():
        for name, gtype in table.items():
            assert gres.PROFILE_TO_GRES[name] == (gres.AMBIGUOUS_PROFILES.get(name) or gtype), (model, name)
    assert all("." not in t and "+" not in t for t in gres.GRES_TYPES)
    assert set(gres.PROFILE_TO_GRES.values()) <= set(gres.GRES_TYPES)
    # The one name whose meaning depends on the model.
    assert gres.PROFILES_BY_MODEL["A100-40GB"]["1g.10gb"] == "1gdm"
    assert gres.PROFILES_BY_MODEL["H100-80GB"]["1g.10gb"] == "1g"


def test_unknown_profile():
    with pytest.raises(GeometryError, match="unknown MIG profile"):
        gres.gres_type_for_profile("5g.50gb")


def test_kind_mapping():
    assert gres.gres_type_for_kind("1g+me") == "1gme" and gres.gres_type_for_kind("1g.dm") == "1gdm"
    assert gres.GRES_TO_KIND["2gme"] == "2g+me"
    with pytest.raises(GeometryError):
        gres.gres_type_for_kind("9g")


# `squeue --json` and `sinfo --json` (22.05.8) with slurmctld unreachable: exit status 0!
SQUEUE_JSON_CTLD_DOWN = r"""{"meta":{"plugin":{"type":"openapi\/v0.0.38","name":"Slurm OpenAPI v0.0.38"},"Slurm":{"version":{"major":22,"micro":8,"minor":5},"release":"22.05.8"}},"errors":[{"description":"Failed while looking for jobs","error_number":-1,"error":"Unspecified error","source":"slurm_load_jobs"}],"jobs":[]}"""
SINFO_JSON_CTLD_DOWN = r"""{"meta":{"plugin":{"type":"openapi\/v0.0.38","name":"Slurm OpenAPI v0.0.38"},"Slurm":{"version":{"major":22,"micro":8,"minor":5},"release":"22.05.8"}},"errors":[{"error":"Unspecified error","errno":-1}],"nodes":[]}"""


def test_json_errors_when_controller_down():
    assert parsers.json_errors(json.loads(SQUEUE_JSON_CTLD_DOWN)) == [
        "slurm_load_jobs Failed while looking for jobs Unspecified error"]
    assert parsers.json_errors(json.loads(SINFO_JSON_CTLD_DOWN)) == ["Unspecified error"]
    assert parsers.json_errors(json.loads(SQUEUE_JSON_22_05)) == []


@pytest.mark.parametrize("rc, out", [
    (0, SQUEUE_JSON_CTLD_DOWN),  # 22.05 with slurmctld down: exit 0, and errors
    (0, '{"meta": {}, "errors": []}'),  # no list at all is not an empty one
    (0, '[]'), (0, 'not json'), (1, SQUEUE_JSON_22_05), (0, '{"errors": "x", "jobs": []}')])
def test_a_failed_slurm_query_is_stale_data_not_an_empty_queue(monkeypatch, rc, out):
    """What squeue/sinfo print when they could not ask slurmctld must read as None (keep the last state),
    never as "no jobs" or "no nodes", which would cancel every pending job."""
    from slurm_mig.slurm.runner import SlurmClient, SlurmResult

    monkeypatch.setattr(SlurmClient, "run", lambda self, argv, **kw: SlurmResult(tuple(argv), rc, out, "", 0.0))
    client = SlurmClient()
    assert client.jobs() is None
    nodes_out = out.replace("jobs", "nodes") if out != SQUEUE_JSON_22_05 else SINFO_JSON_22_05
    if out == SQUEUE_JSON_CTLD_DOWN:
        nodes_out = SINFO_JSON_CTLD_DOWN
    monkeypatch.setattr(SlurmClient, "run", lambda self, argv, **kw: SlurmResult(tuple(argv), rc, nodes_out, "", 0.0))
    assert client.nodes() is None


def test_a_healthy_slurm_query_parses_and_a_timed_out_one_does_not(monkeypatch):
    from slurm_mig.slurm.runner import SlurmClient, SlurmResult

    result = SlurmResult(("squeue",), 0, SQUEUE_JSON_22_05, "", 0.0)
    monkeypatch.setattr(SlurmClient, "run", lambda self, argv, **kw: result)
    assert [j.job_id for j in SlurmClient().jobs()] == [19, 20, 21, 22, 23]
    result = SlurmResult(("squeue",), 0, SQUEUE_JSON_22_05, "", 10.0, timed_out=True)
    assert SlurmClient().jobs() is None


def test_parse_scontrol_kv_and_mig_request():
    fields = parsers.parse_scontrol_kv(SCONTROL_JOB20_D_ONELINE)
    assert fields["JobId"] == "20" and fields["TresPerNode"] == "gres:mig:1g:2"
    assert "GRES" not in fields  # per-node detail is not a top-level field
    assert parsers.parse_mig_request(fields) == ("1g", 2)
    assert parsers.parse_mig_request({"tres_per_node": "gres:foo:1,gres:mig:3g:1"}) == ("3g", 1)
    assert parsers.parse_mig_request({"TresPerNode": ""}) is None
    assert parsers.parse_scontrol_kv("A=1 B=two words") == {"A": "1", "B": "two words"}


# `scontrol -d show step` on Slurm 22.05 (the demo cluster), in a `mig:1g:2` job: a step run with
# `srun --gres=mig:1g:1`, and one with `--gres=none` (a step run without --gres shows the job's mig:1g:2).
STEP_WITH_GRES = """StepId=1.0 UserId=0 StartTime=2026-11-22T12:02:12 TimeLimit=UNLIMITED
   State=RUNNING Partition=debug NodeList=n1
   Nodes=1 CPUs=1 Tasks=1 Name=bash Network=(null)
   TRES=cpu=1,mem=0,node=1
   ResvPorts=(null)
   CPUFreqReq=Default Dist=Cyclic
   SrunHost:Pid=vm:10878
   TresPerStep=cpu:1
   TresPerNode=gres:mig:1g:1
"""
STEP_GRES_NONE = """StepId=1.4 UserId=0 StartTime=2026-11-22T12:02:12 TimeLimit=UNLIMITED
   State=RUNNING Partition=debug NodeList=n1
   Nodes=1 CPUs=2 Tasks=1 Name=bash Network=(null)
   TRES=cpu=2,mem=0,node=1
   ResvPorts=(null)
   CPUFreqReq=Default Dist=Cyclic
   SrunHost:Pid=vm:10995
   TresPerStep=cpu:1
"""


def test_a_steps_mig_request_from_scontrol_show_step():
    from slurm_mig.slurm.parsers import parse_step_mig_request

    assert parse_step_mig_request(STEP_WITH_GRES) == {"1g": 1}
    assert parse_step_mig_request(STEP_GRES_NONE) is None
    assert parse_step_mig_request(STEP_WITH_GRES.replace("gres:mig:1g:1", "gres:gpu:1")) is None
    assert parse_step_mig_request("") is None


# -- where a job may run: --exclude, --nodelist, --constraint, --reservation, partitions -------------

# squeue --json on the demo cluster (22.05), four pending jobs, trimmed to the fields read here: sbatch
# --exclude=n1,n2; -C fast; --reservation=r1; -p debug,other.
SQUEUE_JSON_WHERE = r"""{"jobs":[
{"job_id":1,"job_state":"PENDING","partition":"debug","excluded_nodes":"n[1-2]","required_nodes":"","features":"","resv_name":"","tres_per_node":"gres:mig:2g:1","state_reason":"ReqNodeNotAvail","time_limit":null,"priority":4294901759,"submit_time":1795355438,"nodes":"","user_name":"root"},
{"job_id":3,"job_state":"PENDING","partition":"debug","excluded_nodes":"","required_nodes":"","features":"fast","resv_name":"","tres_per_node":"gres:mig:2g:1","state_reason":"ReqNodeNotAvail","time_limit":null,"priority":4294901757,"submit_time":1795355438,"nodes":"","user_name":"root"},
{"job_id":4,"job_state":"PENDING","partition":"debug","excluded_nodes":"","required_nodes":"n2","features":"","resv_name":"r1","tres_per_node":"gres:mig:1g:1","state_reason":"ReqNodeNotAvail","time_limit":60,"priority":4294901756,"submit_time":1795355438,"nodes":"","user_name":"root"},
{"job_id":5,"job_state":"PENDING","partition":"debug,other","excluded_nodes":"","required_nodes":"","features":"","resv_name":"","tres_per_node":"gres:mig:2g:1","state_reason":"ReqNodeNotAvail","time_limit":null,"priority":4294901755,"submit_time":1795355438,"nodes":"","user_name":"root"}]}"""

# sinfo --json on the same cluster (n3 given the feature "fast" with scontrol update), trimmed.
SINFO_JSON_WHERE = r"""{"nodes":[{"name":"capacity","state":"unknown","state_flags":["DRAIN"],"partitions":["debug","other"],"features":"","active_features":""},{"name":"n1","state":"idle","state_flags":[],"partitions":["debug"],"features":"","active_features":""},{"name":"n2","state":"idle","state_flags":[],"partitions":["debug"],"features":"","active_features":""},{"name":"n3","state":"idle","state_flags":[],"partitions":["debug","other"],"features":"fast,nvlink","active_features":"fast"}]}"""

# scontrol show reservation, and with -o, on the same cluster: r1 active on n2, a maintenance window on n1
# starting in an hour.
SCONTROL_RES = """ReservationName=r1 StartTime=2026-11-22T13:50:38 EndTime=2026-11-22T14:50:38 Duration=01:00:00
   Nodes=n2 NodeCnt=1 CoreCnt=8 Features=(null) PartitionName=(null) Flags=SPEC_NODES
   TRES=cpu=8
   Users=root Groups=(null) Accounts=(null) Licenses=(null) State=ACTIVE BurstBuffer=(null) Watts=n/a
   MaxStartDelay=(null)

ReservationName=maint1 StartTime=2026-11-22T14:50:38 EndTime=2026-11-22T15:50:38 Duration=01:00:00
   Nodes=n[1,4-5] NodeCnt=1 CoreCnt=8 Features=(null) PartitionName=(null) Flags=MAINT,SPEC_NODES
   TRES=cpu=8
   Users=root Groups=(null) Accounts=(null) Licenses=(null) State=INACTIVE BurstBuffer=(null) Watts=n/a
   MaxStartDelay=(null)

"""
SCONTROL_RES_O = (
    "ReservationName=r1 StartTime=2026-11-22T13:50:38 EndTime=2026-11-22T14:50:38 Duration=01:00:00 Nodes=n2 "
    "NodeCnt=1 CoreCnt=8 Features=(null) PartitionName=(null) Flags=SPEC_NODES TRES=cpu=8 Users=root "
    "Groups=(null) Accounts=(null) Licenses=(null) State=ACTIVE BurstBuffer=(null) Watts=n/a MaxStartDelay=(null)\n"
    "ReservationName=maint1 StartTime=2026-11-22T14:50:38 EndTime=2026-11-22T15:50:38 Duration=01:00:00 "
    "Nodes=n[1,4-5] NodeCnt=1 CoreCnt=8 Features=(null) PartitionName=(null) Flags=MAINT,SPEC_NODES TRES=cpu=8 "
    "Users=root Groups=(null) Accounts=(null) Licenses=(null) State=INACTIVE BurstBuffer=(null) Watts=n/a "
    "MaxStartDelay=(null)\n")


def test_squeue_json_where_a_job_may_run():
    jobs = {j.job_id: j for j in parsers.parse_squeue_json(json.loads(SQUEUE_JSON_WHERE))}
    assert jobs[1].excluded_nodes == ["n1", "n2"] and jobs[1].required_nodes == []
    assert jobs[1].features == "" and jobs[1].reservation == ""
    assert jobs[3].features == "fast"
    assert jobs[4].reservation == "r1" and jobs[4].required_nodes == ["n2"]
    assert jobs[5].partition == "debug,other"


def test_node_features_from_sinfo_and_scontrol():
    nodes = {n.name: n for n in parsers.parse_sinfo_json(json.loads(SINFO_JSON_WHERE))}
    assert nodes["n3"].features == {"fast"}  # the active ones, not every available one
    assert nodes["n1"].features == frozenset()
    newer = parsers.parse_sinfo_json({"nodes": [{"name": "g1", "active_features": ["a100", "ib"]},
                                                {"name": "g2", "features": "h100"}]})
    assert [n.features for n in newer] == [{"a100", "ib"}, {"h100"}]
    text = "NodeName=n3 AvailableFeatures=fast,nvlink ActiveFeatures=fast State=IDLE\n"
    assert parsers.parse_scontrol_nodes(text)[0].features == {"fast"}


def test_reservations_from_scontrol_both_forms():
    res = parsers.parse_reservations(SCONTROL_RES)
    assert res == parsers.parse_reservations(SCONTROL_RES_O)
    r1, maint = res
    assert (r1.name, r1.nodes, r1.active, r1.flags) == ("r1", {"n2"}, True, {"SPEC_NODES"})
    assert r1.end - r1.start == 3600
    assert r1.start == time.mktime((2026, 11, 22, 13, 50, 38, 0, 0, -1))  # scontrol prints local time
    assert (maint.nodes, maint.active, "MAINT" in maint.flags) == ({"n1", "n4", "n5"}, False, True)
    assert maint.start == r1.end
    assert parsers.parse_reservations("No reservations in the system\n") == []
    # A record whose times cannot be read restricts nothing, rather than every node.
    assert parsers.parse_reservations("ReservationName=x StartTime=soon EndTime=later Nodes=n1\n") == []


# squeue --json and sinfo --json on the demo cluster (2 nodes x 8 CPUs), trimmed: job 1 runs on n1 with
# -c 6; job 2 asks -c 4, job 3 -n 2 -c 3, job 4 --exclusive.
SQUEUE_JSON_CPUS = r"""{"jobs":[{"job_id":1,"job_state":"RUNNING","partition":"debug","tres_per_node":"gres:mig:3g:1","state_reason":"None","time_limit":525600,"priority":4294901759,"submit_time":1795356625,"nodes":"n1","user_name":"root","cpus":6,"shared":null,"tasks":1},{"job_id":2,"job_state":"PENDING","partition":"debug","tres_per_node":"gres:mig:1g:1","state_reason":"Resources","time_limit":null,"priority":4294901758,"submit_time":1795356629,"nodes":"","user_name":"root","cpus":4,"shared":null,"tasks":1},{"job_id":3,"job_state":"PENDING","partition":"debug","tres_per_node":"gres:mig:1g:1","state_reason":"ReqNodeNotAvail","time_limit":null,"priority":4294901757,"submit_time":1795356629,"nodes":"","user_name":"root","cpus":6,"shared":null,"tasks":2},{"job_id":4,"job_state":"PENDING","partition":"debug","tres_per_node":"gres:mig:1g:1","state_reason":"Priority","time_limit":null,"priority":4294901756,"submit_time":1795356629,"nodes":"","user_name":"root","cpus":1,"shared":"none","tasks":1}]}"""
SINFO_JSON_CPUS = r"""{"nodes":[{"name":"capacity","state":"unknown","state_flags":["DRAIN","NOT_RESPONDING"],"partitions":["debug"],"cpus":8,"alloc_cpus":0},{"name":"n1","state":"mixed","state_flags":[],"partitions":["debug"],"cpus":8,"alloc_cpus":6},{"name":"n2","state":"idle","state_flags":[],"partitions":["debug"],"cpus":8,"alloc_cpus":0}]}"""


def test_squeue_json_cpus_asked_and_exclusive():
    jobs = {j.job_id: j for j in parsers.parse_squeue_json(json.loads(SQUEUE_JSON_CPUS))}
    assert [(jobs[i].cpus, jobs[i].exclusive) for i in (1, 2, 3, 4)] == [(6, False), (4, False), (6, False),
                                                                         (1, True)]
    newer = parsers.parse_squeue_json({"jobs": [{"job_id": 5, "cpus": {"set": True, "number": 3},
                                                 "shared": ["none"]}]})
    assert (newer[0].cpus, newer[0].exclusive) == (3, True)


# -- output that is not UTF-8 ---------------------------------------------------------------------------

def _fake_command(tmp_path, monkeypatch, name: str, body: bytes) -> None:
    """Put an executable ``name`` first on PATH that writes ``body`` (raw bytes) and exits 0."""
    data = tmp_path / f"{name}.out"
    data.write_bytes(body)
    exe = tmp_path / name
    exe.write_text(f"#!/bin/sh\ncat '{data}'\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")


def test_a_job_whose_name_or_path_is_not_utf8_neither_breaks_squeue_nor_scontrol(tmp_path, monkeypatch):
    """Slurm prints names, comments and paths as the bytes it was given (json-c escapes only control
    characters; scontrol prints them as they are): a job from a latin-1 working directory, or named
    `sbatch -J $'caf\\xe9'`, must not turn every squeue of the controller's tick into an exception."""
    from slurm_mig.slurm.runner import SlurmClient

    squeue = (b'{"errors":[],"jobs":[{"job_id":7,"name":"caf\xe9","job_state":"PENDING",'
              b'"current_working_directory":"/home/jos\xe9","tres_per_node":"gres:mig:3g:1"}]}')
    _fake_command(tmp_path, monkeypatch, "squeue", squeue)
    jobs = SlurmClient().jobs()
    assert jobs is not None and [(j.job_id, j.mig, j.name) for j in jobs] == [(7, {"3g": 1}, "caf\ufffd")]
    scontrol = b"JobId=7 JobName=caf\xe9\n   JobState=PENDING Reason=Resources\n   TresPerNode=gres:mig:3g:1\n"
    _fake_command(tmp_path, monkeypatch, "scontrol", scontrol)
    detail = SlurmClient().scontrol_show_job(7)
    assert detail is not None and (detail.job_id, detail.mig) == (7, {"3g": 1})


def test_a_timed_out_command_with_undecodable_output_is_a_timeout_not_an_exception(tmp_path, monkeypatch):
    from slurm_mig.slurm.runner import run_slurm

    exe = tmp_path / "squeue"
    exe.write_text("#!/bin/sh\nprintf 'caf\\351\\n'\nprintf 'x\\351\\n' >&2\nexec sleep 30\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    res = run_slurm(["squeue", "--json"], timeout=1.0)
    assert res.timed_out and not res.ok and res.returncode == 124


# -- what a user writes into scontrol's text is never read as a field -----------------------------------

def _job19_with(**lines: str) -> str:
    """Job 19 of SCONTROL_JOBS_D (running mig:3g:1 on n1) with some lines replaced, as scontrol prints them."""
    text = SCONTROL_JOBS_D.split("\n\n")[0] + "\n\n"
    for old, new in lines.items():
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize("field, value", [
    ("JobName", "x TresPerNode=gres:mig:7g:2 NodeList=n9 Partition=gpu ArrayJobId=4 ArrayTaskId=2"),
    ("Command", "/home/u/run TresPerNode=gres:mig:7g:2 NodeList=n9 JobState=COMPLETED"),
    ("WorkDir", "/home/u/a TresPerNode=gres:mig:7g:2 Nodes=n9 CPU_IDs=0 Mem=0 GRES=mig:7g(CNT:2)"),
    ("StdOut", "/home/u/out TresPerNode=gres:mig:7g:2 NodeList=n9 ExitCode=9:0"),
])
def test_a_job_name_path_or_comment_that_spells_fields_is_read_as_that_text(field, value):
    """Slurm prints the job name, script, paths and comments as the user gave them (`sbatch -J 'x
    TresPerNode=gres:mig:7g:2'`, a path with spaces): read key by key, a job's own name set its MIG request,
    nodes, state or array task, and the Prolog of a job that asked Slurm for one 1g (or for no GPU at all)
    bound a whole 7g the next job's count still held."""
    line = {"JobName": "JobName=train", "Command": "Command=(null)", "WorkDir": "WorkDir=/tmp/cap",
            "StdOut": "StdOut=/tmp/cap/slurm-19.out"}[field]
    # As a job without --gres: scontrol then prints no TresPerNode line of its own.
    text = _job19_with(**{line: f"{field}={value}", "   TresPerNode=gres:mig:3g:1\n": ""})
    job, = parsers.parse_scontrol_jobs(text)
    assert job.fields[field] == value
    assert (job.mig, job.nodes, job.partition, job.state) == ({}, ["n1"], "debug", "RUNNING")
    assert job.node_gres == {"n1": {"3g": 1}}
    assert "ArrayJobId" not in job.fields and job.fields["ExitCode"] == "0:0"
    if field == "JobName":
        assert job.name == value
    # and with its real request: that one, not the text's
    job, = parsers.parse_scontrol_jobs(_job19_with(**{line: f"{field}={value}"}))
    assert job.mig == {"3g": 1} and job.nodes == ["n1"]


def test_free_text_fields_end_where_scontrol_ends_them():
    text = _job19_with(**{"   TresPerNode=gres:mig:3g:1\n": (
        "   Comment=see TresPerNode=gres:mig:7g:1 \n"
        "   MailUser=a ArrayJobId=4 MailType=x b MailType=END,FAIL\n"
        "   TresPerNode=gres:mig:3g:1\n")})
    job, = parsers.parse_scontrol_jobs(text)
    assert job.fields["Comment"] == "see TresPerNode=gres:mig:7g:1"
    assert (job.fields["MailUser"], job.fields["MailType"]) == ("a ArrayJobId=4 MailType=x b", "END,FAIL")
    assert "ArrayJobId" not in job.fields and job.mig == {"3g": 1}
    # the one-line form (-o) is read key by key, as before
    one, = parsers.parse_scontrol_jobs(SCONTROL_JOB20_D_ONELINE)
    assert one.job_id == 20 and one.mig == {"1g": 2}


def test_a_slurm_command_that_cannot_be_started_is_a_failed_query_not_an_exception(tmp_path, monkeypatch):
    """run_slurm never raises for its command's failure: a scontrol this user may not execute (or a fork
    refused under load) raised PermissionError/OSError through the tick and its `except SlurmMigError`
    handlers, where a failed command is stale data."""
    from slurm_mig.errors import SlurmCommandError
    from slurm_mig.slurm.runner import SlurmClient, run_slurm

    exe = tmp_path / "squeue"
    exe.write_text("#!/bin/sh\necho '{\"jobs\": []}'\n")
    exe.chmod(0o644)
    res = run_slurm([str(exe), "--json"])
    assert (res.ok, res.returncode, res.timed_out) == (False, 126, False) and "could not be run" in res.stderr
    monkeypatch.setenv("PATH", f"{tmp_path}:/nonexistent")
    assert SlurmClient().jobs() is None
    with pytest.raises(SlurmCommandError):
        SlurmClient().check([str(exe)])


# -- one job's record from squeue fields no user writes (SlurmClient.job_detail) --------------------------

# `squeue -h --states=all -j ID -O JOB_DETAIL_FORMAT` on this machine's Slurm 22.05.8, 2026-11-27: job 1
# `exit 3`; array 2 (`--array=1-2`, tasks 2 and 6), asked as "2"; job 3 `--gres=mig:1g:1` named
# $'a\n   TresPerNode=gres:mig:7g:1' (scontrol show job prints that name as two lines); job 4 held, named
# 'b|c|d' with a comment holding a newline and bars (neither is a field here); job 5 killed by SIGKILL; job 7
# (`sleep 600`) running, then after `scontrol requeue 7`: pending (its BeginTime 11 s on) with a restart count
# of 1 and a new submit time (04:28:18 before, 04:28:20 the requeue's), then running again. Reason is not asked
# (free text, test_job_detail_asks_for_no_field_whose_text_may_be_a_scripts_answer).
SQUEUE_DETAIL = {
    "1": "1|1|N/A|FAILED|debug|n1|n1|1|4294901759|365-00:00:00|N/A|2026-11-27T04:28:17|"
         "2026-11-27T04:28:18|2026-11-27T04:28:18|768|root|0|\n",
    "2": "2|2|2|COMPLETED|debug|n1|n1|1|4294901758|365-00:00:00|N/A|2026-11-27T04:28:17|2026-11-27T04:28:18|"
         "2026-11-27T04:28:18|0|root|0|\n6|2|1|COMPLETED|debug|n1|n1|1|4294901758|365-00:00:00|N/A|"
         "2026-11-27T04:28:17|2026-11-27T04:28:18|2026-11-27T04:28:18|0|root|0|\n",
    "3": "3|3|N/A|RUNNING|debug|n1|n1|1|4294901757|365-00:00:00|gres:mig:1g:1|2026-11-27T04:28:17|"
         "2026-11-27T04:28:18|2027-11-27T04:28:18|0|root|0|\n",
    "4": "4|4|N/A|PENDING|debug||n/a|1|0|UNLIMITED|N/A|2026-11-27T04:28:17|N/A|N/A|0|root|0|\n",
    "5": "5|5|N/A|FAILED|debug|n1|n1|1|4294901756|365-00:00:00|N/A|2026-11-27T04:28:17|"
         "2026-11-27T04:28:18|2026-11-27T04:28:18|9|root|0|\n",
    "7": "7|7|N/A|RUNNING|debug|n1|n1|1|4294901755|365-00:00:00|N/A|2026-11-27T04:28:18|"
         "2026-11-27T04:28:19|2027-11-27T04:28:19|0|root|0|\n",
    "7 requeued": "7|7|N/A|PENDING|debug||n/a|1|4294901755|UNLIMITED|N/A|2026-11-27T04:28:20|"
                  "2026-11-27T04:28:31|NONE|0|root|1|\n",
    "7 again": "7|7|N/A|RUNNING|debug|n1|n1|1|4294901755|365-00:00:00|N/A|2026-11-27T04:28:20|"
               "2026-11-27T04:28:31|2027-11-27T04:28:31|0|root|1|\n",
}


def test_job_detail_format_names_no_field_a_user_writes():
    from slurm_mig.slurm.parsers import JOB_DETAIL_FIELDS, JOB_DETAIL_FORMAT

    names = {n.lower() for n, _ in JOB_DETAIL_FIELDS}
    assert not names & {"name", "comment", "command", "workdir", "stdout", "stderr", "stdin", "admincomment",
                        "systemcomment", "mailuser", "container", "reservation", "features", "account", "wckey",
                        "reason", "reasonlist"}
    assert JOB_DETAIL_FORMAT.count("|") == len(JOB_DETAIL_FIELDS)


@pytest.mark.parametrize("asked,expect", [
    ("1", (1, "FAILED", {}, ["n1"], "3:0", None)),
    ("2", (2, "COMPLETED", {}, ["n1"], "0:0", ("2", "2"))),
    ("3", (3, "RUNNING", {"1g": 1}, ["n1"], "0:0", None)),
    ("4", (4, "PENDING", {}, [], "0:0", None)),
    ("5", (5, "FAILED", {}, ["n1"], "0:9", None)),
])
def test_parse_job_detail_on_literal_squeue_output(asked, expect):
    from slurm_mig.slurm.parsers import parse_job_detail, wait_status

    d = parse_job_detail(SQUEUE_DETAIL[asked], asked)
    array = (d.fields["ArrayJobId"], d.fields["ArrayTaskId"]) if "ArrayTaskId" in d.fields else None
    assert (d.job_id, d.state, d.mig, d.nodes, d.fields["ExitCode"], array) == expect
    assert d.partition == "debug" and d.user == "root" and d.name == ""
    assert wait_status(d.fields["ExitCode"]) == {"1": 768, "5": 9}.get(asked, 0)
    assert d.held == (asked == "4") and ("EndTime" in d.fields) == (asked != "4")


def test_parse_job_detail_reads_the_restart_count_a_requeue_makes():
    """squeue's RestartCnt (scontrol's Restarts): what tells job 7 requeued, with the new submit time Slurm gave
    it, from another job with its id (controller.runs.was_requeued)."""
    from slurm_mig.slurm.parsers import parse_job_detail

    runs = [parse_job_detail(SQUEUE_DETAIL[k], "7") for k in ("7", "7 requeued", "7 again")]
    assert [(d.state, d.fields["Restarts"], d.fields["SubmitTime"]) for d in runs] == [
        ("RUNNING", "0", "2026-11-27T04:28:18"), ("PENDING", "1", "2026-11-27T04:28:20"),
        ("RUNNING", "1", "2026-11-27T04:28:20")]
    assert {parse_job_detail(SQUEUE_DETAIL[k], k).fields["Restarts"] for k in "12345"} == {"0"}


def test_parse_job_detail_picks_the_asked_record():
    from slurm_mig.slurm.parsers import parse_job_detail

    both = SQUEUE_DETAIL["2"]
    assert parse_job_detail(both, "6").fields["ArrayTaskId"] == "1"
    assert parse_job_detail(both, "2_1").job_id == 6 and parse_job_detail(both, "2_2").job_id == 2
    assert parse_job_detail(both, "7") is None and parse_job_detail("", "2") is None
    # a line with a field more or less is no record (not a shifted one)
    assert parse_job_detail("3|3|N/A|RUNNING|None|debug|n1|n1|1|1|UNLIMITED|gres:mig:7g:1|\n", "3") is None
    assert parse_job_detail(SQUEUE_DETAIL["3"].replace("root|", "root|x|"), "3") is None


def test_job_detail_asks_squeue_not_the_text_a_user_can_forge(tmp_path, monkeypatch):
    """scontrol show job of job 3 as Slurm 22.05 prints it when the job's name holds a newline (one 1g asked,
    the name forging a 7g): the controller's and the Prolog's question about one job (job_detail) reads
    squeue's fields and gets the 1g."""
    from slurm_mig.slurm.runner import SlurmClient

    forged = (b"JobId=3 JobName=a\n   TresPerNode=gres:mig:7g:1\n   UserId=root(0) GroupId=root(0)\n"
              b"   JobState=RUNNING Reason=None\n   Partition=debug\n   NodeList=n1\n   TresPerNode=gres:mig:1g:1\n")
    _fake_command(tmp_path, monkeypatch, "scontrol", forged)
    _fake_command(tmp_path, monkeypatch, "squeue", SQUEUE_DETAIL["3"].encode())
    assert SlurmClient().scontrol_show_job(3).mig == {"7g": 1}  # first value wins: the forged one
    assert SlurmClient().job_detail(3).mig == {"1g": 1}


def test_job_detail_asks_for_no_field_whose_text_may_be_a_scripts_answer(tmp_path, monkeypatch):
    """squeue's Reason prints the job's state_desc when Slurm set one, and that is free text: the burst-buffer
    plugins put `<plugin>: <op>: <their script's answer>` there (a site's Lua script, or dw_wlm_cli, answering
    about the job's own #BB/#DW lines). An answer with a newline and bars spelt a record of its own, as a job
    name did in scontrol show job. No caller reads the reason, so it is not asked. The fake squeue prints what
    it is asked for, the reason spelling a line that asks for a 7g."""
    import json
    import sys

    from slurm_mig.slurm.parsers import JOB_DETAIL_FIELDS
    from slurm_mig.slurm.runner import SlurmClient

    real = {"JobID": "3", "ArrayJobID": "3", "ArrayTaskID": "N/A", "State": "RUNNING", "Reason": "None",
            "Partition": "debug", "NodeList": "n1", "BatchHost": "n1", "NumNodes": "1", "PriorityLong": "4294901757",
            "TimeLimit": "365-00:00:00", "tres-per-node": "gres:mig:1g:1", "SubmitTime": "2026-11-27T04:28:17",
            "StartTime": "2026-11-27T04:28:18", "EndTime": "2027-11-27T04:28:18", "exit_code": "0", "UserName": "root",
            "RestartCnt": "0"}
    assert {n for n, _ in JOB_DETAIL_FIELDS} <= set(real)
    forged = {**real, "tres-per-node": "gres:mig:7g:1"}
    data = tmp_path / "squeue.json"
    data.write_text(json.dumps({"real": real, "forged": forged}))
    exe = tmp_path / "squeue"
    exe.write_text(f"#!{sys.executable}\n" + """import json, sys
d = json.load(open(%r))
names = [f.split(":")[0] for f in sys.argv[sys.argv.index("-O") + 1].split(",")]
line = lambda v: "".join(v.get(n, "") + "|" for n in names)
real = dict(d["real"], Reason="burst_buffer/lua: slurm_bb_setup: no such pool\\n" + line(d["forged"]) + "\\nx")
sys.stdout.write(line(real) + "\\n")
""" % str(data))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    d = SlurmClient().job_detail(3)
    assert d is not None and (d.job_id, d.mig, d.state) == (3, {"1g": 1}, "RUNNING")


def test_slurm_commands_ignore_the_squeue_and_sinfo_variables_they_inherit(monkeypatch):
    """SQUEUE_USERS, SQUEUE_PARTITION, SQUEUE_STATES, SINFO_PARTITION or SLURM_CLUSTERS in the controller's (or a
    hook's) environment filtered what squeue and sinfo list: the tick would not see other users' jobs, and a
    job's own record could be missing. Only the formats were dropped before."""
    from slurm_mig.slurm.runner import slurm_env

    for var, value in (("SQUEUE_USERS", "nobody"), ("SQUEUE_PARTITION", "other"), ("SQUEUE_STATES", "R"),
                       ("SQUEUE_ARRAY", "1"), ("SINFO_PARTITION", "other"), ("SLURM_CLUSTERS", "elsewhere"),
                       ("SCONTROL_ALL", "1"), ("SQUEUE_FORMAT", "%i"), ("SLURM_CONF", "/etc/slurm/x.conf")):
        monkeypatch.setenv(var, value)
    env = slurm_env()
    assert not [v for v in env if v.startswith(("SQUEUE_", "SINFO_", "SCONTROL_")) or v == "SLURM_CLUSTERS"]
    assert env["SLURM_CONF"] == "/etc/slurm/x.conf" and slurm_env(slurm_conf="/y")["SLURM_CONF"] == "/y"


@pytest.mark.parametrize("tz, text, want", [
    # The hour the clock goes back: two instants, the earlier one (summer time) whatever mktime guessed last.
    ("Europe/Berlin", "2026-10-25T02:30:00", 1792888200),
    ("America/New_York", "2026-11-01T01:30:00", 1793511000),
    # Any other time: its one instant, in summer and in winter.
    ("Europe/Berlin", "2026-07-01T12:00:00", 1782900000),
    ("Europe/Berlin", "2026-12-01T12:00:00", 1796122800),
])
def test_local_epoch_earliest_reads_a_time_the_clock_shows_twice_as_its_first_instant(monkeypatch, tz, text, want):
    monkeypatch.setenv("TZ", tz)
    time.tzset()
    try:
        for prime in ("2026-07-01T12:00:00", "2026-12-01T12:00:00"):  # glibc's guess follows its last call
            time.mktime(time.strptime(prime, "%Y-%m-%dT%H:%M:%S"))
            assert parsers.local_epoch(text, earliest=True) == want
    finally:
        monkeypatch.undo()
        time.tzset()


def test_local_epoch_latest_and_not_after_pick_among_a_times_two_instants(monkeypatch):
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        first, second = 1792888200, 1792888200 + 3600  # 2026-10-25 02:30:00 CEST, then CET
        for prime in ("2026-07-01T12:00:00", "2026-12-01T12:00:00"):  # glibc's guess follows its last call
            time.mktime(time.strptime(prime, "%Y-%m-%dT%H:%M:%S"))
            assert parsers.local_epoch("2026-10-25T02:30:00", latest=True) == second
            assert parsers.local_epoch("2026-10-25T02:30:00", not_after=second + 40) == second
            assert parsers.local_epoch("2026-10-25T02:30:00", not_after=second - 1) == first
            assert parsers.local_epoch("2026-10-25T02:30:00", not_after=first - 1) == first  # none past: the first
            # A time the clock shows once: its one instant, whatever is asked.
            assert parsers.local_epoch("2026-12-01T12:00:00", latest=True) == 1796122800
            assert parsers.local_epoch("2026-12-01T12:00:00", not_after=0) == 1796122800
    finally:
        monkeypatch.undo()
        time.tzset()


def test_scontrol_slurmd_start_time_in_the_hour_the_clock_goes_back_is_the_latest_not_after_now(monkeypatch):
    """SlurmdStartTime=2026-10-25T02:30:00 in Berlin names two instants an hour apart; it has passed when
    scontrol prints it, so it reads as the later one not after the time of reading (with slurmd's clock
    allowed PAST_SKEW_S ahead), never as mktime's guess, which follows its previous call (glibc)."""
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        first, second = 1792888200, 1792888200 + 3600  # 02:30:00 CEST, then CET
        text = "NodeName=n1 State=IDLE SlurmdStartTime=2026-10-25T02:30:00"
        for prime in ("2026-07-01T12:00:00", "2026-12-01T12:00:00"):  # glibc's guess follows its last call
            time.mktime(time.strptime(prime, "%Y-%m-%dT%H:%M:%S"))
            assert parsers.parse_scontrol_nodes(text, now=second + 5)[0].slurmd_start_time == second
            time.mktime(time.strptime(prime, "%Y-%m-%dT%H:%M:%S"))
            assert parsers.parse_scontrol_nodes(text, now=second - 600)[0].slurmd_start_time == first
            time.mktime(time.strptime(prime, "%Y-%m-%dT%H:%M:%S"))
            assert parsers.parse_scontrol_nodes(text, now=second - 30)[0].slurmd_start_time == second  # skew
    finally:
        monkeypatch.undo()
        time.tzset()
