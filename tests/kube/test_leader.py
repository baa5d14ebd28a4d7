"""Leader election on a Lease of the fake API server, with intervals of a fraction of a second."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from lightkube import AsyncClient
from lightkube.resources.coordination_v1 import Lease

from stoker.control.leader import LeaderElector
from tests.deadlines import deadline
from tests.kube.conftest import NAMESPACE, TOKEN, Cluster_

# Renewals come fast, but a leader tolerates a stall of renew_deadline_s (5.75 s) before it steps
# down: on a loaded CI machine the event loop can stop for a second, and a test must not read
# that as a lost lease. Only the takeover test waits out a whole lease.
FAST = {"lease_s": 6.0, "renew_s": 0.25}
WITHIN_S = deadline(30)  # generous bound on any event-driven wait


class Replica:
    """One controller replica: its elector, and events for when it starts and stops leading."""

    def __init__(self, client: AsyncClient, identity: str, **options) -> None:
        self.elector = LeaderElector(client, NAMESPACE, "stoker-controller", identity, **{**FAST, **options})
        self.leading, self.stopped = asyncio.Event(), asyncio.Event()
        self.task = asyncio.create_task(self.elector.run(self._lead, self._stop))

    async def _lead(self) -> None:
        self.leading.set()
        await asyncio.Event().wait()  # the control loops, until cancelled

    async def _stop(self) -> None:
        self.stopped.set()

    async def crash(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def first(*events: asyncio.Event) -> None:
    waits = [asyncio.create_task(e.wait()) for e in events]
    await asyncio.wait_for(asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED), WITHIN_S)
    for w in waits:
        w.cancel()


@pytest.fixture
async def controller(cluster: Cluster_) -> AsyncIterator[AsyncClient]:
    """A client with the controller's service account, as each replica has."""
    client = AsyncClient(config=cluster.config_for("controller"), namespace=NAMESPACE)
    yield client
    await client.close()


async def holder(cluster: Cluster_) -> Lease:
    return await cluster.client.get(Lease, "stoker-controller", namespace=NAMESPACE)


async def test_one_of_two_leads_and_the_other_takes_over_only_once_the_lease_expired(
    cluster: Cluster_, controller: AsyncClient
) -> None:
    a = Replica(controller, "a", release_on_exit=False)
    b = Replica(controller, "b", release_on_exit=False)
    await first(a.leading, b.leading)
    leader, follower = (a, b) if a.leading.is_set() else (b, a)
    await asyncio.sleep(5 * FAST["renew_s"])  # several renewals: still one leader
    assert leader.elector.is_leader and not follower.elector.is_leader and not follower.leading.is_set()
    before = (await holder(cluster)).spec
    assert before.holderIdentity == leader.elector.identity and before.leaseTransitions == 0

    await leader.crash()  # no release: the follower must wait out the lease
    await asyncio.wait_for(follower.leading.wait(), WITHIN_S)
    after = (await holder(cluster)).spec
    assert after.holderIdentity == follower.elector.identity and after.leaseTransitions == 1
    assert (after.acquireTime - before.renewTime).total_seconds() >= FAST["lease_s"]
    await follower.crash()
    assert follower.stopped.is_set()


async def test_a_leader_that_stops_releases_the_lease(cluster: Cluster_, controller: AsyncClient) -> None:
    a = Replica(controller, "a")
    await asyncio.wait_for(a.leading.wait(), WITHIN_S)
    await a.crash()
    assert a.stopped.is_set() and not a.elector.is_leader
    spec = (await holder(cluster)).spec
    assert spec.holderIdentity is None


async def test_a_leader_that_cannot_renew_steps_down(cluster: Cluster_, controller: AsyncClient) -> None:
    a = Replica(controller, "a", release_on_exit=False)
    await asyncio.wait_for(a.leading.wait(), WITHIN_S)
    account = cluster.api.tokens.pop(TOKEN)  # the token revoked: every request of `a` is now 401
    try:
        await asyncio.wait_for(a.task, WITHIN_S)  # `run` returns once it stopped leading
    finally:
        cluster.api.tokens[TOKEN] = account
    assert a.stopped.is_set() and not a.elector.is_leader


async def test_a_write_that_lost_the_race_is_a_409_and_leaves_the_other_leading(
    cluster: Cluster_, controller: AsyncClient
) -> None:
    """`a` reads the lease; `b` takes it before `a` writes; `a`'s write carries a stale version."""
    b = LeaderElector(controller, NAMESPACE, "stoker-controller", "b", **FAST)
    assert await b._try_acquire_or_renew()
    await cluster.client.patch(
        Lease, "stoker-controller", {"spec": {"holderIdentity": None}}, namespace=NAMESPACE
    )  # free, so that `a` wants it

    class RacingClient:
        """The real client, but `b` renews between `a`'s read and `a`'s write."""

        async def get(self, *args, **kwargs):
            lease = await controller.get(*args, **kwargs)
            assert await b._try_acquire_or_renew()
            return lease

        def __getattr__(self, name: str):
            return getattr(controller, name)

    a = LeaderElector(RacingClient(), NAMESPACE, "stoker-controller", "a", **FAST)  # type: ignore[arg-type]
    conflicts = len([r for r in cluster.api.responses if r == 409])
    assert not await a._try_acquire_or_renew()
    assert len([r for r in cluster.api.responses if r == 409]) == conflicts + 1
    assert not a.is_leader and b.is_leader
    assert (await holder(cluster)).spec.holderIdentity == "b"
