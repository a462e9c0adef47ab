"""The worker's heartbeat, off the training thread's critical path (EDL §4.2,
Elan §V-D): rank 0's progress heartbeat, which also reads the published
switch plan and carries the worker's reports to the master, and every rank's
liveness beats for the master's hung-worker check.

Threads (who writes what):

* ``tidal-heartbeat`` (every rank once joined; only rank 0 talks to the
  master): writes progress to and reads the plan from the master's TCPStore
  at most once per step and per interval; owns :attr:`Heartbeat.endpoint`
  (it follows a master handover: a frozen :class:`StoreEndpoint` replaced
  whole) and :attr:`Heartbeat.rtts_ms`; hands the plan it saw to the
  training thread through :class:`~tidal.runtime.membership.SwitchAgreement`
  (lock); posts what :class:`Outbox` holds (lock). On the other ranks it only
  prefetches the agreed plan before the switch step.
* ``tidal-beat`` (every rank from registration on): writes (beat count, step,
  phase) to ``tidal/<job>/alive/<worker>`` every :data:`ALIVE_EVERY_S`; owns
  the beat count.
* training thread: writes :attr:`Heartbeat.phase` (a tuple replaced whole),
  puts reports into the :class:`Outbox`, wakes the heartbeat (an event; a
  step end only once the interval is over) and
  runs :class:`StragglerWatch` (rank 0). The heartbeat thread reads its
  progress through the ``progress`` callback (single attribute reads).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tidal.runtime import abortable
from tidal.runtime.client import MasterClient, MasterUnavailable
from tidal.runtime.membership import Agreement, Membership
from tidal.runtime.messages import Generation, SwitchPlan
from tidal.runtime.stragglers import StragglerDetector

log = logging.getLogger(__name__)

ALIVE_EVERY_S = 0.5  # liveness beats of every rank (hung-worker detection)


@dataclass(frozen=True)
class StoreEndpoint:
    """Where the master's store is and the keys this job uses in it."""

    host: str
    port: int
    plan_key: str
    progress_key: str
    job: str

    @classmethod
    def from_json(cls, info: dict[str, Any]) -> "StoreEndpoint":
        """From the answer to ``POST /register`` or ``GET /store``."""
        return cls(str(info["store_host"]), int(info["store_port"]), str(info["plan_key"]),
                   str(info["progress_key"]), str(info["job"]))

    def alive_key(self, worker_id: str) -> str:
        return f"tidal/{self.job}/alive/{worker_id}"


class Outbox:
    """Reports of the training thread, posted to the master by the heartbeat
    thread: the latest switch (``/switched``), new stragglers
    (``/straggler``, in order) and the agreed switch step (``/agreed``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._switched: dict[str, Any] | None = None
        self._agreed: tuple[int, int] | None = None
        self._stragglers: deque[dict[str, Any]] = deque()

    def switched(self, body: dict[str, Any]) -> None:
        with self._lock:
            self._switched = body  # replaces an older one not posted yet

    def agreed(self, gen: int, switch_step: int) -> None:
        with self._lock:
            self._agreed = (gen, switch_step)

    def straggler(self, report: dict[str, Any]) -> None:
        with self._lock:
            self._stragglers.append(report)

    def post(self, client: MasterClient) -> None:
        """Heartbeat thread: post what is pending. A switch report stays
        pending until its post succeeds."""
        with self._lock:
            body = self._switched
        if body is not None:
            client.post("/switched", body)
            with self._lock:
                if self._switched is body:  # a newer one may have replaced it meanwhile
                    self._switched = None
        while True:
            with self._lock:
                rep = self._stragglers.popleft() if self._stragglers else None
            if rep is None:
                break
            client.post("/straggler", rep)
        with self._lock:
            agreed, self._agreed = self._agreed, None
        if agreed is not None:
            client.post("/agreed", {"gen": agreed[0], "switch_step": agreed[1]})

    def flush_switched(self, client: MasterClient) -> None:
        """At close, with the heartbeat stopped: post a switch report still pending."""
        with self._lock:
            body, self._switched = self._switched, None
        if body is not None:
            client.post("/switched", body)


@dataclass
class StragglerWatch:
    """Rank 0, training thread: feeds each step's per-rank compute times
    (reduced with the gradients) to the detector (EDL §5.2) and returns the
    reports of new stragglers; ``reports`` is what this worker reported."""

    worker_id: str
    detector: StragglerDetector = field(default_factory=StragglerDetector)
    gen: int = 0
    reports: list[dict[str, Any]] = field(default_factory=list)

    def check(self, times: Sequence[float], g: Generation, step: int) -> list[dict[str, Any]]:
        if self.gen != g.gen:
            self.detector.reset()
            self.gen = g.gen
        new = []
        for r, ratio in self.detector.update(times):
            log.warning("worker %s: rank %d (%s) is a straggler (%.2fx the median compute time)",
                        self.worker_id, r, g.members[r], ratio)
            new.append({"worker_id": g.members[r], "gen": g.gen, "step": step, "ratio": ratio,
                        "detected_at": time.time()})
        self.reports.extend(new)
        return new


class Heartbeat:
    """The heartbeat and liveness threads of one worker (see the module
    docstring). ``progress(gen)`` gives the progress rank 0 writes."""

    def __init__(self, membership: Membership, interval_s: float,
                 progress: Callable[[Generation], dict[str, Any]]) -> None:
        self.membership = membership
        self.interval_s = interval_s  # at most one heartbeat per interval (and per step)
        self.progress = progress
        self.outbox = Outbox()
        self.endpoint: StoreEndpoint | None = None
        self._endpoint_url = ""  # the master URL the endpoint was fetched from
        # what the training thread is doing, for the master's hung-worker check:
        # ("join" | "compute" | "sync" | "idle", step)
        self.phase: tuple[str, int] = ("idle", 0)
        self.beats = 0
        self.rtts_ms: deque[float] = deque(maxlen=100_000)
        self._wake = threading.Event()
        self._due = 0.0  # perf_counter time from which a step end wakes the heartbeat thread
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ training thread
    def start_beats(self, endpoint: StoreEndpoint) -> None:
        """From registration on: liveness beats, in their own thread so that
        nothing else (HTTP calls of the heartbeat thread, a long state
        transfer) delays them."""
        self.endpoint = endpoint
        self._endpoint_url = self.membership.client.url if self.membership.client is not None else ""
        self._start(self._beat_loop, "tidal-beat")

    def start(self) -> None:
        """Once joined: the heartbeat thread."""
        self._start(self._loop, "tidal-heartbeat")

    def _start(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def wake(self) -> None:
        """Training thread, at each step end: wake the heartbeat thread if
        its interval is over (a thread hand-off per exchange, not per step)."""
        if time.perf_counter() >= self._due:
            self._wake.set()

    def wake_now(self) -> None:
        """Wake the heartbeat thread now (a non-zero rank prefetches the agreed plan)."""
        self._wake.set()

    def report_switched(self, body: dict[str, Any]) -> None:
        self.outbox.switched(body)
        self._wake.set()

    def report_agreed(self, gen: int, switch_step: int) -> None:
        self.outbox.agreed(gen, switch_step)
        self._wake.set()

    def report_straggler(self, report: dict[str, Any]) -> None:
        self.outbox.straggler(report)
        self._wake.set()

    def stop(self) -> None:
        """Stop both threads (idempotent)."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []

    # ------------------------------------------------------------------ liveness thread
    def _beat_loop(self) -> None:
        self._beat()  # at once: from now on this worker can be judged
        while not self._stop.wait(ALIVE_EVERY_S):
            self._beat()

    def _beat(self) -> None:
        """Write (beat count, step, phase) to the master's store, where its
        hung-worker check watches it, and read whether the master aborted
        this worker's generation (a member went silent: the training thread
        leaves its collective, :mod:`tidal.runtime.abortable`). A stopped
        process stops beating; a training thread stuck in compute keeps the
        same (step, "compute") while its peers wait in "sync"."""
        self.beats += 1
        if not self.follow_master():
            return  # the master moved and is not up yet: try again at the next beat
        ep, (what, step), g = self.endpoint, self.phase, self.membership.seat.gen
        assert ep is not None
        beat, key = json.dumps([self.beats, step, what]), ep.alive_key(self.membership.worker_id)
        watch = g is not None and not abortable.SIGNAL.requested(g.gen)
        abort_key = g.prefix + "abort" if g is not None else ""

        def exchange(store: Any) -> bytes | None:
            store.set(key, beat)
            return store.peek(abort_key) if watch else None

        try:
            why = self.membership.stores.call(ep.host, ep.port, "beat", exchange)
            if why is not None and g is not None:
                abortable.SIGNAL.request(g.gen, why.decode())
        except Exception as e:  # noqa: BLE001 - the master may be restarting, or its host is gone
            log.debug("liveness beat failed: %s", e)
            self.membership.stores.drop(ep.host, ep.port, "beat")
            self.relocate()

    def relocate(self) -> None:
        """The master's store failed: if the master moved to another host
        (``$TIDAL_MASTER_FILE`` names a new address), follow it now rather
        than at this worker's next HTTP call, which may be minutes away."""
        client = self.membership.client
        if client is not None:
            client.relocate()
        self.follow_master()

    def follow_master(self) -> bool:
        """The master client found the master at a new address (it restarted
        on another host): fetch the store endpoint there. Any thread; the
        endpoint is replaced whole. False while the moved master's store is
        not known yet (it is starting): the old one is gone, do not wait on it."""
        client = self.membership.client
        if client is None or client.url == self._endpoint_url:
            return True
        try:
            url = client.url
            self.endpoint = StoreEndpoint.from_json(client.request("GET", "/store", patience_s=2.0)[1])
            self._endpoint_url = url
            log.info("worker %s: the master's store is at %s:%d now", self.membership.worker_id,
                     self.endpoint.host, self.endpoint.port)
        except Exception as e:  # noqa: BLE001 - not up yet: the next failure tries again
            log.debug("store endpoint of the moved master: %s", e)
        return client.url == self._endpoint_url

    # ------------------------------------------------------------------ heartbeat thread
    def _loop(self) -> None:
        """Rank 0 writes progress and reads the published plan (two C++ store
        round trips, GIL released), so the training thread never waits for
        the master; the other ranks prefetch the agreed plan."""
        seen_raw = b""
        while not self._stop.is_set():
            # the training thread wakes this thread at the first step end after ``_due``
            # (a report or a plan to prefetch wakes it at once): one exchange per
            # interval at most, and the steps in between wake nobody
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            if self._stop.is_set():
                break
            seat = self.membership.seat
            ag = self.membership.agreement.agreed
            if ag is not None and ag.plan is None:
                self._prefetch(ag)
            self._due = time.perf_counter() + self.interval_s
            if seat.rank != 0 or seat.gen is None:
                continue
            try:
                raw = self._exchange(seat.gen)
            except Exception as e:  # noqa: BLE001
                # the master (and its store) may be restarting (Elan §V-D): reconnect on the next beat
                log.warning("heartbeat failed: %s", e)
                ep = self.endpoint
                assert ep is not None
                self.membership.stores.drop(ep.host, ep.port, "hb")
                self.relocate()
                time.sleep(0.2)
                continue
            if raw and raw != seen_raw:
                seen_raw = b"" if self._read_plan(raw, seat.gen) else raw

    def _prefetch(self, ag: Agreement) -> None:
        """Non-zero ranks: fetch the agreed plan before the switch step."""
        assert self.membership.client is not None
        try:
            plan = SwitchPlan.from_json(self.membership.client.get("/plan", gen=ag.gen)["plan"])
        except Exception as e:  # noqa: BLE001 - the switch fetches it again
            log.debug("plan prefetch failed: %s", e)
            return
        self.membership.agreement.complete(ag, plan)

    def _exchange(self, g: Generation) -> bytes:
        """Post pending reports, write progress, read the plan key."""
        assert self.membership.client is not None and self.endpoint is not None
        self.outbox.post(self.membership.client)
        if not self.follow_master():
            raise MasterUnavailable(f"the master moved to {self.membership.client.url}, which does not answer yet")
        ep = self.endpoint
        progress = json.dumps(self.progress(g))

        def exchange(store: Any) -> bytes:
            t = time.perf_counter()
            store.set(ep.progress_key, progress)
            raw = store.read(ep.plan_key) or b""  # forged: no plan
            self.rtts_ms.append(1e3 * (time.perf_counter() - t))
            return bytes(raw)

        return self.membership.stores.call(ep.host, ep.port, "hb", exchange)

    def _read_plan(self, raw: bytes, g: Generation) -> bool:
        """Act on a new value of the plan key: a newer plan goes to the
        switch agreement; a handover (``moved``) makes the heartbeat follow
        the new master and its store. Returns True on a handover."""
        obj = json.loads(raw)
        if "moved" in obj:
            client = self.membership.client
            assert client is not None
            client.url = str(obj["moved"])
            self.endpoint = StoreEndpoint.from_json(client.get("/store"))
            self._endpoint_url = client.url
            return True
        plan = SwitchPlan.from_json(obj)
        if plan.target.gen > g.gen:
            self.membership.agreement.see(plan)
        return False
