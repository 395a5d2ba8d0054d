"""A controller newer than its nodes (admin-guide.md section 10: upgrade the controller first, then the nodes).

The messages below are literal samples of what an older node sends, captured from its own code: the node
side of commit 711b2b4 (2026-11-22, the last node code before 2026-11-26; its messages are those of every
node since 4f45e16, when the credential became slurm-mig/2) ran its real hooks (Prolog, Epilog, health
check, outbox) on simulated H100s, in a process of their own with that commit's tree on PYTHONPATH, against
this controller's ApiServer (HMAC), and each request body was recorded with the controller's answer. The
same run checked the wire itself (slurm-mig/2 credentials, signed answers, a node key per node): the old
node signed, verified and acted on every answer; nothing went to its outbox as refused. Nodes before
4f45e16 (2026-11-21, slurm-mig/1) are refused at the credential (401), as admin-guide.md says.

Replayed here in order, at the times the controller handled them, each message must be taken (200) and do
what it did for the node that sent it, and each answer must still be one that node reads: the fields its
code reads (a Prolog's action, instances, targets, requeued and reason; a report's desired layouts and
release list), the layouts in the form its parse_layout reads. The samples are literal, as those of
Slurm's output are (tests/test_slurm_parsers.py), so this needs no git history.
"""

from __future__ import annotations

import pytest

from slurm_mig.api.auth import HmacAuth
from slurm_mig.api.client import ControllerClient
from slurm_mig.api.server import ApiServer
from slurm_mig.config import Config
from slurm_mig.controller.service import Controller
from slurm_mig.mig.layout import parse_layout
from slurm_mig.mig.profiles import get_model
from slurm_mig.store import open_store

KEY = b"k" * 64
H100 = get_model("H100-80GB")

# What the tests below set up on the controller's side when the capture did, at its time: a job's MIG request
# (as a tick stores it) or a desired layout (as the policy sets it).
SETUP = [
    {'desired': [1, '1g@0,1g@1,1g@2,1g@3,1g@4,1g@5,1g@6'], 'at': 1795745265.1215801},
    {'job': '1', 'kind': '7g', 'count': 1, 'at': 1795745265.471601},
    {'job': '2', 'kind': '1g', 'count': 1, 'at': 1795745266.0705037},
    {'job': '3', 'kind': '1g', 'count': 1, 'at': 1795745266.7361066},
    {'job': '4', 'kind': '4g', 'count': 1, 'at': 1795745273.5827172},
    {'job': '5', 'kind': '1g', 'count': 1, 'at': 1795745274.0510626},
    {'job': '6', 'kind': '2g', 'count': 1, 'at': 1795745274.6106567},
]

# (step, route, when the controller handled it, the node's message, the controller's answer the node acted on)
MESSAGES = [
    ('report', '/v1/report', 1795745265.069191,
     {'bindings': {},
      'node': 'n1',
      'observed': [
          {'index': 0,
           'instances': [
               {'in_use': False, 'profile': '3g.40gb', 'start': 0, 'uuid': 'MIG-97475222-38ca-4957-b2fd-47633e38b37a'},
               {'in_use': False, 'profile': '2g.20gb', 'start': 4, 'uuid': 'MIG-22072c03-44b1-4817-ad89-9352238c3c8f'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-62247342-bd52-43a8-b8b4-888d3f916100'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-9da078e7-cfde-41cd-b09b-4a759f698ec8'},
          {'index': 1,
           'instances': [
               {'in_use': False, 'profile': '3g.40gb', 'start': 0, 'uuid': 'MIG-9b0f727b-28ed-4041-ad7a-2fa33bbe5ba2'},
               {'in_use': False, 'profile': '2g.20gb', 'start': 4, 'uuid': 'MIG-4f1ba9b2-26f2-4165-be5a-be48f5e84f41'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-586d4515-3190-43aa-83ca-b5a4b78e9e01'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-e4b67071-f439-488b-ab5d-a9adc7349621'}],
      'observed_at': 1795745265.0661182,
      'time': 1795745265.0663695},
     {'desired': {}, 'release': []}),
    ('report-apply', '/v1/report', 1795745265.4427786,
     {'bindings': {},
      'node': 'n1',
      'observed': [
          {'index': 0,
           'instances': [
               {'in_use': False, 'profile': '3g.40gb', 'start': 0, 'uuid': 'MIG-97475222-38ca-4957-b2fd-47633e38b37a'},
               {'in_use': False, 'profile': '2g.20gb', 'start': 4, 'uuid': 'MIG-22072c03-44b1-4817-ad89-9352238c3c8f'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-62247342-bd52-43a8-b8b4-888d3f916100'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-9da078e7-cfde-41cd-b09b-4a759f698ec8'},
          {'index': 1,
           'instances': [
               {'in_use': False, 'profile': '3g.40gb', 'start': 0, 'uuid': 'MIG-9b0f727b-28ed-4041-ad7a-2fa33bbe5ba2'},
               {'in_use': False, 'profile': '2g.20gb', 'start': 4, 'uuid': 'MIG-4f1ba9b2-26f2-4165-be5a-be48f5e84f41'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-586d4515-3190-43aa-83ca-b5a4b78e9e01'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-e4b67071-f439-488b-ab5d-a9adc7349621'}],
      'observed_at': 1795745265.4295435,
      'time': 1795745265.4298456},
     {'desired': {'1': '1g@0,1g@1,1g@2,1g@3,1g@4,1g@5,1g@6'}, 'release': []}),
    ('report-apply', '/v1/applied', 1795745265.455143,
     {'node': 'n1',
      'observed': [
          {'index': 0,
           'instances': [
               {'in_use': False, 'profile': '3g.40gb', 'start': 0, 'uuid': 'MIG-97475222-38ca-4957-b2fd-47633e38b37a'},
               {'in_use': False, 'profile': '2g.20gb', 'start': 4, 'uuid': 'MIG-22072c03-44b1-4817-ad89-9352238c3c8f'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-62247342-bd52-43a8-b8b4-888d3f916100'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-9da078e7-cfde-41cd-b09b-4a759f698ec8'},
          {'index': 1,
           'instances': [
               {'in_use': False, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 1, 'uuid': 'MIG-97120a6f-9f52-4d78-9efe-0b4255a04ca8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 2, 'uuid': 'MIG-11bae404-91f7-4ade-996f-b1b80fd5cae0'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 3, 'uuid': 'MIG-f87bae14-07f0-4cc1-ab91-562a295f3fbd'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 4, 'uuid': 'MIG-305a348c-fd66-4879-adad-808bb2922f42'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 5, 'uuid': 'MIG-672d7c1b-adba-4656-89c7-7f0711b8962c'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-586d4515-3190-43aa-83ca-b5a4b78e9e01'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-e4b67071-f439-488b-ab5d-a9adc7349621'}],
      'observed_at': 1795745265.4538383,
      'results': [
          {'after': '1g@0,1g@1,1g@2,1g@3,1g@4,1g@5,1g@6',
           'before': '3g@0,2g@4,1g@6',
           'done': [
               'destroy 3g.40gb@0',
               'destroy 2g.20gb@4',
               'create 1g.10gb@0',
               'create 1g.10gb@1',
               'create 1g.10gb@2',
               'create 1g.10gb@3',
               'create 1g.10gb@4',
               'create 1g.10gb@5'],
           'dry_run': False,
           'error': None,
           'error_type': None,
           'failed': None,
           'gpu': 1,
           'model': 'H100-80GB',
           'ok': True,
           'plan': [
               'destroy 3g.40gb@0',
               'destroy 2g.20gb@4',
               'create 1g.10gb@0',
               'create 1g.10gb@1',
               'create 1g.10gb@2',
               'create 1g.10gb@3',
               'create 1g.10gb@4',
               'create 1g.10gb@5'],
           'reached': True,
           'target': '1g@0,1g@1,1g@2,1g@3,1g@4,1g@5,1g@6'}],
      'time': 1795745265.453995},
     {'ok': True}),
    ('prolog-recarve', '/v1/prolog', 1795745265.634756,
     {'bindings': {},
      'job_id': '1',
      'node': 'n1',
      'observed': [
          {'index': 0,
           'instances': [
               {'in_use': False, 'profile': '3g.40gb', 'start': 0, 'uuid': 'MIG-97475222-38ca-4957-b2fd-47633e38b37a'},
               {'in_use': False, 'profile': '2g.20gb', 'start': 4, 'uuid': 'MIG-22072c03-44b1-4817-ad89-9352238c3c8f'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-62247342-bd52-43a8-b8b4-888d3f916100'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-9da078e7-cfde-41cd-b09b-4a759f698ec8'},
          {'index': 1,
           'instances': [
               {'in_use': False, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 1, 'uuid': 'MIG-97120a6f-9f52-4d78-9efe-0b4255a04ca8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 2, 'uuid': 'MIG-11bae404-91f7-4ade-996f-b1b80fd5cae0'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 3, 'uuid': 'MIG-f87bae14-07f0-4cc1-ab91-562a295f3fbd'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 4, 'uuid': 'MIG-305a348c-fd66-4879-adad-808bb2922f42'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 5, 'uuid': 'MIG-672d7c1b-adba-4656-89c7-7f0711b8962c'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-586d4515-3190-43aa-83ca-b5a4b78e9e01'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-e4b67071-f439-488b-ab5d-a9adc7349621'}],
      'observed_at': 1795745265.6246226},
     {'action': 'bind', 'instances': [{'gpu': 0, 'profile': '7g.80gb', 'start': 0}], 'targets': {'0': '7g@0'}}),
    ('prolog-recarve', '/v1/bound', 1795745265.7227488,
     {'bound_at': 1795745265.710272,
      'instances': [{'gpu': 0, 'profile': '7g.80gb', 'start': 0, 'uuid': 'MIG-f6791d33-e689-439b-9f61-1c961e079f2a'}],
      'job_id': '1',
      'local': False,
      'node': 'n1',
      'observed': [
          {'index': 0,
           'instances': [
               {'in_use': True, 'profile': '7g.80gb', 'start': 0, 'uuid': 'MIG-f6791d33-e689-439b-9f61-1c961e079f2a'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-9da078e7-cfde-41cd-b09b-4a759f698ec8'},
          {'index': 1,
           'instances': [
               {'in_use': False, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 1, 'uuid': 'MIG-97120a6f-9f52-4d78-9efe-0b4255a04ca8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 2, 'uuid': 'MIG-11bae404-91f7-4ade-996f-b1b80fd5cae0'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 3, 'uuid': 'MIG-f87bae14-07f0-4cc1-ab91-562a295f3fbd'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 4, 'uuid': 'MIG-305a348c-fd66-4879-adad-808bb2922f42'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 5, 'uuid': 'MIG-672d7c1b-adba-4656-89c7-7f0711b8962c'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-586d4515-3190-43aa-83ca-b5a4b78e9e01'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-e4b67071-f439-488b-ab5d-a9adc7349621'}],
      'observed_at': 1795745265.7182896},
     {'ok': True}),
    ('epilog', '/v1/epilog', 1795745266.0498586,
     {'binding_unreadable': False,
      'derived_ec': None,
      'end_time': 1795745266.0246549,
      'exit_code': 0,
      'instances': [{'gpu': 0, 'profile': '7g.80gb', 'start': 0, 'uuid': 'MIG-f6791d33-e689-439b-9f61-1c961e079f2a'}],
      'job_id': '1',
      'lingering': [],
      'node': 'n1',
      'requeued': False},
     {'ok': True, 'recorded': True}),
    ('prolog', '/v1/prolog', 1795745266.2266998,
     {'bindings': {},
      'job_id': '2',
      'node': 'n1',
      'observed': [
          {'index': 0,
           'instances': [
               {'in_use': False, 'profile': '7g.80gb', 'start': 0, 'uuid': 'MIG-f6791d33-e689-439b-9f61-1c961e079f2a'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-9da078e7-cfde-41cd-b09b-4a759f698ec8'},
          {'index': 1,
           'instances': [
               {'in_use': False, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 1, 'uuid': 'MIG-97120a6f-9f52-4d78-9efe-0b4255a04ca8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 2, 'uuid': 'MIG-11bae404-91f7-4ade-996f-b1b80fd5cae0'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 3, 'uuid': 'MIG-f87bae14-07f0-4cc1-ab91-562a295f3fbd'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 4, 'uuid': 'MIG-305a348c-fd66-4879-adad-808bb2922f42'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 5, 'uuid': 'MIG-672d7c1b-adba-4656-89c7-7f0711b8962c'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-586d4515-3190-43aa-83ca-b5a4b78e9e01'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-e4b67071-f439-488b-ab5d-a9adc7349621'}],
      'observed_at': 1795745266.2225666},
     {'action': 'bind', 'instances': [{'gpu': 1, 'profile': '1g.10gb', 'start': 0}], 'targets': {}}),
    ('prolog', '/v1/bound', 1795745266.262769,
     {'bound_at': 1795745266.258293,
      'instances': [{'gpu': 1, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'}],
      'job_id': '2',
      'local': False,
      'node': 'n1'},
     {'ok': True}),
    ('outbox-report', '/v1/epilog', 1795745267.8066084,
     {'binding_unreadable': False,
      'derived_ec': None,
      'end_time': 1795745266.4544039,
      'exit_code': 256,
      'instances': [{'gpu': 1, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'}],
      'job_id': '2',
      'lingering': [],
      'node': 'n1',
      'requeued': False},
     {'ok': True, 'recorded': True}),
    ('outbox-report', '/v1/bound', 1795745267.8113801,
     {'bound_at': 1795745267.3435168,
      'instances': [{'gpu': 1, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'}],
      'job_id': '3',
      'local': True,
      'node': 'n1'},
     {'ok': True}),
    ('outbox-report', '/v1/report', 1795745267.8170385,
     {'bindings': {'3': [{'gpu': 1, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'}]},
      'node': 'n1',
      'observed': [
          {'index': 0,
           'instances': [
               {'in_use': False, 'profile': '7g.80gb', 'start': 0, 'uuid': 'MIG-f6791d33-e689-439b-9f61-1c961e079f2a'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-9da078e7-cfde-41cd-b09b-4a759f698ec8'},
          {'index': 1,
           'instances': [
               {'in_use': True, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 1, 'uuid': 'MIG-97120a6f-9f52-4d78-9efe-0b4255a04ca8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 2, 'uuid': 'MIG-11bae404-91f7-4ade-996f-b1b80fd5cae0'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 3, 'uuid': 'MIG-f87bae14-07f0-4cc1-ab91-562a295f3fbd'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 4, 'uuid': 'MIG-305a348c-fd66-4879-adad-808bb2922f42'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 5, 'uuid': 'MIG-672d7c1b-adba-4656-89c7-7f0711b8962c'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-586d4515-3190-43aa-83ca-b5a4b78e9e01'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-e4b67071-f439-488b-ab5d-a9adc7349621'}],
      'observed_at': 1795745267.8140917,
      'time': 1795745267.8145118},
     {'desired': {}, 'release': []}),
    ('epilog-lingering', '/v1/epilog', 1795745273.2905874,
     {'binding_unreadable': False,
      'derived_ec': None,
      'end_time': 1795745273.234817,
      'exit_code': 0,
      'instances': [{'gpu': 1, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'}],
      'job_id': '3',
      'lingering': [{'gpu': 1, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'}],
      'node': 'n1',
      'requeued': False},
     {'ok': True, 'recorded': True}),
    ('bind-failed', '/v1/prolog', 1795745273.984908,
     {'bindings': {'3': [{'gpu': 1, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'}]},
      'job_id': '4',
      'node': 'n1',
      'observed': [
          {'index': 0,
           'instances': [
               {'in_use': False, 'profile': '7g.80gb', 'start': 0, 'uuid': 'MIG-f6791d33-e689-439b-9f61-1c961e079f2a'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-9da078e7-cfde-41cd-b09b-4a759f698ec8'},
          {'index': 1,
           'instances': [
               {'in_use': False, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 1, 'uuid': 'MIG-97120a6f-9f52-4d78-9efe-0b4255a04ca8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 2, 'uuid': 'MIG-11bae404-91f7-4ade-996f-b1b80fd5cae0'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 3, 'uuid': 'MIG-f87bae14-07f0-4cc1-ab91-562a295f3fbd'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 4, 'uuid': 'MIG-305a348c-fd66-4879-adad-808bb2922f42'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 5, 'uuid': 'MIG-672d7c1b-adba-4656-89c7-7f0711b8962c'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-586d4515-3190-43aa-83ca-b5a4b78e9e01'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-e4b67071-f439-488b-ab5d-a9adc7349621'}],
      'observed_at': 1795745273.9768763},
     {'action': 'bind', 'instances': [{'gpu': 0, 'profile': '4g.40gb', 'start': 0}], 'targets': {'0': '4g@0'}}),
    ('bind-failed', '/v1/bind-failed', 1795745274.0156415,
     {'job_id': '4',
      'node': 'n1',
      'results': [
          {'after': 'empty',
           'before': '7g@0',
           'done': ['destroy 7g.80gb@0'],
           'dry_run': False,
           'error': 'injected InsufficientResources on create (GPU 0)',
           'error_type': 'InsufficientResources',
           'failed': 'create 4g.40gb@0',
           'gpu': 0,
           'model': 'H100-80GB',
           'ok': False,
           'plan': ['destroy 7g.80gb@0', 'create 4g.40gb@0'],
           'reached': False,
           'target': '4g@0'}]},
     {'ok': True}),
    ('epilog-requeued', '/v1/prolog', 1795745274.2750673,
     {'bindings': {'3': [{'gpu': 1, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'}]},
      'job_id': '5',
      'node': 'n1',
      'observed': [
          {'index': 0,
           'instances': [],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-9da078e7-cfde-41cd-b09b-4a759f698ec8'},
          {'index': 1,
           'instances': [
               {'in_use': False, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 1, 'uuid': 'MIG-97120a6f-9f52-4d78-9efe-0b4255a04ca8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 2, 'uuid': 'MIG-11bae404-91f7-4ade-996f-b1b80fd5cae0'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 3, 'uuid': 'MIG-f87bae14-07f0-4cc1-ab91-562a295f3fbd'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 4, 'uuid': 'MIG-305a348c-fd66-4879-adad-808bb2922f42'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 5, 'uuid': 'MIG-672d7c1b-adba-4656-89c7-7f0711b8962c'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-586d4515-3190-43aa-83ca-b5a4b78e9e01'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-e4b67071-f439-488b-ab5d-a9adc7349621'}],
      'observed_at': 1795745274.2674358},
     {'action': 'bind', 'instances': [{'gpu': 1, 'profile': '1g.10gb', 'start': 1}], 'targets': {}}),
    ('epilog-requeued', '/v1/bound', 1795745274.2994287,
     {'bound_at': 1795745274.2982504,
      'instances': [{'gpu': 1, 'profile': '1g.10gb', 'start': 1, 'uuid': 'MIG-97120a6f-9f52-4d78-9efe-0b4255a04ca8'}],
      'job_id': '5',
      'local': False,
      'node': 'n1'},
     {'ok': True}),
    ('epilog-requeued', '/v1/epilog', 1795745274.5694885,
     {'binding_unreadable': False,
      'derived_ec': None,
      'end_time': 1795745274.526377,
      'exit_code': 0,
      'instances': [{'gpu': 1, 'profile': '1g.10gb', 'start': 1, 'uuid': 'MIG-97120a6f-9f52-4d78-9efe-0b4255a04ca8'}],
      'job_id': '5',
      'lingering': [],
      'node': 'n1',
      'requeued': True},
     {'ok': True, 'recorded': False}),
    ('epilog-unreadable', '/v1/prolog', 1795745274.822898,
     {'bindings': {'3': [{'gpu': 1, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'}]},
      'job_id': '6',
      'node': 'n1',
      'observed': [
          {'index': 0,
           'instances': [],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-9da078e7-cfde-41cd-b09b-4a759f698ec8'},
          {'index': 1,
           'instances': [
               {'in_use': False, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 1, 'uuid': 'MIG-97120a6f-9f52-4d78-9efe-0b4255a04ca8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 2, 'uuid': 'MIG-11bae404-91f7-4ade-996f-b1b80fd5cae0'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 3, 'uuid': 'MIG-f87bae14-07f0-4cc1-ab91-562a295f3fbd'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 4, 'uuid': 'MIG-305a348c-fd66-4879-adad-808bb2922f42'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 5, 'uuid': 'MIG-672d7c1b-adba-4656-89c7-7f0711b8962c'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-586d4515-3190-43aa-83ca-b5a4b78e9e01'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-e4b67071-f439-488b-ab5d-a9adc7349621'}],
      'observed_at': 1795745274.8185945},
     {'action': 'bind', 'instances': [{'gpu': 0, 'profile': '2g.20gb', 'start': 4}], 'targets': {'0': '4g@0,2g@4'}}),
    ('epilog-unreadable', '/v1/bound', 1795745274.8637595,
     {'bound_at': 1795745274.8582592,
      'instances': [{'gpu': 0, 'profile': '2g.20gb', 'start': 4, 'uuid': 'MIG-f789c57e-7a8d-41d5-8a03-b6d5f1848a5e'}],
      'job_id': '6',
      'local': False,
      'node': 'n1',
      'observed': [
          {'index': 0,
           'instances': [
               {'in_use': True, 'profile': '2g.20gb', 'start': 4, 'uuid': 'MIG-f789c57e-7a8d-41d5-8a03-b6d5f1848a5e'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-9da078e7-cfde-41cd-b09b-4a759f698ec8'},
          {'index': 1,
           'instances': [
               {'in_use': False, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 1, 'uuid': 'MIG-97120a6f-9f52-4d78-9efe-0b4255a04ca8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 2, 'uuid': 'MIG-11bae404-91f7-4ade-996f-b1b80fd5cae0'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 3, 'uuid': 'MIG-f87bae14-07f0-4cc1-ab91-562a295f3fbd'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 4, 'uuid': 'MIG-305a348c-fd66-4879-adad-808bb2922f42'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 5, 'uuid': 'MIG-672d7c1b-adba-4656-89c7-7f0711b8962c'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-586d4515-3190-43aa-83ca-b5a4b78e9e01'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-e4b67071-f439-488b-ab5d-a9adc7349621'}],
      'observed_at': 1795745274.8622646},
     {'ok': True}),
    ('epilog-unreadable', '/v1/epilog', 1795745275.1228004,
     {'binding_unreadable': True,
      'derived_ec': None,
      'end_time': 1795745275.083791,
      'exit_code': 0,
      'instances': [],
      'job_id': '6',
      'lingering': [],
      'node': 'n1',
      'requeued': False},
     {'ok': True, 'recorded': True}),
    ('report-lost', '/v1/report', 1795745275.5622766,
     {'bindings': {'3': [{'gpu': 1, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'}]},
      'node': 'n1',
      'observed': [
          {'index': 0,
           'instances': [],
           'lost': True,
           'mig_enabled': False,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-9da078e7-cfde-41cd-b09b-4a759f698ec8'},
          {'index': 1,
           'instances': [
               {'in_use': False, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 1, 'uuid': 'MIG-97120a6f-9f52-4d78-9efe-0b4255a04ca8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 2, 'uuid': 'MIG-11bae404-91f7-4ade-996f-b1b80fd5cae0'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 3, 'uuid': 'MIG-f87bae14-07f0-4cc1-ab91-562a295f3fbd'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 4, 'uuid': 'MIG-305a348c-fd66-4879-adad-808bb2922f42'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 5, 'uuid': 'MIG-672d7c1b-adba-4656-89c7-7f0711b8962c'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-586d4515-3190-43aa-83ca-b5a4b78e9e01'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-e4b67071-f439-488b-ab5d-a9adc7349621'}],
      'observed_at': 1795745275.558802,
      'time': 1795745275.559019},
     {'desired': {'0': '4g@0,2g@4'}, 'release': []}),
    ('report-lost', '/v1/applied', 1795745275.5719342,
     {'node': 'n1',
      'observed': [
          {'index': 0,
           'instances': [],
           'lost': True,
           'mig_enabled': False,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-9da078e7-cfde-41cd-b09b-4a759f698ec8'},
          {'index': 1,
           'instances': [
               {'in_use': False, 'profile': '1g.10gb', 'start': 0, 'uuid': 'MIG-687b25ce-442c-4dbd-8eef-1416111a53e8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 1, 'uuid': 'MIG-97120a6f-9f52-4d78-9efe-0b4255a04ca8'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 2, 'uuid': 'MIG-11bae404-91f7-4ade-996f-b1b80fd5cae0'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 3, 'uuid': 'MIG-f87bae14-07f0-4cc1-ab91-562a295f3fbd'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 4, 'uuid': 'MIG-305a348c-fd66-4879-adad-808bb2922f42'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 5, 'uuid': 'MIG-672d7c1b-adba-4656-89c7-7f0711b8962c'},
               {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-586d4515-3190-43aa-83ca-b5a4b78e9e01'}],
           'lost': False,
           'mig_enabled': True,
           'model': 'H100-80GB',
           'name': 'NVIDIA H100 80GB HBM3',
           'uuid': 'GPU-e4b67071-f439-488b-ab5d-a9adc7349621'}],
      'observed_at': 1795745275.5707521,
      'results': [
          {'error': 'GPU 0 has fallen off the bus (NVML_ERROR_GPU_IS_LOST)',
           'error_type': 'GpuLost',
           'gpu': 0,
           'ok': False,
           'target': '4g@0,2g@4'}],
      'time': 1795745275.5708756},
     {'ok': True}),
]
# A node of c64fe4c .. 1083d1e^ (2026-11-26): its report and Prolog request carry a driver's difference from
# the MIG table uncut (here GPU 1's, from a driver reading garbage placements).
C64FE4C_REPORT = (1795745299.6017191, {'binding_times': {},
 'bindings': {},
 'node': 'n1',
 'observed': [
     {'index': 0,
      'instances': [
          {'in_use': False, 'profile': '3g.40gb', 'start': 0, 'uuid': 'MIG-97475222-38ca-4957-b2fd-47633e38b37a'},
          {'in_use': False, 'profile': '2g.20gb', 'start': 4, 'uuid': 'MIG-22072c03-44b1-4817-ad89-9352238c3c8f'},
          {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-62247342-bd52-43a8-b8b4-888d3f916100'}],
      'lost': False,
      'mig_enabled': True,
      'model': 'H100-80GB',
      'name': 'NVIDIA H100 80GB HBM3',
      'uuid': 'GPU-9da078e7-cfde-41cd-b09b-4a759f698ec8'},
     {'index': 1,
      'instances': [
          {'in_use': False, 'profile': '3g.40gb', 'start': 0, 'uuid': 'MIG-9b0f727b-28ed-4041-ad7a-2fa33bbe5ba2'},
          {'in_use': False, 'profile': '2g.20gb', 'start': 4, 'uuid': 'MIG-4f1ba9b2-26f2-4165-be5a-be48f5e84f41'},
          {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-586d4515-3190-43aa-83ca-b5a4b78e9e01'}],
      'lost': False,
      'mig_enabled': True,
      'model': 'H100-80GB',
      'name': 'NVIDIA H100 80GB HBM3',
      'table_errors': [
          '2g.20gb: placements 4000000000:4000000000,4000000001:4000000001,4000000002:4000000002,4000000003:4000000003,4000000004:4000000004,4000000005:4000000005,4000000006:4000000006,4000000007:4000000007,4000000008:4000000008,4000000009:4000000009,4000000010:4000000010,4000000011:4000000011,4000000012:4000000012,4000000013:4000000013,4000000014:4000000014,4000000015:4000000015, ours {0,2,4}:2',
          "2g.20gb: a placement lies outside the model's 8 memory slices: 4000000000:4000000000,4000000001:4000000001,4000000002:4000000002,4000000003:4000000003,4000000004:4000000004,4000000005:4000000005,4000000006:4000000006,4000000007:4000000007,4000000008:4000000008,4000000009:4000000009,4000000010:4000000010,4000000011:4000000011,4000000012:4000000012,4000000013:4000000013,4000000014:4000000014,4000000015:4000000015"],
      'uuid': 'GPU-e4b67071-f439-488b-ab5d-a9adc7349621'}],
 'observed_at': 1795745299.5983257,
 'time': 1795745299.59895})
C64FE4C_PROLOG = (1795745299.853751, {'bindings': {},
 'job_id': '1',
 'node': 'n1',
 'observed': [
     {'index': 0,
      'instances': [
          {'in_use': False, 'profile': '3g.40gb', 'start': 0, 'uuid': 'MIG-97475222-38ca-4957-b2fd-47633e38b37a'},
          {'in_use': False, 'profile': '2g.20gb', 'start': 4, 'uuid': 'MIG-22072c03-44b1-4817-ad89-9352238c3c8f'},
          {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-62247342-bd52-43a8-b8b4-888d3f916100'}],
      'lost': False,
      'mig_enabled': True,
      'model': 'H100-80GB',
      'name': 'NVIDIA H100 80GB HBM3',
      'uuid': 'GPU-9da078e7-cfde-41cd-b09b-4a759f698ec8'},
     {'index': 1,
      'instances': [
          {'in_use': False, 'profile': '3g.40gb', 'start': 0, 'uuid': 'MIG-9b0f727b-28ed-4041-ad7a-2fa33bbe5ba2'},
          {'in_use': False, 'profile': '2g.20gb', 'start': 4, 'uuid': 'MIG-4f1ba9b2-26f2-4165-be5a-be48f5e84f41'},
          {'in_use': False, 'profile': '1g.10gb', 'start': 6, 'uuid': 'MIG-586d4515-3190-43aa-83ca-b5a4b78e9e01'}],
      'lost': False,
      'mig_enabled': True,
      'model': 'H100-80GB',
      'name': 'NVIDIA H100 80GB HBM3',
      'table_errors': [
          '2g.20gb: placements 4000000000:4000000000,4000000001:4000000001,4000000002:4000000002,4000000003:4000000003,4000000004:4000000004,4000000005:4000000005,4000000006:4000000006,4000000007:4000000007,4000000008:4000000008,4000000009:4000000009,4000000010:4000000010,4000000011:4000000011,4000000012:4000000012,4000000013:4000000013,4000000014:4000000014,4000000015:4000000015, ours {0,2,4}:2',
          "2g.20gb: a placement lies outside the model's 8 memory slices: 4000000000:4000000000,4000000001:4000000001,4000000002:4000000002,4000000003:4000000003,4000000004:4000000004,4000000005:4000000005,4000000006:4000000006,4000000007:4000000007,4000000008:4000000008,4000000009:4000000009,4000000010:4000000010,4000000011:4000000011,4000000012:4000000012,4000000013:4000000013,4000000014:4000000014,4000000015:4000000015"],
      'uuid': 'GPU-e4b67071-f439-488b-ab5d-a9adc7349621'}],
 'observed_at': 1795745299.8504348})


class Slurm:
    """slurmctld as the controller sees it here: no job it can describe (the store holds the requests, as a
    tick stored them); requeues recorded."""

    def __init__(self):
        self.calls: list[tuple] = []

    def jobs(self):
        return []

    def reservations(self):
        return []

    def nodes(self):
        return []

    def job_detail(self, job_id):
        return None

    def scontrol_requeue(self, job_id, **kw):
        self.calls.append(("requeue", str(job_id)))

    def update_node_gres(self, node, counts, **kw):
        self.calls.append(("gres", node))
        return ""


class Rig:
    def __init__(self, tmp_path):
        self.now = 0.0
        self.store = open_store(tmp_path / "state.db")
        self.slurm = Slurm()
        self.ctl = Controller(Config(), self.store, self.slurm, clock=lambda: self.now)
        self.srv = ApiServer("127.0.0.1", 0, HmacAuth(KEY), self.ctl.routes(), self.ctl.get_routes()).start()
        host, port = self.srv.address
        # Today's client, signing as every node since 4f45e16 does; the body is the captured message.
        self.client = ControllerClient(f"http://{host}:{port}", HmacAuth(KEY), "n1", retries=0)

    def send(self, route: str, at: float, payload: dict) -> dict:
        self.now = at
        return self.client.call(route, payload)

    def setup(self, step: dict) -> None:
        self.now = step["at"]
        if "job" in step:
            self.store.upsert_job(step["job"], profile=step["kind"], count=step["count"], user="alice", name="x",
                                  now=step["at"])
        else:
            gpu, layout = step["desired"]
            self.store.set_desired("n1", gpu, layout, "test", now=step["at"])

    def close(self):
        self.srv.stop()
        self.store.close()


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def _old_node_reads(route: str, answer: dict) -> None:
    """``answer`` holds what the old node's code reads from it, in the form it reads it."""
    assert isinstance(answer, dict)
    if route == "/v1/prolog":
        assert answer["action"] in ("bind", "requeue", "skip"), answer
        if answer["action"] == "bind":
            for i in answer["instances"]:
                assert type(i["gpu"]) is int and type(i["start"]) is int and isinstance(i["profile"], str), i
            for gpu, layout in (answer.get("targets") or {}).items():
                int(gpu)
                parse_layout(layout, H100)
        elif answer["action"] == "requeue":
            assert isinstance(answer.get("reason"), str) and isinstance(answer.get("requeued"), bool), answer
    elif route == "/v1/report":
        for gpu, layout in (answer.get("desired") or {}).items():
            int(gpu)
            parse_layout(layout, H100)
        assert all(isinstance(j, str) for j in answer.get("release") or []), answer


def _replay(rig: Rig, upto: str | None = None) -> dict[str, list[dict]]:
    """Replay SETUP and MESSAGES in the order they happened, up to the end of step ``upto`` (all: None); each
    step's answers."""
    setup = list(SETUP)
    answers: dict[str, list[dict]] = {}
    for n, (step, route, at, payload, acted_on) in enumerate(MESSAGES):
        while setup and setup[0]["at"] <= at:
            rig.setup(setup.pop(0))
        answer = rig.send(route, at, payload)  # ControllerRefused (4xx) or ControllerUnavailable fail the test
        _old_node_reads(route, answer)
        if route in ("/v1/prolog", "/v1/report"):
            # The node's next messages followed from this answer: another one makes the samples after it
            # something that node would not have sent.
            keys = ("action", "instances", "targets", "reason") if route == "/v1/prolog" else ("desired", "release")
            if route == "/v1/report":
                # A GPU the report says is lost is sent no desired layout since 2026-11-27 (the node's try at it
                # could only fail, as the sample's /v1/applied below shows; that message is still taken).
                lost = {str(g["index"]) for g in payload.get("observed") or () if g.get("lost")}
                acted_on = {**acted_on, "desired": {g: lay for g, lay in acted_on["desired"].items() if g not in lost}}
            assert {k: answer.get(k) for k in keys} == {k: acted_on.get(k) for k in keys}, (step, route)
        answers.setdefault(step, []).append(answer)
        if step == upto and (n + 1 == len(MESSAGES) or MESSAGES[n + 1][0] != step):
            break
    return answers


def _payload(step: str, route: str) -> dict:
    return next(p for s, r, _, p, _ in MESSAGES if (s, r) == (step, route))


def _layout(rig: Rig, gpu: int) -> str:
    return str(rig.store.observed_layout("n1", gpu))


def test_every_message_of_the_older_node_is_taken_and_answered_in_a_form_it_reads(rig):
    answers = _replay(rig)
    assert set(answers) == {s for s, *_ in MESSAGES}
    assert rig.store.open_journal_entries() == []


def test_its_health_reports_and_layout_results(rig):
    _replay(rig, upto="report-apply")
    # The first report stored both GPUs as the node saw them; the second was answered with GPU 1's desired
    # layout, and the node's /v1/applied (results, and the GPUs as the change left them) was recorded.
    assert [(g.gpu, g.model, g.mig_enabled, g.blocked) for g in rig.store.observed_gpus("n1")] == \
        [(0, "H100-80GB", True, None), (1, "H100-80GB", True, None)]
    assert _layout(rig, 0) == "3g@0,2g@4,1g@6" and _layout(rig, 1) == "1g@0,1g@1,1g@2,1g@3,1g@4,1g@5,1g@6"
    (applied,) = rig.store.recent_events(kind="applied")
    assert applied.message == "n1/1: 3g@0,2g@4,1g@6 -> 1g@0,1g@1,1g@2,1g@3,1g@4,1g@5,1g@6", applied.message


def test_its_prolog_and_bound(rig):
    _replay(rig, upto="prolog-recarve")
    # The Prolog re-carved GPU 0 for job 1's 7g and said so with /v1/bound: the binding has the instance's
    # UUID, the GPU its new layout, and the re-carve's entry is closed.
    (b,) = rig.store.bound_instances("1")
    sent = _payload("prolog-recarve", "/v1/bound")["instances"][0]
    assert (b.gpu, b.profile, b.start, b.uuid) == (0, "7g.80gb", 0, sent["uuid"])
    assert rig.store.get_job("1").state == "RUNNING" and rig.store.get_job("1").node == "n1"
    assert _layout(rig, 0) == "7g@0" and rig.store.open_journal_entries() == []
    assert [e.state for e in rig.store.journal_entries()] == ["done"]


def test_its_epilogs(rig):
    _replay(rig, upto="epilog-unreadable")
    one, two, three, six = (rig.store.outcome(j) for j in ("1", "2", "3", "6"))
    assert (one.state, one.exit_code, one.node) == ("COMPLETED", 0, "n1")
    assert (one.end_time, one.instances[0].profile) == (_payload("epilog", "/v1/epilog")["end_time"], "7g.80gb")
    # An exit status of 1 (Slurm's 256), sent from the outbox after the controller was unreachable.
    assert (two.state, two.exit_code) == ("FAILED", 256)
    # Ended with a process left on its instance: recorded, and said.
    assert three.state == "COMPLETED"
    assert [e.message for e in rig.store.recent_events(kind="lingering", job_id="3")] != []
    # The attempt Slurm requeued records no outcome; its instance is free again.
    assert rig.store.outcome("5") is None and rig.store.bound_instances("5") == ()
    # The node could not read its binding record: the instances are the controller's.
    assert six.state == "COMPLETED" and [(i.gpu, i.profile, i.start) for i in six.instances] == [(0, "2g.20gb", 4)]
    assert rig.store.live_bindings("n1") == []


def test_a_binding_it_made_alone_is_adopted_from_its_outbox(rig):
    _replay(rig, upto="outbox-report")
    sent = _payload("outbox-report", "/v1/bound")
    assert sent["local"] is True
    (b,) = rig.store.bound_instances("3")
    assert (b.gpu, b.profile, b.start, b.uuid) == (1, "1g.10gb", 0, sent["instances"][0]["uuid"])
    job = rig.store.get_job("3")
    assert (job.state, job.node, job.start_time) == ("RUNNING", "n1", sent["bound_at"])


def test_its_bind_failure_requeues_the_job_and_closes_the_recarve(rig):
    _replay(rig, upto="bind-failed")
    job = rig.store.get_job("4")
    assert job.state == "REQUEUED" and rig.store.bound_instances("4") == ()
    entry = next(e for e in rig.store.journal_entries() if e.to_layout == "4g@0")
    assert entry.state == "failed" and "InsufficientResources" in (entry.error or "")


def test_a_lost_gpu_in_its_report(rig):
    _replay(rig)
    # GPU 0 fell off the bus: reported lost with no instances. The report abandons its reconfiguration (the old
    # node's try at the desired layout there, sent before 2026-11-27, failed: its /v1/applied is still taken).
    lost = _payload("report-lost", "/v1/report")["observed"][0]
    assert lost["lost"] is True and lost["instances"] == []
    entry = [e for e in rig.store.journal_entries() if e.gpu == 0][0]
    assert entry.state == "abandoned" and "lost" in entry.error and entry.to_layout == "4g@0,2g@4", entry
    assert 0 not in rig.store.desired("n1")
    assert _layout(rig, 1) == "1g@0,1g@1,1g@2,1g@3,1g@4,1g@5,1g@6"


def test_a_node_of_2026_11_26_with_an_uncut_mig_table_difference_is_served(rig):
    """Nodes of c64fe4c up to 1083d1e (2026-11-26) sent a driver's differences from our MIG table uncut: ~380
    characters from a driver reading garbage placements. The controller refused every report and Prolog
    request of such a node (422, '... expected a string of at most 300 characters'), so every job Slurm
    started there was requeued, on its agreeing GPU too. It now cuts such a difference as a newer node does
    and takes the rest: the GPU is blocked with the reason, the other GPU serves the Prolog."""
    at, report = C64FE4C_REPORT
    assert max(len(e) for e in report["observed"][1]["table_errors"]) > 300
    assert rig.send("/v1/report", at, report) == {"desired": {}, "release": []}
    gpu0, gpu1 = rig.store.observed_gpus("n1")
    longer = next(e for e in report["observed"][1]["table_errors"] if len(e) > 300)
    assert gpu0.blocked is None and longer[:297] + "..." in gpu1.blocked and longer not in gpu1.blocked
    at, prolog = C64FE4C_PROLOG
    rig.store.upsert_job("1", profile="1g", count=1, user="alice", name="x", now=at - 1)
    answer = rig.send("/v1/prolog", at, prolog)
    _old_node_reads("/v1/prolog", answer)
    assert answer["action"] == "bind" and [i["gpu"] for i in answer["instances"]] == [0], answer
