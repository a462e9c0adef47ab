"""A worker's membership in its job's process groups (EDL §4.2, Elan §V-B):
joining, the switch at the agreed step, recovery after a failed collective,
the state sent to newcomers, and the clients of the master's TCPStore.

The switch agreement rides on the gradient all-reduce: rank 0 contributes
(target generation, switch step) of a plan its heartbeat saw to the control
tensor, every rank reads the reduced pair and switches at ``max(planned,
t + 1)``. :class:`SwitchAgreement` holds both ends of that handshake.

Threads (who writes what):

* training thread: everything of :class:`Membership`; its :attr:`~Membership.
  seat` is a frozen :class:`Seat` replaced whole, so the heartbeat threads
  read a consistent generation, rank and world size. Of the agreement it
  calls :meth:`~SwitchAgreement.control`, :meth:`~SwitchAgreement.settle`,
  :meth:`~SwitchAgreement.take` and :meth:`~SwitchAgreement.clear`;
* heartbeat thread: :meth:`SwitchAgreement.see` (rank 0: the plan it read
  from the store) and :meth:`SwitchAgreement.complete` (other ranks: the
  agreed plan, fetched before the switch step);
* every thread: :class:`StoreCache`, one store client per (address, tag), a
  thread using its own tag ("" training, "hb" heartbeat, "beat" liveness);
  :class:`Gate` (waiting for a generation's go and passing its gate before
  the process group forms) runs on the training thread.

:class:`SwitchAgreement` and :class:`StoreCache` hold a lock; the training
thread takes the agreement's lock once per step (rank 0's proposal).
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from tidal import settings
from tidal.net import socket_env
from tidal.runtime import abortable
from tidal.runtime.client import MasterClient
from tidal.runtime.messages import Generation, SwitchPlan
from tidal.runtime.sealed import Forged, SealedStore, store_key
from tidal.runtime.state import RescaleHook, TrainState
from tidal.runtime.transfer import broadcast_state, replicate_state

log = logging.getLogger(__name__)

PING_KEY = "tidal/ping"  # checked to see whether a cached store connection survived a master restart


@dataclass(frozen=True)
class Seat:
    """This worker's place: its generation (None before it joined one, and in
    local mode), its rank (-1 before joining) and the world size."""

    gen: Generation | None
    rank: int
    world_size: int


@dataclass(frozen=True)
class Agreement:
    """A switch every rank agreed on: to generation ``gen`` at ``switch_step``.
    ``plan`` is None on ranks that have not fetched the plan yet (rank 0
    holds it)."""

    plan: SwitchPlan | None
    gen: int
    switch_step: int


class SwitchAgreement:
    """Both ends of the switch handshake (EDL §4.2), under one lock: the plan
    rank 0's heartbeat saw, and the agreement reached on the control tensor."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: SwitchPlan | None = None
        self._agreed: Agreement | None = None

    def see(self, plan: SwitchPlan) -> None:
        """Heartbeat thread: a newer plan was published."""
        with self._lock:
            self._seen = plan

    def control(self, seat: Seat) -> tuple[SwitchPlan | None, tuple[float, float]]:
        """Training thread, once per step: the plan this rank proposes and the
        control pair it contributes. Rank 0: (target generation, planned
        switch step) of a newer plan it saw while nothing is agreed; else 0s."""
        if seat.rank != 0 or seat.gen is None:
            return None, (0.0, 0.0)
        with self._lock:
            plan = self._seen
            if plan is None or plan.target.gen <= seat.gen.gen or self._agreed is not None:
                return None, (0.0, 0.0)
        return plan, (float(plan.target.gen), float(plan.switch_step))

    def settle(self, plan: SwitchPlan | None, reduced: tuple[float, float], step: int) -> Agreement | None:
        """Training thread: the reduced control pair. If it names a switch
        (and none is agreed yet) every rank agrees on ``max(planned, step +
        1)``, a pure function of values every rank holds; ``plan``: rank 0's
        proposal (None elsewhere). Returns the new agreement."""
        gen, planned = int(round(reduced[0])), int(round(reduced[1]))
        if gen <= 0:
            return None
        with self._lock:
            if self._agreed is not None:
                return None
            self._agreed = Agreement(plan, gen, max(planned, step + 1))
            return self._agreed

    @property
    def agreed(self) -> Agreement | None:
        return self._agreed

    def due(self, step: int) -> bool:
        """Training thread (the only one that sets the switch step): whether
        the boundary before ``step`` is the agreed switch."""
        ag = self._agreed
        return ag is not None and step >= ag.switch_step

    def complete(self, ag: Agreement, plan: SwitchPlan) -> None:
        """Heartbeat thread: the plan of ``ag`` was fetched (ignored if the
        agreement changed meanwhile)."""
        with self._lock:
            if self._agreed is ag:
                self._agreed = Agreement(plan, ag.gen, ag.switch_step)

    def take(self) -> Agreement:
        """Training thread, at the switch: the agreement, now consumed."""
        with self._lock:
            ag, self._agreed = self._agreed, None
        assert ag is not None
        return ag

    def clear(self) -> None:
        """Training thread: a failed step cancels an agreement in progress."""
        with self._lock:
            self._agreed = None

    def forget(self, gen: int) -> None:
        """Training thread: generation ``gen`` was aborted before it formed;
        do not propose its plan again (a newer one replaces it)."""
        with self._lock:
            if self._seen is not None and self._seen.target.gen <= gen:
                self._seen = None


class _Lane:
    """A helper thread that runs one (store, tag)'s calls, so its caller can
    give up on a call that hangs: a TCPStore client whose server went silent
    (a cut host, a stopped process) blocks in ``get``, ``set`` and connecting
    far past its timeout. A call given up on keeps its thread until it
    returns; until then further calls fail at once (one thread at most)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], dict[str, Any], threading.Event]] = queue.SimpleQueue()
        self.pending_since: float | None = None
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
            self.pending_since = None
            done.set()

    def call(self, fn: Callable[[], Any], deadline_s: float) -> Any:
        since = self.pending_since
        if since is not None:
            raise TimeoutError(f"a call to this store has hung for {time.monotonic() - since:.0f}s")
        box: dict[str, Any] = {}
        done = threading.Event()
        self.pending_since = time.monotonic()
        self._jobs.put((fn, box, done))
        if not done.wait(deadline_s):
            raise TimeoutError(f"the store did not answer within {deadline_s:g}s")
        if "error" in box:
            raise box["error"]
        return box.get("value")


class StoreCache:
    """Clients of the master's TCPStore, one per (host, port, tag); each
    thread uses its own tag. Clients other than the heartbeat's ("hb", used
    every step and dropped on its own errors) are checked before use, so a
    connection lost to a master restart is replaced (Elan §V-D). The
    background threads' clients ("hb", "beat") give up connecting after
    :data:`QUICK_TIMEOUT` (a master whose host died does not answer; its
    successor elsewhere is found through the master client)."""

    QUICK_TIMEOUT = datetime.timedelta(seconds=5)

    def __init__(self, timeout: datetime.timedelta, key: bytes | None = None) -> None:
        self.timeout = timeout
        self.key = store_key() if key is None else key  # every value is sealed (runtime.sealed)
        self._lock = threading.Lock()
        self._stores: dict[tuple[str, int, str], Any] = {}
        self._lanes: dict[tuple[str, int, str], _Lane] = {}

    def get(self, host: str, port: int, tag: str = "") -> Any:
        key = (host, port, tag)
        with self._lock:
            s = self._stores.get(key)
        if s is not None and tag != "hb":
            try:
                s.check([PING_KEY])
            except Exception as e:  # noqa: BLE001
                log.warning("store %s:%d lost (%s); reconnecting", host, port, e)
                s = None
        if s is None:
            quick = tag in ("hb", "beat")
            s = SealedStore(dist.TCPStore(host, port, is_master=False,
                                          timeout=min(self.timeout, self.QUICK_TIMEOUT) if quick else self.timeout),
                            self.key)
            with self._lock:
                self._stores[key] = s
        return s

    def call(self, host: str, port: int, tag: str, fn: Callable[[Any], Any]) -> Any:
        """``fn(store)`` for the background threads ("hb", "beat"), given up
        after :data:`QUICK_TIMEOUT` (connecting included) when the store's
        host went silent, so the caller can look for a moved master."""
        with self._lock:
            lane = self._lanes.get((host, port, tag))
            if lane is None:
                lane = self._lanes[(host, port, tag)] = _Lane(f"tidal-store-{tag}")
        return lane.call(lambda: fn(self.get(host, port, tag)), self.QUICK_TIMEOUT.total_seconds())

    def quiesce(self, deadline_s: float) -> bool:
        """Wait (at most ``deadline_s``) until no helper thread is inside a
        store call: at interpreter exit a daemon thread still in a torch
        call is killed inside C++ and aborts the process ("terminate called
        without an active exception"), which would replace the script's own
        error as the way it ended. False: one still is at the deadline."""
        end = time.monotonic() + deadline_s
        with self._lock:
            lanes = list(self._lanes.values())
        while any(lane.pending_since is not None for lane in lanes):
            if time.monotonic() >= end:
                return False
            time.sleep(0.02)
        return True

    def drop(self, host: str, port: int, tag: str = "") -> None:
        """Forget a client whose connection failed (the next ``get`` reconnects)."""
        with self._lock:
            self._stores.pop((host, port, tag), None)


def most_advanced(seat: Seat, step: int) -> int:
    """The lowest rank of ``seat``'s group among those that completed the most steps."""
    mine = torch.tensor([float(step)], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    best = int(mine.item())
    cand = torch.tensor([float(seat.rank if step == best else seat.world_size)], dtype=torch.float64)
    dist.all_reduce(cand, op=dist.ReduceOp.MIN)
    return int(cand.item())


class Gate:
    """How a worker waits for a generation to start: its ``go`` key, then
    the gate before its process group (see :mod:`tidal.runtime.generations`),
    where the master can still abort it if a member was lost on the way."""

    def __init__(self, worker_id: str, client: MasterClient | None, stores: StoreCache) -> None:
        self.worker_id, self.client, self.stores = worker_id, client, stores

    def await_go(self, g: Generation, deadline: float) -> bytes | None:
        """Wait for generation ``g``'s go key: set by the master (gen 1) or the
        old rank 0 at the switch. Polled (a few µs per check), asking the
        master once a second whether the job ended (None) or the plan was
        replaced (``b"cancel"``); survives a master restart (Elan §V-D)."""
        assert self.client is not None
        store = self.stores.get(g.store_host, g.store_port)
        next_ask = time.monotonic() + 1.0
        while True:
            try:
                if (go := store.peek(g.prefix + "go")) is not None:
                    return go
            except Exception as e:  # noqa: BLE001 - the master (and its store) restarts: reconnect
                store = self._reconnect(g, store, f"while waiting for gen {g.gen} ({e})")
            time.sleep(0.002)
            if time.monotonic() > next_ask:
                next_ask = time.monotonic() + 1.0
                if time.monotonic() > deadline:
                    return None
                try:
                    a = self.client.get("/assignment", worker_id=self.worker_id)
                except Exception as e:  # noqa: BLE001 - a master down for longer than the client's patience
                    log.warning("worker %s: master unreachable while waiting (%s)", self.worker_id, e)
                    continue
                if a["status"] == "finished":
                    return None
                if a["status"] == "assigned" and Generation.from_json(a["generation"]) != g:
                    return b"cancel"  # re-planned meanwhile, or the master moved: its store is elsewhere

    def _reconnect(self, g: Generation, store: Any, why: str) -> Any:
        """The store connection was lost (a master restart): a new client, or the old one if none yet."""
        log.warning("worker %s: store lost %s; reconnecting", self.worker_id, why)
        self.stores.drop(g.store_host, g.store_port)
        time.sleep(0.2)
        try:
            return self.stores.get(g.store_host, g.store_port)
        except Exception as e:  # noqa: BLE001
            log.debug("store reconnect failed: %s", e)
            return store

    def arrive(self, g: Generation, timeout_s: float) -> bool:
        """The gate before ``g``'s process group: True once every member
        arrived (the last one commits), False if the master aborted ``g``
        because a member was lost before it arrived. One compare-and-set on
        ``<prefix>state`` decides, so every member of ``g`` sees the same."""
        store = self.stores.get(g.store_host, g.store_port)
        key = g.prefix + "state"
        if int(store.add(g.prefix + "arrived", 1)) >= g.world_size:
            try:
                store.compare_set(key, "", "commit")
            except Forged as e:  # a co-tenant wrote the gate's key: wait for the master's word (or time out)
                log.warning("%s", e)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if (state := store.peek(key)) is not None:
                    return state == b"commit"
            except Exception as e:  # noqa: BLE001 - the master (and its store) restarts: reconnect
                store = self._reconnect(g, store, f"at the gate of gen {g.gen} ({e})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.worker_id}: gen {g.gen} did not form in {timeout_s}s")
            time.sleep(0.001)


class Membership:
    """Joins generations, switches between them and recovers from failed
    collectives for one worker, running the rescale hooks and recording
    every pause (switch or recovery) and detected failure."""

    def __init__(self, worker_id: str, client: MasterClient | None, collective_timeout_s: float = 60.0,
                 join_timeout_s: float = 300.0, store_timeout_s: float = 60.0) -> None:
        self.worker_id = worker_id
        self.client = client
        self.join_timeout_s = join_timeout_s
        self.pg_timeout = datetime.timedelta(seconds=collective_timeout_s)  # a collective waits for live peers
        self.seat = Seat(None, 0 if client is None else -1, 1)  # local mode: rank 0 of 1
        self.stores = StoreCache(datetime.timedelta(seconds=store_timeout_s))
        self._group_store: SealedStore | None = None  # the current process group's store
        self.gate = Gate(worker_id, client, self.stores)
        self.agreement = SwitchAgreement()
        self.hooks: list[RescaleHook] = []
        self.pauses: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []  # detected peer failures (wall time, step, generation)
        self.joined_at_step = 0
        self.backend = "gloo"  # NCCL once CUDA parameters are registered (tidal.runtime.devices)

    # ------------------------------------------------------------------ joining
    def register(self, checkpoints: bool, checkpoint_local: str = "") -> dict[str, Any]:
        """Tell the master this worker is ready (its host for topology-aware
        state replication, Elan §IV; ``checkpoint_local``: its checkpoint
        directory if node-local); returns the store address and keys. A
        refusal (a node-local checkpoint directory in a job spanning hosts)
        raises with the master's reason."""
        assert self.client is not None
        host = settings.HOST.get() or settings.NODE.get() or socket.gethostname()
        ans = self.client.post("/register", {"worker_id": self.worker_id, "pid": os.getpid(), "host": host,
                                             "switch": settings.SWITCH.get(), "checkpoints": checkpoints,
                                             "checkpoint_local": checkpoint_local})
        if ans.get("status") == "error":
            raise RuntimeError(f"worker {self.worker_id} on {host}: the job master refused it: {ans.get('message')}")
        return ans

    def join(self, train: TrainState, resume: Callable[[], None]) -> bool:
        """Wait for a generation that says go, rendezvous and receive the
        state (a newcomer) or start (the job's first generation, after
        ``resume`` loaded a checkpoint, if any: rank 0's copy is sent).
        False: the job finished meanwhile."""
        assigned = self._await_generation()
        if assigned is None:
            return False
        a, g = assigned
        t0 = time.perf_counter()
        log.debug("worker %s: go for gen %d", self.worker_id, g.gen)
        if not a.get("joining"):
            resume()
        while True:
            if not self._arrive(g):  # a member was lost before the group formed: the master plans again
                log.warning("worker %s: gen %d was aborted (a member was lost before it formed); asking again",
                            self.worker_id, g.gen)
                assigned = self._await_generation()
                if assigned is None:
                    return False
                a, g = assigned
                continue
            try:
                self.init_group(g)
                plan = SwitchPlan.from_json(a["plan"]) if a.get("joining") and a.get("plan") else None
                self.sync_state(train, sources=plan.source_ranks() if plan is not None else None)
                break
            except Exception as e:  # noqa: BLE001 - a member died after the gate, before the first step
                if a.get("joining"):
                    raise  # a newcomer exits: the master drops it and the others recover without it
                err = f"gen {g.gen} failed while it formed ({e})"
            # out of the handler: its traceback no longer holds the broken group, which closes at once
            self.fail(train.step, g.gen, err)
            assert self.client is not None
            self.client.post("/failed", {"worker_id": self.worker_id, "gen": g.gen, "step": train.step})
            nxt = self._await_assignment(time.monotonic() + self.join_timeout_s, after_gen=g.gen)
            if nxt is None:
                return False
            a, g = nxt, Generation.from_json(nxt["generation"])
        if a.get("joining"):
            self.joined_at_step = train.step
        else:
            train.global_batch_size = train.policy.start(self.seat.world_size)
        log.info("worker %s joined gen %d as rank %d/%d at step %d (%.1f ms)", self.worker_id, g.gen, self.seat.rank,
                 self.seat.world_size, train.step, 1e3 * (time.perf_counter() - t0))
        return True

    def _await_generation(self) -> tuple[dict[str, Any], Generation] | None:
        """The assignment and generation that said go (a cancelled plan is
        re-planned, e.g. after a recovery); None: the job finished."""
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            a = self._await_assignment(deadline)
            if a is None:
                return None
            g = Generation.from_json(a["generation"])
            log.debug("worker %s assigned to gen %d", self.worker_id, g.gen)
            go = self.gate.await_go(g, deadline)
            if go is None:
                return None
            if go == b"go":
                return a, g
            log.info("worker %s: gen %d was cancelled; asking again", self.worker_id, g.gen)

    def _await_assignment(self, deadline: float, after_gen: int | None = None) -> dict[str, Any] | None:
        """Poll the master until it assigns a generation (after ``after_gen``
        when recovering); None: the job finished."""
        assert self.client is not None
        query: dict[str, Any] = {"worker_id": self.worker_id}
        if after_gen is not None:
            query["after_gen"] = after_gen
        while True:
            a = self.client.get("/assignment", **query)
            if a["status"] == "finished":
                return None
            if a["status"] == "assigned":
                return a
            if time.monotonic() > deadline:
                what = " got no generation" if after_gen is None else ": no recovery generation"
                raise TimeoutError(f"worker {self.worker_id}{what} within {self.join_timeout_s}s")
            time.sleep(0.01)

    # ------------------------------------------------------------------ groups and state
    def _arrive(self, g: Generation) -> bool:
        """Pass ``g``'s gate (:meth:`Gate.arrive`); False: ``g`` was aborted."""
        return self.gate.arrive(g, self.pg_timeout.total_seconds())

    def init_group(self, g: Generation) -> None:
        """Rendezvous with the generation's members under its store prefix."""
        # the sealed store is kept while the group lives: torch holds only its C++ half
        self._group_store = self.stores.get(g.store_host, g.store_port)
        store = dist.PrefixStore(g.prefix, self._group_store)
        rank = g.rank_of(self.worker_id)
        os.environ.update(socket_env(g.store_host))  # the interface that routes to the job's hosts
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=g.world_size,
                                timeout=self.pg_timeout)
        abortable.SIGNAL.enter(g.gen)  # the master may abort it from now on (a member went silent)
        self.seat = Seat(g, rank, g.world_size)

    def sync_state(self, train: TrainState, src: int = 0, sources: dict[int, int] | None = None) -> None:
        """Give newcomers the full state: point to point from the sources the
        master chose (destination rank -> source rank, Elan §IV), all at once,
        or else by broadcast from ``src`` (the new rank 0, an existing worker;
        after a failure, the most advanced survivor)."""
        rank = self.seat.rank
        if sources:
            cap = settings.STATE_MAX_MBPS.get() * 1e6  # per-source egress cap
            if rank in sources:
                train.load_payload(replicate_state(None, sources))
            elif rank in sources.values():
                replicate_state(train.payload(), sources, max_bytes_per_s=cap)
            return
        received = broadcast_state(train.payload() if rank == src else None, src=src)
        if rank != src:
            assert received is not None
            train.load_payload(received)

    def fail(self, step: int, gen: int, error: Exception | str) -> None:
        """A collective failed: record it and tear the broken group down now
        (its sockets close, so peers blocked on this worker fail fast too).
        A group the master aborted because a member went silent is
        abandoned instead (:func:`~tidal.runtime.abortable.abandon_group`):
        destroying it would wait for that member."""
        aborted = abortable.SIGNAL.pending()
        self.failures.append({"detected_at": time.time(), "step": step, "gen": gen,
                              **({"aborted": aborted} if aborted else {})})
        log.warning("worker %s: %s; recovering", self.worker_id, error)
        try:
            if aborted is not None:
                abortable.abandon_group(self.backend)
            else:
                dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001
            log.debug("destroy after failure: %s", e)

    # ------------------------------------------------------------------ the switch
    def take_plan(self) -> SwitchPlan:
        """At the agreed step: the agreed plan (rank 0 holds it; the others
        prefetched it on their heartbeat, or fetch it now)."""
        ag = self.agreement.take()
        if ag.plan is not None:
            return ag.plan
        assert self.client is not None
        return SwitchPlan.from_json(self.client.get("/plan", gen=ag.gen)["plan"])

    def leave(self) -> None:
        """A leaver's end: out of the group, and tell the master."""
        assert self.client is not None
        dist.destroy_process_group()
        self.client.post("/left", {"worker_id": self.worker_id})

    def switch(self, plan: SwitchPlan, train: TrainState, t0: float, wall0: float) -> dict[str, Any] | None:
        """Survivors and newcomers form ``plan.target`` (a reshare keeps the
        group), the batch policy follows the new world size, newcomers get
        the state and the hooks run. Returns the pause's record (``t0``,
        ``wall0``: when the switch began); None if the state transfer failed
        (the group is torn down: recover like after a failed step)."""
        g, old = plan.target, self.seat
        if old.gen is not None and g.members == old.gen.members:
            self.seat = Seat(g, old.rank, old.world_size)  # new batch shares only: no new process group
            t1 = t2 = time.perf_counter()
        else:
            if g.rank_of(self.worker_id) == 0:
                self.stores.get(g.store_host, g.store_port).set(g.prefix + "go", "go")
            if not self._arrive(g):  # a member was lost before it formed: stay in the old group
                self.agreement.forget(g.gen)
                log.warning("worker %s: gen %d was aborted (a member was lost before it formed); staying in gen %d",
                            self.worker_id, g.gen, old.gen.gen if old.gen else 0)
                return {"gen": old.gen.gen if old.gen else 0, "step": train.step, "aborted": g.gen,
                        "pause_s": time.perf_counter() - t0, "wall_start": wall0}
            dist.destroy_process_group()
            t1 = time.perf_counter()
            try:
                self.init_group(g)
            except Exception as e:  # noqa: BLE001 - a member died after the gate: recover like after a failed step
                self.seat = Seat(g, g.rank_of(self.worker_id), old.world_size)
                self.fail(train.step, g.gen, f"rendezvous of gen {g.gen} failed ({e})")
                return None
            t2 = time.perf_counter()
        train.global_batch_size = train.policy.rescale(train.step, old.world_size, self.seat.world_size)
        if plan.joiners:
            err = ""
            try:
                self.sync_state(train, sources=plan.source_ranks() or None)
            except Exception as e:  # noqa: BLE001 - a newcomer (or source) died during the transfer
                err = f"state transfer of gen {g.gen} failed ({e})"
            if err:  # out of the handler: its traceback no longer holds the broken group, which closes at once
                self.fail(train.step, g.gen, err)
                return None
        t3 = time.perf_counter()
        return self._regrouped(g, old.world_size, train.step, t0, wall0, destroy_s=t1 - t0, rendezvous_s=t2 - t1,
                               state_sync_s=t3 - t2)

    def _regrouped(self, g: Generation, old_world: int, step: int, t0: float, wall0: float,
                   **phases: Any) -> dict[str, Any]:
        """Run the rescale hooks and record the pause."""
        for h in self.hooks:
            h(old_world, self.seat.world_size)
        pause = {"gen": g.gen, "step": step, "from": old_world, "to": self.seat.world_size,
                 "pause_s": time.perf_counter() - t0, "wall_start": wall0, **phases}
        self.pauses.append(pause)
        return pause

    # ------------------------------------------------------------------ recovery
    def recover(self, train: TrainState, t0: float, wall0: float) -> dict[str, Any] | None:
        """A peer died during a collective (EDL §4.2, Elan §V-B): report to
        the master, join the generation of the survivors it forms and
        continue from the most advanced survivor's state (a survivor may have
        completed the failed step). Returns the pause's record; None: the job
        finished meanwhile."""
        assert self.client is not None and self.seat.gen is not None
        failed_gen, old_world = self.seat.gen.gen, self.seat.world_size
        if dist.is_initialized():
            dist.destroy_process_group()
        self.client.post("/failed", {"worker_id": self.worker_id, "gen": failed_gen, "step": train.step})
        while True:  # until the survivors' generation forms (the master re-forms it if a member is lost first)
            a = self._await_assignment(time.monotonic() + self.join_timeout_s, after_gen=failed_gen)
            if a is None:
                return None
            g = Generation.from_json(a["generation"])
            if self._arrive(g):
                break
            failed_gen = g.gen
        self.init_group(g)
        self.sync_state(train, src=most_advanced(self.seat, train.step))
        train.global_batch_size = train.policy.rescale(train.step, old_world, self.seat.world_size)
        return self._regrouped(g, old_world, train.step, t0, wall0, kind="recover")
