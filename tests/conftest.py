"""Shared pytest fixtures (keep this small: area-specific fixtures live in their test modules)."""

from __future__ import annotations

import pytest


@pytest.fixture
def db():
    """A fresh, migrated in-memory state store (slurm_mig.store.Store), closed after the test."""
    from slurm_mig.store import open_store

    store = open_store(":memory:")
    try:
        yield store
    finally:
        store.close()
