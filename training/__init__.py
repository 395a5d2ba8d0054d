"""Offline training of the ``rl`` policy (see training/README.md and docs/rl-policy.md).

Needs the training extra: ``pip install torch==2.13.0`` first, then ``pip install -e '.[train]'``.
"""
