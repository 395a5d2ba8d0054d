"""The node-to-controller channel: a small authenticated HTTP/JSON API.

GPU nodes cannot open the controller's SQLite file, so node hooks talk to the
controller over HTTP. Every request carries a credential that proves who sent
it: a MUNGE credential (every Slurm node already runs munged with the cluster
key) or, where MUNGE is not available, an HMAC over the request with a shared
key file. See docs/node-channel.md for the design and its threat model.
"""

# What the controller's GET /healthz answers (200, text/plain): `status` and `top` take only this as "ok", not any
# 200 from whatever else listens on the port.
HEALTHZ_BODY = b"ok\n"
