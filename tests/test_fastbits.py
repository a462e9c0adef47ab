"""The scheduling core's compiled kernels (src/tidal/scheduler/_fastbits.c)
give exactly the numpy code's answers and counts (the buddy placer's
per-node counts, Algorithm 2's merge), and the package still works without
them."""

from __future__ import annotations

import math
import operator
import random
from dataclasses import replace
import shutil

import numpy as np
import pytest

from tidal.scheduler import greedy, kernels
from tidal.scheduler.nodebits import NodeBits, first_free_block

needs_kernels = pytest.mark.skipif(kernels.fast is None, reason="the compiled kernels are not built here")

# (GPUs in the mask, nodes per switch): n256g8's 8 switches of 32 nodes, shapes without a
# switch term (one switch, or nodes that do not split into whole switches), and 6 nodes,
# whose 3 blocks of 16 GPUs have no buddy pairs (numpy raises; so must the kernel's caller)
SHAPES = [(2048, 32), (256, 4), (64, 8), (32, 2), (48, 4)]


def _random_mask(rng: random.Random, size: int) -> np.ndarray:
    """Used GPUs as a placer sees them: whole free nodes, whole used ones and
    partly used ones."""
    mask = np.zeros(size, dtype=bool)
    for node in range(size // 8):
        kind = rng.random()
        if kind < 0.3:
            mask[8 * node : 8 * node + 8] = True
        elif kind < 0.7:
            mask[8 * node : 8 * node + 8] = [rng.random() < 0.5 for _ in range(8)]
    return mask


def _numpy(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(kernels, "fast", None)


def _same(a: NodeBits, b: NodeBits) -> None:
    assert a.bytes.tolist() == b.bytes.tolist()
    assert a.free8.tolist() == b.free8.tolist()
    assert (a.swf is None) == (b.swf is None)
    if a.swf is not None:
        assert a.swf.tolist() == b.swf.tolist()
        assert a.sw_of_node.tolist() == b.sw_of_node.tolist()


def _answer(search, s: int) -> int | None | str:
    """A search's answer, or the error numpy raised (an odd number of blocks
    has no buddy pairs)."""
    try:
        return search(s)
    except ValueError as e:
        return f"ValueError: {e}"


def test_kernels_are_built_where_a_compiler_is() -> None:
    """The set-up command builds them on a machine with a C compiler (CI's);
    a silent build failure would only show as a slower simulator."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine: the numpy code runs alone")
    assert kernels.fast is not None, "the compiled kernels (tidal.scheduler._fastbits) were not built"


@needs_kernels
@pytest.mark.parametrize("size,nps", SHAPES)
def test_counts_searches_and_marks_equal_numpy(size: int, nps: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(size * 31 + nps)
    for _ in range(60):
        mask = _random_mask(rng, size)
        fast = NodeBits(mask, nps)
        with monkeypatch.context() as m:
            _numpy(m)
            slow = NodeBits(mask, nps)
        _same(fast, slow)
        for _ in range(25):  # marks (whole nodes, runs inside nodes, across nodes), then the searches
            lo = rng.randrange(size)
            hi = rng.choice([lo + 1, min(size, lo + rng.randrange(1, 9)), min(size, (lo // 8 + rng.randrange(1, 5)) * 8)])
            if rng.random() < 0.5:
                lo -= lo % 8
            used = rng.random() < 0.5
            fast.set_range(lo, hi, used)
            with monkeypatch.context() as m:
                _numpy(m)
                slow.set_range(lo, hi, used)
            _same(fast, slow)
            s = 8
            while s <= size and size % s == 0:
                got = _answer(fast.best_whole_nodes, s)
                with monkeypatch.context() as m:
                    _numpy(m)
                    assert got == _answer(slow.best_whole_nodes, s), (s, lo, hi)
                s *= 2


@needs_kernels
def test_first_free_block_equals_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(7)
    for _ in range(400):
        mask = _random_mask(rng, 256)
        s = rng.choice([1, 2, 4, 8, 16, 32])
        prefer = tuple(sorted(rng.sample(range(256), rng.randrange(1, 9))))
        got = first_free_block(mask, prefer, s)
        with monkeypatch.context() as m:
            _numpy(m)
            assert got == first_free_block(mask, prefer, s)
        if got is not None:
            assert not mask[got : got + s].any() and got % s == 0 and any(got <= g < got + s for g in prefer)


@needs_kernels
def test_kernels_hand_back_what_they_do_not_cover() -> None:
    """Arrays of another type or shapes numpy would reject come back as
    NotImplemented (the numpy code then answers or raises, as before)."""
    k = kernels.fast
    assert k.best_whole_nodes(np.zeros(4, dtype=np.int32), None, 8, 64) is NotImplemented
    assert k.best_whole_nodes(np.zeros(3, dtype=np.int64), None, 16, 64) is NotImplemented
    assert k.set_range(np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.int64), None, 0, 64, True, 4) \
        is NotImplemented  # past the last node
    assert k.first_free(np.ones(16, dtype=bool), (3, 40), 8) is NotImplemented  # a block past the mask
    assert k.first_free(np.zeros(16, dtype=np.int8), (3,), 8) is NotImplemented
    assert k.counts(np.zeros(12, dtype=bool), np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64), None, 1) \
        is NotImplemented
    assert k.merge_cut([np.zeros((2, 3))], 8) is NotImplemented  # not rows of four
    assert k.merge_cut([np.array([[np.nan, 1.0, 0.0, 0.0]])], 8) is NotImplemented  # numpy sorts NaN its way


@needs_kernels
def test_merge_cut_equals_numpy() -> None:
    """Random chains (ties between jobs' keys included, GPUs running out at
    every point): the kernel stops where numpy's stable sort and cumulative
    sum stop, with the same counts per job and GPUs left."""
    rng = random.Random(11)
    for _ in range(3000):
        chains = []
        for _ in range(rng.randrange(1, 12)):
            rows, best = [], -rng.choice([0.5, 1.0, 2.0, 3.0])
            for place in range(rng.randrange(1, 5)):
                best = max(best, -rng.choice([0.25, 0.5, 1.0, 2.0, 3.0]))  # the largest key so far
                rows.append((best, rng.choice([1, 2, 4, 8, 16]), rng.choice([0, 1, 2, 4, 8, 16]), place))
            chains.append((np.array(rows, dtype=float), tuple(range(1, len(rows) + 1))))
        free = rng.randrange(0, 80)
        assert tuple(kernels.fast.merge_cut([c[0] for c in chains], free)) == greedy._cut(chains, free)


@needs_kernels
def test_greedy_and_its_merge_equal_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """Algorithm 2 (greedy: its opening, merge and queue) and the merge alone,
    compiled and in Python: the same levels, GPUs left and queue entries,
    with one deadline for all (ids decide ties) and with several."""
    rng = random.Random(5)
    for case in range(1500):
        entries = {}
        for k in range(rng.randrange(1, 15)):
            counts = [0] + sorted(rng.sample([1, 2, 4, 8, 16, 32], rng.randrange(1, 6)))
            vals, v = [0.0], 0.0
            for _ in counts[1:]:
                v += rng.choice([0.5, 1.0, 1.5, 3.0])
                vals.append(v)
            st = greedy.build_steps(counts, vals, 1.0, rng.choice([1.0, 0.5, 2.0]))
            ddl = math.inf if case % 2 else rng.choice([100.0, 200.0, math.inf])
            entries[f"j{rng.randrange(10**6)}-{k}"] = (st, rng.randrange(0, len(counts) - 1), ddl)
        some_free = rng.randrange(0, 200)
        with monkeypatch.context() as m:
            _numpy(m)
            want = greedy.greedy(entries, some_free)
        assert greedy.greedy(entries, some_free) == want  # greedy_open, then the merge or the queue
        jobs = [jid for jid, (st, i, _) in entries.items() if st.lead[i] is not None]
        if not jobs:
            continue
        need0 = max(entries[j][0].lead[i][2] for j in jobs for i in [entries[j][1]])
        free = need0 + rng.randrange(0, 60)
        cur = {jid: e[1] for jid, e in entries.items()}
        got = greedy._merge(entries, jobs, cur, free)
        with monkeypatch.context() as m:
            _numpy(m)
            cur2 = {jid: e[1] for jid, e in entries.items()}
            assert got == greedy._merge(entries, jobs, cur2, free)
            assert cur == cur2


@needs_kernels
@pytest.mark.parametrize("policy", ["elasticflow", "tidal"])
def test_algorithm2_input_equals_the_python_loop(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """elasticflow.algorithm2_input, _Memo.levels_of and Tidal's floors,
    compiled and in Python, on the rounds of a small contended run (shares,
    deadlines, best-effort jobs, memo hits and misses): the same step tables
    and levels (the very objects), starting levels, deadlines, memo, floors
    and LAS queues."""
    from tidal.core.topology import parse_cluster
    from tidal.scheduler.policies import elasticflow
    from tidal.scheduler.registry import get_policy
    from tidal.sim.engine import simulate
    from tidal.sim.traces import poisson_jobs

    compared = []
    original = elasticflow.algorithm2_input

    def both(*args):
        fast = original(*args)
        with monkeypatch.context() as m:
            _numpy(m)
            slow = original(*args)
        assert list(fast) == list(slow)
        assert all(a[0] is b[0] and a[1:] == b[1:] for a, b in zip(fast.values(), slow.values()))
        compared.append(len(fast))
        return fast

    original_levels = elasticflow._Memo.levels_of
    levels: list[int] = []

    def both_levels(self, snap):
        kept = dict(self.by_job)
        with monkeypatch.context() as m:
            _numpy(m)
            slow = original_levels(self, snap)
        slow_kept, self.by_job = self.by_job, kept
        fast = original_levels(self, snap)
        assert list(fast) == list(slow) and all(map(operator.is_, fast.values(), slow.values()))
        assert list(self.by_job.items()) == list(slow_kept.items())
        levels.append(len(fast))
        return fast

    from tidal.scheduler.policies.tidal import Tidal

    original_floors = Tidal._floors
    floors: list[int] = []  # best-effort jobs whose floors were compared, per call

    def both_floors(self, snap, jobs, base, levels, free):
        slow_base = dict(base)
        with monkeypatch.context() as m:
            _numpy(m)
            slow = original_floors(self, snap, jobs, slow_base, levels, free)
        slow_queues = self._pass.queues
        fast = original_floors(self, snap, jobs, base, levels, free)
        assert fast == slow and list(base.items()) == list(slow_base.items())
        assert slow_queues is None or list(self._pass.queues.items()) == list(slow_queues.items())
        if self._pass.weights is not None:  # the weights the floors found are the Python loop's
            found, self._pass.weights = self._weights(snap, jobs), None
            assert found == self._weights(snap, jobs)
        floors.append(len(slow_queues or ()))
        return fast

    monkeypatch.setattr(Tidal, "_floors", both_floors)
    monkeypatch.setattr(elasticflow, "algorithm2_input", both)
    monkeypatch.setattr(elasticflow._Memo, "levels_of", both_levels)
    with_deadlines = poisson_jobs(70, rate_per_hour=40, seed=3, deadline_factor=2.0).jobs
    best_effort = [replace(s, job_id=f"b{s.job_id}") for s in poisson_jobs(50, rate_per_hour=30, seed=4).jobs]
    simulate([*with_deadlines, *best_effort], parse_cluster("n8g8"), get_policy(policy))
    assert len(compared) > 20 and max(compared) > 5
    assert len(levels) > 20 and max(levels) > 5
    assert policy != "tidal" or max(floors, default=0) > 3  # Tidal's floors ran on several best-effort jobs


@needs_kernels
@pytest.mark.parametrize("submit", ["float", "int", "mixed"])
def test_floors_order_equals_python(submit: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tidal's floors on scarce GPUs, compiled and in Python: best-effort
    jobs with tied queues, idleness and submit times (the id decides), float
    submit times (compared in C), int or mixed ones (compared as Python
    tuples), guaranteed jobs keeping their split."""
    import types

    from tidal.core.job import JobSpec, JobState
    from tidal.scheduler.api import JobView
    from tidal.scheduler.policies.tidal import Tidal, _Pass
    from tidal.scheduler.timeline import Levels

    rng = random.Random(11)
    for _ in range(200):
        jobs, levels, split = [], {}, {}
        for k in range(rng.randrange(0, 40)):
            jid = f"j{rng.randrange(10_000)}-{k}"
            t = rng.choice([0, 1, 2]) * 60
            t = float(t) if submit == "float" or (submit == "mixed" and rng.random() < 0.5) else t
            deadline = t + 3600.0 if rng.random() < 0.3 else None
            spec = JobSpec(job_id=jid, submit_time=t, model="resnet50", batch_size=64, iterations=100.0,
                           deadline=deadline)
            state = rng.choice([JobState.RUNNING, JobState.PENDING])
            tags = {"ef_class": rng.choice(["guaranteed", "best-effort", "late"])} if deadline else {}
            if rng.random() < 0.5:
                tags["tiresias_base"] = rng.choice([0.0, 100.0])
            attained = rng.choice([0.0, 400.0, 600.0, 20_000.0])
            jobs.append(JobView(spec, state, (0,) if state is JobState.RUNNING else (), 0.0, attained, 0.0, 0.0,
                                True, tags))
            counts = rng.choice([(0, 1, 2, 4), (0, 2, 4), (0, 8), (0, 0, 3)])
            levels[jid] = Levels(np.array(counts), np.arange(len(counts), dtype=float), counts,
                                 tuple(map(float, range(len(counts)))))
            split[jid] = rng.choice([0, 1, 2, 4])
        base = {j.spec.job_id: rng.choice([0, 1]) for j in jobs if rng.random() < 0.3}
        free = rng.randrange(0, 16)
        policy = Tidal()
        out = []
        for off in (False, True):
            with monkeypatch.context() as m:
                if off:
                    _numpy(m)
                policy._pass = _Pass(frozenset(), split=dict(split))
                b = dict(base)
                listed = list(jobs)
                got = policy._floors(types.SimpleNamespace(), listed, b, levels, free)
                weights = policy._weights(types.SimpleNamespace(), listed)
                assert off or policy._pass.weights is not None  # found by the kernel
                out.append((got, list(b.items()), list(policy._pass.queues.items()), weights))
        assert out[0] == out[1]


@needs_kernels
def test_placer_start_equals_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """The buddy placer's start (who keeps their GPUs, the mask of what is
    used, the jobs to place in order), compiled and in Python."""
    from tidal.core.topology import parse_cluster
    from tidal.scheduler.buddy import _Placer

    cluster = parse_cluster("n8g8")
    rng = random.Random(9)
    for _ in range(300):
        free = list(range(64))
        rng.shuffle(free)
        current, want = {}, {}
        for k in range(rng.randrange(0, 12)):
            n = rng.choice([1, 2, 4])
            if len(free) < n:
                break
            current[f"h{k}"] = tuple(sorted(free.pop() for _ in range(n)))
            if rng.random() < 0.8:
                want[f"h{k}"] = rng.choice([n, n, 2 * n, max(1, n // 2)])
        for k in range(rng.randrange(0, 5)):
            want[f"n{k}"] = rng.choice([1, 2, 4, 8])
        used = np.zeros(64, dtype=bool)
        for gpus in current.values():
            used[list(gpus)] = True
        fast = _Placer(cluster, current, dict(want), used=used)
        with monkeypatch.context() as m:
            _numpy(m)
            slow = _Placer(cluster, current, dict(want), used=used)
        assert list(fast.keep.items()) == list(slow.keep.items())
        assert fast.todo == slow.todo
        assert fast.used0.tolist() == slow.used0.tolist()


def test_a_stale_build_is_not_used() -> None:
    """Kernels built from another version of _fastbits.c (an editable install
    not rebuilt after a pull) are left unused with a warning, not called with
    arguments they do not take."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys, types
        sys.modules["tidal.scheduler._fastbits"] = types.SimpleNamespace(API=0, __file__="old.so")
        from tidal.scheduler import kernels
        print(kernels.fast)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"
    assert "another version of the source" in out.stderr and "pip install -e ." in out.stderr


@needs_kernels
def test_running_views_equal_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """The running rows' views (Rows.columns), compiled and in Python, on
    every round of a small contended run with rows left empty by jobs that
    stopped: the same ids and views (type, fields, counters)."""
    from tidal.core.topology import parse_cluster
    from tidal.scheduler.registry import get_policy
    from tidal.sim.engine import simulate
    from tidal.sim.runset import Rows
    from tidal.sim.traces import poisson_jobs

    original = Rows.columns
    seen = {"rounds": 0, "holes": 0}

    def both(self):
        fast = original(self)
        with monkeypatch.context() as m:
            _numpy(m)
            slow = original(self)
        assert list(fast[0]) == list(slow[0])
        assert [type(v) for v in fast[1]] == [type(v) for v in slow[1]]
        assert [tuple(v) for v in fast[1]] == [tuple(v) for v in slow[1]]
        seen["rounds"] += 1
        seen["holes"] += self.holes
        return fast

    monkeypatch.setattr(Rows, "columns", both)
    simulate(poisson_jobs(120, rate_per_hour=60, seed=5).jobs, parse_cluster("n4g8"), get_policy("tidal"))
    assert seen["rounds"] > 20 and seen["holes"] > 0
    rows = Rows([[None], [None], [None], [()], [0.0], [True], [{}], [0]], np.zeros((1, 3), dtype=np.float32),
                True, True)
    assert kernels.fast.row_views(tuple, rows.cols, rows.counters) is NotImplemented  # float32 counters


@needs_kernels
@pytest.mark.parametrize("cluster", ["n4g8", "n3g4"])
def test_free_lists_equal_python(cluster: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's GPU owners, used mask and per-node free lists after every
    take and release of a small contended run (one GPU, several, whole
    nodes), compiled and in Python."""
    from tidal.core.topology import parse_cluster
    from tidal.scheduler.registry import get_policy
    from tidal.sim.engine import simulate
    from tidal.sim.traces import poisson_jobs
    from tidal.sim.views import ViewCache

    def state(cache):
        used = None if cache.used is None else cache.used.tolist()
        return dict(cache.owner), used, list(cache.free), [list(b) for b in cache.by_free]

    original = ViewCache._fast_change
    compiled = []
    counts = {"one": 0, "several": 0}

    def fast_then_python(self, gpus, jid):
        before = state(self)
        assert original(self, gpus, jid)
        compiled.append(state(self))
        self.owner.clear()
        self.owner.update(before[0])
        if before[1] is not None:
            self.used[:] = before[1]
        self.free[:] = before[2]
        self.by_free[:] = before[3]
        counts["one" if len(gpus) == 1 else "several"] += 1
        return False  # the Python lines run next

    def checked(name):
        method = getattr(ViewCache, name)

        def run(self, job, *args, **kw):
            n = len(compiled)
            method(self, job, *args, **kw)
            if len(compiled) > n:
                assert state(self) == compiled[-1]
        return run

    monkeypatch.setattr(ViewCache, "_fast_change", fast_then_python)
    monkeypatch.setattr(ViewCache, "hold", checked("hold"))
    monkeypatch.setattr(ViewCache, "unhold", checked("unhold"))
    simulate(poisson_jobs(120, rate_per_hour=60, seed=6).jobs, parse_cluster(cluster), get_policy("tidal"))
    assert counts["one"] > 10 and counts["several"] > 10
    cache = ViewCache(parse_cluster(cluster))
    with pytest.raises(KeyError):  # giving back a GPU nobody holds, as the Python lines do
        kernels.fast.gpus_change((0,), None, cache.owner, None, cache._node_of, cache.free, cache._node_gpus,
                                 cache.by_free)
    assert kernels.fast.gpus_change((10**6,), "x", cache.owner, None, cache._node_of, cache.free,
                                    cache._node_gpus, cache.by_free) is NotImplemented
    assert cache.owner == {}


@needs_kernels
def test_changed_jobs_equal_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """record_rescales' look at the jobs whose GPUs or count change,
    compiled and in Python: random allocations and placements (kept tuples,
    equal copies, other counts, no placement, count 0), and every round of a
    small contended run."""
    from tidal.core.topology import parse_cluster
    from tidal.scheduler.api import FrozenDict
    from tidal.scheduler.policies import elasticflow
    from tidal.scheduler.registry import get_policy
    from tidal.sim.engine import simulate
    from tidal.sim.traces import poisson_jobs

    def python(alloc, placement, held):
        look = set(jid for jid, n in alloc.items() if placement.get(jid, ()) is not held.get(jid))
        return look | {jid for jid, n in alloc.items() if len(placement.get(jid, ())) != n}

    rng = random.Random(5)
    for _ in range(500):
        held, alloc, placement = {}, {}, {}
        for k in range(rng.randrange(12)):
            jid = f"j{k}"
            gpus = tuple(range(k * 8, k * 8 + rng.choice([1, 2, 4])))
            if rng.random() < 0.6:
                held[jid] = gpus
            if rng.random() < 0.8:
                alloc[jid] = rng.choice([0, len(gpus), 2 * len(gpus)])
            kind = rng.random()
            if kind < 0.4 and jid in held:
                placement[jid] = held[jid]  # the very tuple
            elif kind < 0.6:
                placement[jid] = tuple(gpus)[:]  # an equal copy
            elif kind < 0.8:
                placement[jid] = tuple(range(100, 100 + alloc.get(jid, 1)))
        frozen = FrozenDict(held)
        assert kernels.fast.changed_jobs(alloc, placement, frozen) == python(alloc, placement, held)
    assert kernels.fast.changed_jobs({"a": 1.0}, {}, {}) is NotImplemented
    assert kernels.fast.changed_jobs({"a": 1}, {"a": [0]}, {}) is NotImplemented

    calls = []
    original = elasticflow.record_rescales

    def both(snap, plan, costs):
        tags = {k: dict(v) for k, v in plan.tags.items()}
        with monkeypatch.context() as m:
            _numpy(m)
            original(snap, plan, costs)
        slow, plan.tags = plan.tags, tags
        original(snap, plan, costs)
        assert plan.tags == slow
        calls.append(sum("ef_busy_until" in t for t in slow.values()))

    monkeypatch.setattr(elasticflow, "record_rescales", both)
    simulate(poisson_jobs(120, rate_per_hour=60, seed=7).jobs, parse_cluster("n4g8"), get_policy("tidal"))
    assert len(calls) > 20 and max(calls) > 0


@needs_kernels
def test_row_advance_equals_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """RunSet.advance's arithmetic, compiled and with numpy, bit for bit:
    random rows (the counters, the time of the last update, the useful
    work's sum in row order, or its terms when slow rows are integrated
    apart), then whole runs with the kernels and without: every job's
    counters and times, the useful and busy GPU-seconds."""
    rng = np.random.default_rng(3)
    for _ in range(300):
        cap, n = 16, int(rng.integers(1, 17))
        S, M = rng.random((cap, 6)) * 1e4, rng.random((cap, 6)) * rng.choice([0.0, 1.0, 1e-3])
        L, now = rng.random(cap) * 100, 100.0 + float(rng.random()) * 60
        useful = float(rng.random() * 1e6)
        gain = M[:n] * (now - L[:n])[:, None]
        want_S, want_L = S.copy(), L.copy()
        want_S[:n] += gain
        want_L[:n] = now
        terms = gain[:, 5].copy()
        terms[0] += useful
        for arg, want in ((useful, float(terms.cumsum()[-1])), (None, gain[:, 5].tolist())):
            s, l = S.copy(), L.copy()
            assert kernels.fast.advance_rows(s, M, l, n, now, arg) == want
            assert s.tobytes() == want_S.tobytes() and l.tobytes() == want_L.tobytes()
    assert kernels.fast.advance_rows(S.astype(np.float32), M, L, 4, 1.0, None) is NotImplemented
    assert kernels.fast.advance_rows(S, M, L, 17, 1.0, None) is NotImplemented

    from tidal.core.topology import parse_cluster
    from tidal.scheduler.registry import get_policy
    from tidal.sim.engine import simulate
    from tidal.sim.traces import poisson_jobs

    def run():
        r = simulate(poisson_jobs(150, rate_per_hour=60, seed=8).jobs, parse_cluster("n4g8"), get_policy("tidal"))
        return ([(j.spec.job_id, j.done, j.attained, j.executed, j.gpu_seconds, j.end_time) for j in r.jobs],
                r.useful_norm_s, r.busy_gpu_s, r.rounds)

    compiled = run()
    _numpy(monkeypatch)
    assert run() == compiled


@needs_kernels
@pytest.mark.parametrize("policy", ["elasticflow", "tidal"])
def test_runnable_jobs_equal_python(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The jobs Algorithm 2 may give GPUs and their base (_Context.runnable:
    admitted before or now, not dropped, a count above 0, their share),
    compiled and in Python, on every call of a small contended run with
    deadlines, drops and admissions."""
    import copy

    from tidal.core.topology import parse_cluster
    from tidal.scheduler.policies import elasticflow
    from tidal.scheduler.registry import get_policy
    from tidal.sim.engine import simulate
    from tidal.sim.traces import poisson_jobs

    original = elasticflow._Context.runnable
    sizes = []

    def both(self, snap, plan):
        fresh = copy.copy(self)
        fresh._runnable = None
        with monkeypatch.context() as m:
            _numpy(m)
            slow = original(fresh, snap, plan)
        fast = original(self, snap, plan)
        assert [j.spec.job_id for j in fast[0]] == [j.spec.job_id for j in slow[0]]
        assert all(map(operator.is_, fast[0], slow[0])) and list(fast[1].items()) == list(slow[1].items())
        sizes.append((len(fast[0]), bool(plan.admit), bool(plan.drop), sum(fast[1].values())))
        return fast

    monkeypatch.setattr(elasticflow._Context, "runnable", both)
    with_deadlines = poisson_jobs(70, rate_per_hour=40, seed=3, deadline_factor=1.2).jobs
    best_effort = [replace(s, job_id=f"b{s.job_id}") for s in poisson_jobs(50, rate_per_hour=30, seed=4).jobs]
    hopeless = [replace(s, job_id=f"h{s.job_id}", deadline=s.submit_time + 1.0) for s in with_deadlines[::10]]
    simulate([*with_deadlines, *best_effort, *hopeless], parse_cluster("n8g8"), get_policy(policy))
    assert len(sizes) > 20 and max(s[0] for s in sizes) > 5
    assert any(s[1] for s in sizes) and any(s[2] for s in sizes)  # admissions and drops
    assert any(s[3] for s in sizes)  # shares in the base


@needs_kernels
def test_placer_inputs_equal_python() -> None:
    """place_buddy's opening (the held GPUs in snapshot order, the counts
    wanted), compiled and as the Python lines compute it, on random
    snapshots and allocations: counts of 0, none, negative, bools, floats."""
    from tidal.scheduler.api import FrozenDict

    def python(ids, held, allocation):
        current = {jid: held[jid] for jid in ids if jid in held}
        want = {jid: n for jid, n in allocation.items() if n > 0} if 0 in allocation.values() else dict(allocation)
        return current, want

    rng = random.Random(9)
    for _ in range(1000):
        ids = tuple(f"j{k}" for k in rng.sample(range(30), rng.randrange(0, 20)))
        held = FrozenDict({jid: (k,) for k, jid in enumerate(ids) if rng.random() < 0.5})
        allocation = {jid: rng.choice([0, 1, 2, 4, -1, 0.0, 2.0, False, True]) for jid in ids if rng.random() < 0.7}
        fast = kernels.fast.placer_inputs(ids, held, allocation)
        slow = python(ids, held, allocation)
        assert [list(d.items()) for d in fast] == [list(d.items()) for d in slow]
        assert all(map(operator.is_, fast[0].values(), slow[0].values()))


def _elan_jobs(rng: random.Random, n: int, doubling: bool) -> list:
    """Random jobs for Elan's step order: counts in steps of one GPU (the
    rule rarely caps), or doubling ones (1, 2, 4, ...: steps of several GPUs
    that often do not fit in the GPUs left, the capped case)."""
    from tidal.scheduler.elan_order import OrderJob

    out = []
    for i in range(n):
        lo = rng.choice([1, 1, 2, 4])
        k = rng.randint(1, 5 if doubling else 12)
        counts = tuple(lo * 2**e for e in range(k)) if doubling else tuple(range(lo, lo + k))
        one = rng.uniform(0.5, 3.0)
        rates, gain = [one * lo], one
        for a, b in zip(counts, counts[1:]):  # concave, as measured curves mostly are
            gain *= rng.uniform(0.55, 0.95)
            rates.append(rates[-1] + gain * (b - a))
        running = rng.random() < 0.6
        out.append(OrderJob(f"j{i}", rng.uniform(0, 100), counts, tuple(rates), one, rng.uniform(1e3, 1e6),
                            running, rng.choice(counts) if running else 0))
    return out


@needs_kernels
def test_elan_runs_equal_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """Elan's event-driven admission estimate (both runs, from their starts
    to their sums), compiled and in Python, on random job sets: the same
    sums to the last bit, and None (capped steps) in the same cases; the
    kernel decides every case it is given (it hands none back)."""
    from tidal.scheduler import elan_event
    from tidal.scheduler.elan_order import StepOrder

    compiled = kernels.fast
    answers = {"sums": 0, "capped": 0}

    class Counting:
        def elan_runs(self, *args):
            got = compiled.elan_runs(*args)
            assert got is not NotImplemented
            answers["sums" if got else "capped"] += 1
            return got

    for seed in range(1500):
        rng = random.Random(seed)
        jobs = _elan_jobs(rng, rng.randint(3, 60), doubling=seed % 2 == 1)
        xs = list(range(len(jobs)))
        rng.shuffle(xs)
        total = max(sum(j.counts[0] for j in jobs), rng.randint(8, 4 * len(jobs)))
        members, cost = xs[: rng.randint(1, len(xs) - 1)], rng.choice([0.0, 30.0])
        w = xs[len(members)]
        monkeypatch.setattr(kernels, "fast", Counting())
        fast = elan_event.event_pair(StepOrder(jobs), members, w, total, cost)
        monkeypatch.setattr(kernels, "fast", None)
        slow = elan_event.event_pair(StepOrder(jobs), members, w, total, cost)
        assert fast == slow, seed
    assert answers["sums"] > 500 and answers["capped"] > 10


@needs_kernels
def test_elan_runs_hand_back_what_they_do_not_cover() -> None:
    """Arrays of another type, lengths that do not match, a job index out of
    range or a speed not finite: NotImplemented (the Python runs then)."""
    from tidal.scheduler.elan_event import _start, _start_late
    from tidal.scheduler.elan_order import StepOrder

    rng = random.Random(3)
    order = StepOrder(_elan_jobs(rng, 12, doubling=False))
    mask = np.zeros(12, dtype=bool)
    mask[:6] = True
    a = _start(order, mask | (np.arange(12) == 6), 64, 0.0)
    b = _start_late(order, mask, 6, 64, 0.0)
    steps = order.step_columns()
    assert kernels.fast.elan_runs(steps, a, b) not in (None, NotImplemented)
    oj, on, oc, os_ = steps
    bad_steps = [(oj.astype(np.int32), on, oc, os_), (oj, on[:-1], oc, os_), (oj + 12, on, oc, os_),
                 (oj, on, oc, np.where(np.arange(len(os_)) == 0, np.nan, os_)), (oj, on, oc)]
    for bad in bad_steps:
        assert kernels.fast.elan_runs(bad, a, b) is NotImplemented
    bad_runs = [a._replace(fin=a.fin.astype(np.float32)), a._replace(held=a.held[:-1]),
                a._replace(spd=np.where(a.present, np.inf, a.spd)), a._replace(ptr=len(oj) + 1), tuple(a)[:7]]
    for bad in bad_runs:
        assert kernels.fast.elan_runs(steps, bad, b) is NotImplemented
