"""The three `--swap-policy` rules through a real router (router/lifecycle/swap.py), on one arrival
order that tells them apart, with `--models-max 1` and two fake workers a and b:

    a is busy (a stream held open); then, in this order, b1, a2 and b3 arrive.

- fifo (requests in arrival order, a swap per head of the queue): a2 arrived before b3, so b's
  first load serves b1 alone, a loads again for a2, then b again for b3: loads b, a, b.
- fifo-batch (the router's rule before the scheduler): b's load serves b1 and b3: loads b, a.
- fair (serve the loaded model first): a is not swapped out while busy (within the bound), so a2
  is served by the a that is up, and one load of b serves b1 and b3: loads b.

The loads come from /models/sse, every change in order (a load of a third model, z, marks the
end); each arrival is waited for (the model's `waiting` count in /v1/models) before the next is
sent, so the order is the test's, not the box's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from tests.router.conftest import HeldStream, RouterProc, fake_model
from tests.router.test_router_groups import complete, watching
from tests.util import wait_until

# A long answer (~2 MB of chunks), so that the held stream fills the socket buffers and stays in flight.
LONG = ("--tokens", "20000")


@pytest.mark.parametrize(
    ("policy", "loads"), [("fifo", ["b", "a", "b"]), ("fifo-batch", ["b", "a"]), ("fair", ["b"])]
)
def test_each_swap_policy_loads_in_its_own_order(
    router_factory: Callable[..., RouterProc], policy: str, loads: list[str]
) -> None:
    # A bound far past the test's length: under fair, b must not become overdue while a is held
    # (a loaded box may take seconds between the steps); the FIFO rules drain at once anyway.
    preset = fake_model("a", *LONG) + fake_model("b") + fake_model("z")
    r = router_factory(preset, "--models-max", "1", "--swap-policy", policy, "--swap-max-wait", "300",
                       "--swap-max-passes", "100")
    complete(r, "a")
    threads: list[threading.Thread] = []

    def send(name: str, arrived: Callable[[], bool]) -> None:
        t = threading.Thread(target=complete, args=(r, name))
        t.start()
        threads.append(t)
        wait_until(arrived, 30, what=f"the request for {name} to arrive")

    def count(name: str) -> int:
        card = r.models()[name]
        return int(card["waiting"]) + int(card["in_flight"])

    with watching(r) as w, HeldStream(r, "a") as held:
        wait_until(lambda: r.models()["a"]["in_flight"] == 1, 30, what="a's stream")
        send("b", lambda: count("b") == 1)
        if policy != "fair":  # the FIFO rules drain a at once, but a's next request must find it so
            wait_until(lambda: "model a: draining for a queued model" in r.log(), 30, what="a to drain")
        send("a", lambda: count("a") == 2 or not threads[-1].is_alive())  # fair serves it at once
        send("b", lambda: count("b") == 2)
        held.finish()
        for t in threads:
            t.join(120)
            assert not t.is_alive()
        # The events trail the answers: a load of z, asked for now, is the last one, so once the
        # watcher has it, it has every load before it.
        complete(r, "z")
        wait_until(lambda: w.saw("z", "loaded"), 30, what="z loaded on /models/sse")
    seen: list[str] = []
    last: dict[str, str] = {"a": "loaded"}
    for snapshot in w.history:
        for name, value in snapshot.items():
            if value == "loaded" and last.get(name) != "loaded" and name != "z":
                seen.append(name)
            last[name] = value
    assert seen == loads, w.history
