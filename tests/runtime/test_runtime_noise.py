"""The gradient noise scale measured in the all-reduce (McCandlish et al.
2018, App. A) and the goodput batch choice (Pollux §3.1) with its LR rules.

In two real gloo processes: the reducer's control tail carries each rank's
squared norm of its own weighted gradient before the reduction, the reduced
squared norm is the full-batch one, and the estimates built from what the
tail carries equal the ones computed by hand from the per-rank gradients of
the same model on the same data, for uneven local batches and for an
accumulation window of uneven micro-batches. Then the pure parts: the
smoothing, n = 1 and non-finite steps, the batch choice (grows with the noise
scale, B0 for a tiny one, capped by the per-rank maximum), the exact LR
rules, the fitted step-time model and the refusal of bad arguments."""

from __future__ import annotations

import contextlib
import datetime
import math
import os

import pytest
import torch
import torch.distributed as dist

from tidal.runtime.goodput import StepSample, StepTimeModel, choose_batch, fit_step_time, lr_factor
from tidal.runtime.noise import NoiseScale, StepNorms, adascale_gain, efficiency, estimate, rank_numbers
from tidal.runtime.reducer import GradReducer
from tidal.runtime.scaling import GoodputScaling, make_policy
from runtime_helpers import run_ranks


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randn(n, 1, generator=g, dtype=torch.float64)


def _grad(idx: list[int]) -> torch.Tensor:
    """The flat gradient of the mean loss over samples ``idx``, offline."""
    m = _model()
    x, y = _data(12)
    torch.nn.functional.mse_loss(m(x[idx]), y[idx]).backward()
    return torch.cat([p.grad.flatten() for p in m.parameters()])


# rank -> micro-batches (sample indices); the global batch of each micro-batch
PLAIN = ({0: [[0, 1, 2, 3]], 1: [[4, 5, 6]]}, 7)  # uneven local batches 4 and 3
ACCUM = ({0: [[0, 1, 2, 3], [6, 7, 8]], 1: [[4, 5], [9, 10, 11]]}, 6)  # two global batches of 6, split 4/2 and 3/3
CASES = {"plain": PLAIN, "accumulate": ACCUM}


class _Tail:
    """Sends :func:`rank_numbers` in the control tail, like the step runner."""

    def __init__(self, red: GradReducer, weight: float, samples: int) -> None:
        self.red, self.weight, self.samples, self.reduced = red, weight, samples, []
        self.local_sq = self.reduced_sq = 0.0

    def sync_begin(self) -> list[float]:
        self.local_sq = self.red.local_sq
        return rank_numbers(self.red.local_sq, self.weight, self.samples)

    def sync_done(self, reduced: list[float]) -> None:
        self.reduced, self.reduced_sq = reduced, self.red.reduced_sq

    def sync_failed(self, error: Exception) -> None:
        raise error


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    x, y = _data(12)
    for case, (parts, bg) in CASES.items():
        m = _model()
        red = GradReducer(list(m.parameters()), bucket_cap_mb=0.0002)  # several buckets, launched during backward
        micro = parts[rank]
        lis = _Tail(red, sum(len(mb) for mb in micro) / bg, sum(len(mb) for mb in micro))
        red.listener, red.measure = lis, True
        for i, mb in enumerate(micro):
            red.arm(len(mb) / bg, True)
            last = i == len(micro) - 1
            with red.no_sync() if not last else contextlib.nullcontext():
                torch.nn.functional.mse_loss(m(x[mb]), y[mb]).backward()
        out[(case, rank)] = (lis.local_sq, lis.reduced, lis.reduced_sq, len(red.buckets))
        red.remove()
    dist.destroy_process_group()



@pytest.mark.timeout(90)
def test_tail_carries_rank_norms_and_estimates_match_offline() -> None:
    res = run_ranks(_worker)
    for case, (parts, bg) in CASES.items():
        idx = {r: [i for mb in parts[r] for i in mb] for r in (0, 1)}
        b = {r: len(idx[r]) for r in (0, 1)}
        big_b = b[0] + b[1]
        g = {r: _grad(idx[r]) for r in (0, 1)}  # each rank's mean gradient over its samples
        full = _grad(idx[0] + idx[1])
        for r in (0, 1):
            local_sq, reduced, reduced_sq, buckets = res[(case, r)]
            assert buckets >= 2, "the test needs a bucket launched during backward"
            assert local_sq == pytest.approx(float((b[r] / bg * g[r]).square().sum()), rel=1e-10), (case, r)
            # the reduced bucket holds (B/B_g) * the full-batch mean gradient
            assert reduced_sq == pytest.approx(float((big_b / bg * full).square().sum()), rel=1e-10), case
        assert res[(case, 0)][1] == res[(case, 1)][1] and res[(case, 0)][2] == res[(case, 1)][2]
        tail = res[(case, 0)][1]  # the listener gets the tail after the reducer's own flag
        est = estimate(StepNorms.from_tail(tail, res[(case, 0)][2]))
        # by hand: |G_small|^2 = sum_i (b_i/B) |g_i|^2 is the mean local batch's B/n; |G|^2 the global one's B
        small = sum(b[r] / big_b * float(g[r].square().sum()) for r in (0, 1))
        big = float(full.square().sum())
        b_small = big_b / 2
        grad_sq = (big_b * big - b_small * small) / (big_b - b_small)
        trace = (small - big) / (1 / b_small - 1 / big_b)
        assert est is not None
        assert est[0] == pytest.approx(grad_sq, rel=1e-9) and est[1] == pytest.approx(trace, rel=1e-9), case
        assert trace > 0  # real per-sample noise on this data


def test_estimator_is_unbiased_on_synthetic_gradients() -> None:
    """Per-sample gradients mu + noise (known |mu|^2 and tr(Sigma)), uneven
    local batches: the estimates average to the truth."""
    g = torch.Generator().manual_seed(0)
    d, sizes = 50, [5, 9, 2, 16]
    mu = torch.randn(d, generator=g, dtype=torch.float64) * 0.3
    sig = 0.5 + torch.rand(d, generator=g, dtype=torch.float64)  # per-coordinate std
    trials, acc = 4000, torch.zeros(2, dtype=torch.float64)
    for _ in range(trials):
        ranks = [mu + (torch.randn(b, d, generator=g, dtype=torch.float64) * sig).mean(0) for b in sizes]
        total = sum(sizes)
        w = [b / total for b in sizes]
        v = sum(wi * gi for wi, gi in zip(w, ranks))
        tail = [sum(x) for x in zip(*(rank_numbers(float((wi * gi).square().sum()), wi, b)
                                      for wi, gi, b in zip(w, ranks, sizes)))]
        est = estimate(StepNorms.from_tail(tail, float(v.square().sum())))
        assert est is not None
        acc += torch.tensor(est, dtype=torch.float64)
    mean = acc / trials
    assert float(mean[0]) == pytest.approx(float(mu.square().sum()), rel=0.05)
    assert float(mean[1]) == pytest.approx(float(sig.square().sum()), rel=0.03)


def test_smoothing_one_replica_and_non_finite_steps() -> None:
    ns = NoiseScale(decay=0.5)
    assert ns.noise_scale is None and ns.gain(64, 16) == 1.0
    ns.update((2.0, 100.0))
    assert ns.noise_scale == pytest.approx(50.0) and ns.grad_sq_est == pytest.approx(2.0)
    ns.update((1.0, 100.0))  # numerator and denominator smoothed separately: 100 / ((0.5 * 2 + 1) / 1.5)
    assert ns.noise_scale == pytest.approx(75.0)
    assert ns.grad_sq_est == pytest.approx((0.25 * 2 + 0.5 * 1) / 0.75)  # bias-corrected
    before = ns.state_dict()
    one = StepNorms(small_sq=4.0, weight=1.0, samples=8, replicas=1, total_sq=4.0)
    bad = StepNorms(small_sq=math.inf, weight=1.0, samples=8, replicas=2, total_sq=1.0)
    for s in (one, bad):
        assert estimate(s) is None
        assert not ns.update(estimate(s))
    assert {k: v for k, v in ns.state_dict().items() if k != "skipped"} == \
        {k: v for k, v in before.items() if k != "skipped"} and ns.skipped == 2
    again = NoiseScale.from_state(ns.state_dict())
    assert again.noise_scale == ns.noise_scale
    ns.update((-5.0, 10.0))  # a smoothed |grad|^2 at or below 0: all noise
    ns.update((-5.0, 10.0))
    assert ns.noise_scale == math.inf and efficiency(math.inf, 64, 16) == 1.0


def test_lr_rules_exact() -> None:
    phi, b0, b = 100.0, 16, 64
    s = b / b0
    mu2, tr = 2.0, 2.0 * phi  # AdaScale in its own terms: sigma^2 = tr(Sigma)/B0 at the base batch
    sigma2 = tr / b0
    assert lr_factor("adascale", phi, b, b0) == pytest.approx((sigma2 + mu2) / (sigma2 / s + mu2), rel=1e-12)
    assert adascale_gain(phi, b, b0) == pytest.approx(s * (phi + b0) / (phi + b), rel=1e-12)
    assert lr_factor("sqrt", phi, b, b0) == pytest.approx(2.0) and lr_factor("linear", phi, b, b0) == 4.0
    assert lr_factor("adascale", 0.0, b, b0) == pytest.approx(1.0)  # no noise: a bigger batch is no faster
    assert lr_factor("adascale", math.inf, b, b0) == pytest.approx(s)  # all noise: linear
    assert lr_factor("adascale", None, b, b0) == 1.0
    assert 1.0 <= lr_factor("adascale", 37.0, b, b0) <= s


MODEL = StepTimeModel(alpha=0.002, beta=0.0004, overheads={1: 0.005, 2: 0.03, 4: 0.04})


def test_batch_grows_with_noise_scale_and_respects_limits() -> None:
    chosen = [choose_batch(phi, 32, 4096, None, 4, MODEL) for phi in (0.01, 10, 100, 1000, 10_000, math.inf)]
    assert chosen[0] == 32  # a tiny noise scale: a bigger batch only wastes samples
    assert chosen == sorted(chosen) and chosen[-1] > chosen[2] > 32
    assert chosen[-1] == 4096
    capped = choose_batch(10_000, 32, 4096, 64, 4, MODEL)
    assert capped == 4 * 64  # at most max_local per rank
    assert choose_batch(10_000, 32, 4096, 4, 4, MODEL) == 32  # never below B0, even over the cap
    # the choice is the goodput maximum among all candidates
    phi = 300.0
    best = max(range(32, 4097), key=lambda b: MODEL.throughput(4, b) * efficiency(phi, b, 32))
    assert choose_batch(phi, 32, 4096, None, 4, MODEL) == best


def test_step_time_model_fits_measurements() -> None:
    truth = StepTimeModel(0.01, 0.002, {2: 0.05, 4: 0.07})
    pts = [StepSample(n, b, 10, truth.alpha + truth.beta * b, truth.step_time(n, b)) for n, b in
           ((2, 16), (4, 8), (4, 32))]
    m = fit_step_time(pts)
    assert m.alpha == pytest.approx(0.01) and m.beta == pytest.approx(0.002)
    assert m.overheads == pytest.approx({2: 0.05, 4: 0.07})
    assert m.overhead(3) == pytest.approx(0.07) and m.overhead(8) == pytest.approx(0.07)  # nearest, larger on ties
    one = fit_step_time([StepSample(2, 16, 5, 0.032, 0.05)])
    assert one.alpha == 0.0 and one.beta == pytest.approx(0.002)
    assert fit_step_time([]).step_time(4, 100) == 0.0


def test_goodput_policy_at_switches_and_state_roundtrip() -> None:
    p = make_policy("goodput", 16, max_batch=512, lr_rule="sqrt", drift=None)
    assert isinstance(p, GoodputScaling) and p.start(2) == 16
    assert p.rescale(5, 2, 4) == 16 and p.lr_factor(5) == 1.0  # no estimate yet: the batch stays
    for _ in range(30):
        p.observe(StepNorms(small_sq=3.0, weight=1.0, samples=16, replicas=2, total_sq=1.2),
                  StepSample(2, 8, 1, 0.004, 0.04))
    phi = p.noise.noise_scale
    assert phi is not None and phi > 16
    new = p.rescale(40, 2, 4)
    assert new > 16 and p.lr_factor(40) == pytest.approx(math.sqrt(new / 16))
    q = make_policy("goodput", 16, max_batch=512, lr_rule="sqrt", drift=None)
    q.load_state_dict(p.state_dict())
    assert q.noise is not p.noise and q.noise.noise_scale == phi and q.batch == new and q.rescale(41, 4, 2) == \
        p.rescale(41, 4, 2)


def test_drift_changes_the_batch_between_switches() -> None:
    p = make_policy("goodput", 16, max_batch=512, drift=2.0)
    quiet = StepNorms(small_sq=1.0 + 1e-3, weight=1.0, samples=16, replicas=2, total_sq=1.0)  # tiny noise
    for _ in range(25):
        p.observe(quiet, StepSample(2, 8, 1, 0.004, 0.04))
    assert p.revise(25, 2) is None and p.batch == 16  # chosen once: B0 for a tiny noise scale
    assert p.revise(26, 2) is None
    noisy = StepNorms(small_sq=3.0, weight=1.0, samples=16, replicas=2, total_sq=1.0)
    changed = None
    for s in range(27, 200):
        p.observe(noisy, StepSample(2, 8, 1, 0.004, 0.04))
        changed = changed or p.revise(s, 2)
    assert changed is not None and changed > 16 and p.batch >= changed
    assert p.chosen_at is not None and p.lr_factor(200) == pytest.approx(adascale_gain(p.chosen_at, p.batch, 16))


@pytest.mark.parametrize("kw, what", [
    ({"lr_rule": "cubic"}, "lr_rule"), ({"max_batch": 8}, "max_batch"), ({"max_local": 0}, "max_local"),
    ({"drift": 0.5}, "drift"), ({"bogus": 1}, "bogus")])
def test_bad_arguments_are_refused_by_name(kw: dict, what: str) -> None:
    with pytest.raises(ValueError) as e:
        make_policy("goodput", 16, **kw)
    msg = str(e.value)
    assert what in msg and "\n" not in msg


def test_noise_scale_on_any_policy() -> None:
    p = make_policy("strong", 32, noise_scale=True)
    assert p.noise is not None and p.report(0)["noise_scale"] is None
    p.observe(StepNorms(small_sq=3.0, weight=1.0, samples=32, replicas=2, total_sq=1.0), None)
    rep = p.report(0)
    assert rep["noise_scale"] > 0 and rep["batch"] == 32 and rep["estimates"] == 1
    assert make_policy("strong", 32).noise is None
