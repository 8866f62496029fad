"""The factory's privacy budget: a durable ledger of every DP charge, and its enforcement.

The budget (epsilon_max, delta) is factory configuration; nothing the server sends can raise it or
lower the noise. Before a round trains, the agent computes the epsilon the full history *plus this
round* would reach and refuses the round if that exceeds epsilon_max. The charge is committed
(SQLite, synchronous=FULL) before training starts, so a crash or kill -9 can only over-count.

Beside DP-SGD's steps a factory releases one statistic of its training images: its class counts, whose
total weights its updates and which a distillation round weights its predictions with. They leave as one
Gaussian release, charged here and
kept, so every later round reuses the same noisy counts at no further cost (`PrivacyLedger.release`);
the noise of DP-SGD is planned with that release inside the budget (`noise_for_budget`'s ``reserved``).
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from common.clip import DEFAULT_CLIP_NORM, PUBLIC_NORM, PUBLIC_NORM_FRACTION, parse_clip_norm


class BudgetExhausted(RuntimeError):
    """Training this round would exceed the factory's privacy budget; nothing is trained or sent."""


@dataclass(frozen=True)
class PrivacyBudget:
    epsilon_max: float
    delta: float
    # Per-example clipping norm, or PUBLIC_NORM: from public images where there are some, else 1.0 (`clip_norm`)
    max_grad_norm: float | str = DEFAULT_CLIP_NORM
    planned_rounds: int = 20  # the noise is chosen so that this many rounds fit the budget
    grad_sample_mode: str = "hooks"  # hooks | ew | functorch | ghost (ghost_fsdp under FSDP)
    # One full-batch DP step per round whose noise this factory shares with the other honest inputs of the secure sum
    # (--dp-secure-sum; client.trainer, docs/security.md); False: local DP-SGD, every update private on its own
    secure_sum: bool = False
    # Noise multiplier of the one release of the factory's training class counts (sensitivity 1: adding or removing an image
    # changes one count by one); 4 adds about 1% to DP-SGD's noise at epsilon 8 and leaves each count +-4 (docs/security.md)
    count_noise: float = 4.0

    def __post_init__(self) -> None:
        if not (self.epsilon_max > 0 and math.isfinite(self.epsilon_max)):
            raise ValueError(f"--dp-epsilon must be a positive number, got {self.epsilon_max}")
        if not 0 < self.delta < 1:
            raise ValueError(f"--dp-delta must be in (0, 1), got {self.delta}")
        try:  # the option's own rule (common.clip), on a value already in its parsed form
            parsed = parse_clip_norm(self.max_grad_norm) == self.max_grad_norm
        except ValueError:
            parsed = False
        if not parsed:
            raise ValueError(f"--dp-max-grad-norm must be a positive number or {PUBLIC_NORM!r}, got {self.max_grad_norm!r}")
        if self.planned_rounds < 1:
            raise ValueError(f"--dp-planned-rounds must be >= 1, got {self.planned_rounds}")
        if not (self.count_noise > 0 and math.isfinite(self.count_noise)):
            raise ValueError(f"--dp-count-noise must be a positive number, got {self.count_noise}")

    def clip_norm(self, public_feature_norm: float | None) -> float:
        """The per-example clipping norm of this round's DP training: the number set with --dp-max-grad-norm, or for
        ``public`` (the default) the following.

        The one full-batch step of --dp-secure-sum within a public subspace clips at `PUBLIC_NORM_FRACTION` (a fifth) of
        ``public_feature_norm``, the median norm of the public images' coordinates there
        (`client.subspace.PublicSubspace.feature_norm`). An example's gradient there is its residual p - y (norm at most
        sqrt 2) times that input, so an example the model is already fairly sure of (residual below a fifth) keeps its
        own gradient's size while the others are cut to the same norm. Every other DP path clips at 1.0.
        Measured at epsilon 8, three seeds, five data sets (docs/benchmarks.md): a fifth of the norm scored 1 to 3.5 points
        above clipping at 1 on three of them and within a point on the other two, while the whole norm lost 3 to 4 points
        where factories hold few images (its noise, proportional to the norm, outweighs their signal). A fraction of the
        norm, not a number, because the features' scale is the backbone's. The norm comes from public images only, so it
        costs no privacy; the noise scales with it, so a public set chosen badly costs accuracy, never privacy."""
        if self.max_grad_norm != PUBLIC_NORM:
            return float(self.max_grad_norm)
        if self.secure_sum and public_feature_norm is not None:
            return PUBLIC_NORM_FRACTION * float(public_feature_norm)
        return 1.0

    @property
    def reserved(self) -> tuple[tuple[float, float, int], ...]:
        """The releases besides DP-SGD's steps that the plan keeps room for: one Gaussian release of the class counts."""
        return ((self.count_noise, 1.0, 1),)


@dataclass(frozen=True)
class Charge:
    run_id: str
    server_round: int
    noise_multiplier: float
    sample_rate: float
    steps: int
    delta: float
    created_at: float
    noise_holders: int = 1  # honest inputs of the secure sum whose noise, with this factory's, makes noise_multiplier (1: its own)


def alone(history: list[tuple[float, float, int, int]]) -> list[tuple[float, float, int]]:
    """A history of (noise of the sum, rate, steps, noise holders) as this factory's own noise alone: noise / sqrt(holders)."""
    return [(noise / math.sqrt(holders), rate, steps) for noise, rate, steps, holders in history]


def epsilon_of(history: list[tuple[float, float, int]], delta: float) -> float:
    """Epsilon at ``delta`` of a history of (noise multiplier, sample rate, steps): the tightest of the valid bounds.

    A history of full-batch Gaussian releases only (sample rate 1: the class counts, `--dp-secure-sum`'s one step per
    round, DP-SGD at a factory no larger than its batch) is accounted exactly (`gaussian_epsilon`). Any other history
    (Poisson-subsampled DP-SGD steps) gets the smaller of two upper bounds from Opacus' accountants: RDP, and the PRV
    accountant's upper bound (Gopi et al. 2021, its numerical error included), each valid on its own. Where both apply,
    RDP is the looser: at epsilon 8 it asks for about 6% more noise (docs/benchmarks.md).
    """
    if not history:
        return 0.0
    if full_batch(history):
        return gaussian_epsilon(gaussian_mu(history), delta)
    rdp = _rdp_epsilon(history, delta)
    return min(rdp, _prv_epsilon(history, delta, eps_error=max(0.01, PRV_RELATIVE_ERROR * rdp)))


def full_batch(history: list[tuple[float, float, int]] | tuple[tuple[float, float, int], ...]) -> bool:
    """Every release in ``history`` has sample rate 1: Gaussian releases that `gaussian_mu` composes exactly."""
    return all(rate == 1.0 for _, rate, _ in history)


def _merged(history: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    merged: dict[tuple[float, float], int] = defaultdict(int)
    for noise, rate, steps in history:
        merged[(noise, rate)] += steps
    return [(noise, rate, steps) for (noise, rate), steps in merged.items()]


def _rdp_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = _merged(history)
    return float(accountant.get_epsilon(delta=delta))


# The PRV accountant's allowed error in epsilon, relative to the RDP bound: its cost grows with epsilon / error (a ledger of
# thousands of steps at epsilon ~100 took 35 s at an error of 0.01, 4 s at 0.05). Its upper bound includes the error.
PRV_RELATIVE_ERROR = 0.005


@lru_cache(maxsize=1024)
def _prv_of(history: tuple[tuple[float, float, int], ...], delta: float, eps_error: float) -> float:
    import warnings

    from opacus.accountants import PRVAccountant

    accountant = PRVAccountant()
    accountant.history = list(history)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            epsilon = float(accountant.get_epsilon(delta=delta, eps_error=eps_error))
    except (ValueError, ArithmeticError, RuntimeError):  # outside its numerical domain: the RDP bound stands alone
        return math.inf
    return epsilon if math.isfinite(epsilon) and epsilon >= 0 else math.inf


def _prv_epsilon(history: list[tuple[float, float, int]], delta: float, eps_error: float) -> float:
    return _prv_of(tuple(sorted(_merged(history))), delta, round(eps_error, 4))


def gaussian_mu(history: list[tuple[float, float, int]]) -> float:
    """mu of the Gaussian DP that ``history``'s full-batch releases compose to: sqrt(sum of steps / noise^2).

    Each release adds Gaussian noise of ``noise`` times the sensitivity, i.e. it is (1 / noise)-GDP, and adaptive
    composition of Gaussian DP is exact: the mus add in quadrature (Dong, Roth and Su 2022, "Gaussian differential
    privacy", Corollary 3.3)."""
    return math.sqrt(sum(steps / noise**2 for noise, _, steps in history))


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The smallest epsilon for which mu-GDP implies (epsilon, delta)-DP: the exact dual (Dong, Roth and Su, Corollary
    2.13; Balle and Wang 2018), solved by Opacus' `eps_from_mu`. 0 where even epsilon 0 holds; inf beyond 500."""
    from opacus.accountants.analysis.gdp import delta_eps_mu, eps_from_mu

    if mu <= 0 or delta_eps_mu(eps=0.0, mu=mu) <= delta:
        return 0.0
    if delta_eps_mu(eps=500.0, mu=mu) > delta:
        return math.inf
    return float(eps_from_mu(mu=mu, delta=delta))


def gaussian_mu_for(epsilon: float, delta: float) -> float:
    """The largest mu whose mu-GDP still gives (epsilon, delta)-DP (`gaussian_epsilon`'s inverse in mu)."""
    from opacus.accountants.analysis.gdp import delta_eps_mu
    from scipy.optimize import brentq

    return float(brentq(lambda mu: delta_eps_mu(eps=epsilon, mu=mu) - delta, 1e-6, 100.0, xtol=1e-12))


@lru_cache(maxsize=64)
def noise_for_budget(epsilon_max: float, delta: float, sample_rate: float, total_steps: int,
                     reserved: tuple[tuple[float, float, int], ...] = ()) -> float:
    """The noise multiplier that spends the whole budget over ``total_steps`` steps, leaving room for the ``reserved``
    releases (noise multiplier, sample rate, steps) that the same budget must also pay for."""
    from opacus.accountants.utils import get_noise_multiplier

    def refused(why: str) -> BudgetExhausted:
        return BudgetExhausted(
            f"no noise level fits {total_steps} DP steps at sample rate {sample_rate:.4f} into epsilon_max {epsilon_max} "
            f"(delta {delta}){' beside the class-count release' if reserved else ''}: {why} The round is refused and nothing is sent; "
            f"raise --dp-epsilon or lower --dp-planned-rounds or the local epochs.")

    def spend(noise: float) -> float:
        return epsilon_of([(noise, sample_rate, total_steps), *reserved], delta)

    reserved_spend = epsilon_of(list(reserved), delta)
    if full_batch([(0.0, sample_rate, total_steps), *reserved]):  # exact: the mus add in quadrature
        room = gaussian_mu_for(epsilon_max, delta) ** 2 - gaussian_mu(list(reserved)) ** 2
        if room <= 0:
            raise refused(f"the class-count release alone spends {reserved_spend:.3f}.")
        noise = math.sqrt(total_steps / room)
        while spend(noise) > epsilon_max:  # root-finding tolerance: never over
            noise *= 1 + 1e-6
        return noise
    try:  # RDP's noise fits (epsilon_of is never above RDP); the tighter bounds may fit with less
        start = float(get_noise_multiplier(target_epsilon=epsilon_max, target_delta=delta, sample_rate=sample_rate, steps=total_steps, accountant="rdp"))
    except ValueError as exc:
        raise refused(str(exc)) from exc
    if reserved and reserved_spend >= epsilon_max:
        raise refused(f"the class-count release alone spends {reserved_spend:.3f}.")

    def fits(noise: float) -> bool:
        return spend(noise) <= epsilon_max

    high = start
    while not fits(high):  # with the reserved releases a little more noise is needed
        high *= 1.25
        if high > 1e6:
            raise refused("the reserved releases leave no room for any step.")
    low = high * FIRST_BRACKET  # the tighter bounds need about 6% less noise than RDP's (docs/benchmarks.md)
    while fits(low):
        high, low = low, low / 1.25
    return _smallest_fitting(fits, lambda noise: spend(noise) - epsilon_max, low, high)


FIRST_BRACKET = 0.9  # the lower end of the first bracket, relative to RDP's noise: PRV's was 0.940-0.944 of it in every plan measured


def _smallest_fitting(fits: Callable[[float], bool], excess: Callable[[float], float], low: float, high: float) -> float:
    """The smallest noise in (low, high] to 0.1% at which ``fits``, given that ``low`` does not fit and ``high`` does.

    Brent's method on the spend's excess over the budget finds the root in a few accountant calls where bisection needed
    eight (each PRV call takes 0.2 to 1 s). The answer is always a noise checked with ``fits``, so the plan never
    overspends: just above Brent's root if that fits, else bisection's."""
    from scipy.optimize import brentq

    try:
        above_root = float(brentq(excess, low, high, xtol=1e-4 * low, maxiter=20)) * (1 + 2e-4)
    except (ValueError, RuntimeError):  # no sign change it can use (an infinite spend): bisection alone
        above_root = high
    if low < above_root < high and fits(above_root):
        return above_root
    while high - low > 1e-3 * high:
        middle = (low + high) / 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


class PrivacyLedger:
    """Append-only SQLite record of DP charges for one factory, across rounds, runs and restarts.

    The ledger file belongs to the factory's state directory, and every charge in it counts, whatever
    name the factory runs under now: renaming a factory (``--factory-id``) never resets its budget.
    Each row also records the name it was charged under, for the operator.
    """

    def __init__(self, path: str | Path, factory_id: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.factory_id = factory_id
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS charges (id INTEGER PRIMARY KEY AUTOINCREMENT, factory_id TEXT NOT NULL,"
            " run_id TEXT NOT NULL, server_round INTEGER NOT NULL, noise_multiplier REAL NOT NULL, sample_rate REAL NOT NULL,"
            " steps INTEGER NOT NULL, delta REAL NOT NULL, created_at REAL NOT NULL)"
        )
        # what a charge that is not a DP-SGD round bought: the noisy statistic, kept so that it is released only once
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS releases (kind TEXT NOT NULL, data_key TEXT NOT NULL, value TEXT NOT NULL,"
            " charge_id INTEGER NOT NULL REFERENCES charges(id), PRIMARY KEY (kind, data_key))"
        )
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(charges)")}
        if "noise_holders" not in columns:  # a ledger written before --dp-secure-sum: every charge was its own noise
            self._db.execute("ALTER TABLE charges ADD COLUMN noise_holders INTEGER NOT NULL DEFAULT 1")

    def charges(self) -> list[Charge]:
        rows = self._db.execute("SELECT run_id, server_round, noise_multiplier, sample_rate, steps, delta, created_at, noise_holders FROM charges"
                                " ORDER BY id").fetchall()
        return [Charge(*row) for row in rows]

    def history(self) -> list[tuple[float, float, int]]:
        return [(c.noise_multiplier, c.sample_rate, c.steps) for c in self.charges()]

    def spent(self, delta: float) -> float:
        """Epsilon against whoever sees only what left the factory inside secure sums (all of it, for local DP-SGD)."""
        return epsilon_of(self.history(), delta)

    def spent_alone(self, delta: float) -> float:
        """Epsilon if the other inputs of every secure sum had added no noise (colluders beyond the tolerated ones, or the
        secure sum broken): the guarantee this factory's own noise gives. Equals `spent` without --dp-secure-sum."""
        return epsilon_of(alone([(c.noise_multiplier, c.sample_rate, c.steps, c.noise_holders) for c in self.charges()]), delta)

    def charge(self, budget: PrivacyBudget, run_id: str, server_round: int, noise_multiplier: float, sample_rate: float, steps: int,
               noise_holders: int = 1) -> float:
        """Record a round's charge if it fits the budget; return epsilon after it, or raise `BudgetExhausted`.

        ``noise_multiplier`` is the noise of what is released (the secure sum's, for a factory that shares it among
        ``noise_holders`` honest inputs; its own otherwise), and the budget bounds epsilon against that release.

        The check and the insert are one write transaction (``BEGIN IMMEDIATE``): two charges racing from
        two threads or processes cannot both pass a check the other would have failed.
        """
        with self._write():  # committed and fsync'd (synchronous=FULL) before any training starts
            return self._insert_charge(budget, run_id, server_round, noise_multiplier, sample_rate, steps, noise_holders,
                                       what=f"this round ({steps} DP steps at noise {noise_multiplier:.3f}, sample rate {sample_rate:.4f})")

    def release(self, budget: PrivacyBudget, run_id: str, server_round: int, kind: str, data_key: str, noise_multiplier: float,
                draw: Callable[[], list[float]]) -> list[float]:
        """The noisy value of statistic ``kind`` of the data named ``data_key``: released once, then reused.

        The first call charges one Gaussian release (sample rate 1, one step, the factory's own noise) if it fits the budget,
        and keeps ``draw()``'s value with the charge in one transaction; every later call returns that same value and charges
        nothing (the same answer again reveals nothing more). Another ``data_key`` (the data changed) is a new release.
        """
        with self._write():
            row = self._db.execute("SELECT value FROM releases WHERE kind = ? AND data_key = ?", (kind, data_key)).fetchone()
            if row is not None:
                return [float(v) for v in json.loads(row[0])]
            self._insert_charge(budget, run_id, server_round, noise_multiplier, 1.0, 1, 1,
                                what=f"releasing its {kind} (one Gaussian release at noise {noise_multiplier:.3f})")
            value = [float(v) for v in draw()]
            charge_id = self._db.execute("SELECT last_insert_rowid()").fetchone()[0]
            self._db.execute("INSERT INTO releases (kind, data_key, value, charge_id) VALUES (?, ?, ?, ?)",
                             (kind, data_key, json.dumps(value), charge_id))
            return value

    @contextmanager
    def _write(self) -> Iterator[None]:
        """One write transaction (``BEGIN IMMEDIATE``): committed if the block ends normally, rolled back on any exception."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _insert_charge(self, budget: PrivacyBudget, run_id: str, server_round: int, noise_multiplier: float, sample_rate: float, steps: int,
                       noise_holders: int, what: str) -> float:
        """Inside a write transaction: refuse (`BudgetExhausted`) or record one charge; epsilon after it."""
        history = [(n, q, k) for n, q, k in self._db.execute("SELECT noise_multiplier, sample_rate, steps FROM charges ORDER BY id")]
        after = epsilon_of(history + [(noise_multiplier, sample_rate, steps)], budget.delta)
        if after > budget.epsilon_max:
            spent = epsilon_of(history, budget.delta)
            raise BudgetExhausted(
                f"privacy budget of factory {self.factory_id} exhausted: {what} would bring epsilon from {spent:.3f} to {after:.3f} "
                f"> epsilon_max {budget.epsilon_max} (delta {budget.delta}); the round is refused and nothing is sent. "
                f"Raise --dp-epsilon on the factory to train more."
            )
        self._db.execute(
            "INSERT INTO charges (factory_id, run_id, server_round, noise_multiplier, sample_rate, steps, delta, created_at, noise_holders)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (self.factory_id, run_id, server_round, noise_multiplier, sample_rate, steps, budget.delta, time.time(), int(noise_holders)),
        )
        return after

    def close(self) -> None:
        self._db.close()
