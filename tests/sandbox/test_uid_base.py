"""JAXRL_SANDBOX_UID_BASE: where slot uids are leased from, with a clear error for a bad value."""

from __future__ import annotations

import pytest

from jaxrl.sandbox import LocalSandboxPool
from jaxrl.sandbox.plan import UID_BASE_ENV, UidLease, default_uid_base


def test_default_and_override(monkeypatch):
    monkeypatch.delenv(UID_BASE_ENV, raising=False)
    assert default_uid_base() == 60000
    monkeypatch.setenv(UID_BASE_ENV, "70001")
    assert default_uid_base() == 70001
    lease = UidLease(default_uid_base())
    try:
        assert 70001 <= lease.uid < 70001 + 4096
    finally:
        lease.release()


@pytest.mark.parametrize("bad", ["sixty", "12.5", "0", "999", str(2**31)])
def test_a_bad_value_names_the_variable_and_the_range(monkeypatch, bad):
    monkeypatch.setenv(UID_BASE_ENV, bad)
    with pytest.raises(ValueError, match=rf"{UID_BASE_ENV} must be an integer uid in "
                                         rf"\[1000, \d+\], got '{bad}'"):
        default_uid_base()


def test_a_pool_leases_its_slot_uids_from_it(monkeypatch):
    monkeypatch.setenv(UID_BASE_ENV, "71000")
    with LocalSandboxPool(1, tier="B") as pool:
        if not pool.slot_uids:
            pytest.skip("not root: tier B jobs run as the pool's own uid")
        assert pool.uid_base == 71000 and 71000 <= pool.slot_uids[0] < 71000 + 4096
