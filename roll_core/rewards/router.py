"""Route each sample to its domain's reward, run it safely, count what happened.

:class:`RewardRouter` is what the rollout scheduler calls when a response completes::

    router = RewardRouter.from_config(cfg.reward, dataset_domains=train_domains)
    result = router.score(RewardSample(prompt, response, row, num_tokens, "stop"))
    ...
    tracker.log(router.metrics())       # reward/<domain>/mean, accuracy, errors, timeouts

``score`` never raises for a bad sample: a function that raises, returns garbage or overruns
``timeout_s`` gives score 0 with ``info["error"]`` (and ``info["timeout"]``) set, and is
counted. It is safe to call from many threads at once.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Literal

from roll_core.config.reward import DomainRewardConfig, RewardConfig, RewardFnConfig
from roll_core.errors import ConfigError
from roll_core.rewards.base import RewardFn, RewardResult, RewardSample
from roll_core.rewards.execution import Outcome, ProcessRunner, ThreadRunner, describe_error
from roll_core.rewards.registry import WeightedSum, build_domain_reward

__all__ = ["DomainStats", "RewardRouter", "domain_metrics"]

DEFAULT_TIMEOUT_S = 5.0
UNKNOWN = "unknown_domain"


@dataclass
class DomainStats:
    """Running totals for one domain: the numbers behind ``reward/<domain>/...``."""

    count: int = 0
    score_sum: float = 0.0
    graded: int = 0
    correct: int = 0
    errors: int = 0
    timeouts: int = 0
    seconds_sum: float = 0.0

    def add(self, result: RewardResult, seconds: float = 0.0) -> None:
        """Count one scored sample (``info["correct"]``, ``error``, ``timeout`` are read)."""
        self.count += 1
        self.score_sum += result.score
        self.seconds_sum += seconds
        correct = result.info.get("correct")
        if isinstance(correct, bool):
            self.graded += 1
            self.correct += int(correct)
        if result.info.get("timeout"):
            self.timeouts += 1
        elif result.info.get("error") is not None:
            self.errors += 1

    def metrics(self, domain: str) -> dict[str, float]:
        """``reward/<domain>/{count,mean,accuracy,errors,timeouts,time_ms}``.

        ``accuracy`` is ``correct / (graded + errors + timeouts)``: samples whose function
        reports a bool ``info["correct"]``, with failed samples counted as wrong. ``mean``
        and ``accuracy`` are left out when nothing was scored (or graded), so a tracker never
        plots a fake 0.
        """
        prefix = f"reward/{domain}"
        out = {
            f"{prefix}/count": float(self.count),
            f"{prefix}/errors": float(self.errors),
            f"{prefix}/timeouts": float(self.timeouts),
        }
        if self.count:
            out[f"{prefix}/mean"] = self.score_sum / self.count
            out[f"{prefix}/time_ms"] = 1000.0 * self.seconds_sum / self.count
        if self.graded:  # a sample whose reward failed counts as wrong
            out[f"{prefix}/accuracy"] = self.correct / (self.graded + self.errors + self.timeouts)
        return out


def domain_metrics(
    domains: Sequence[str | None], results: Sequence[RewardResult]
) -> dict[str, float]:
    """Per-domain metrics of one batch of scored samples (e.g. the batch that is trained on).

    Args:
        domains: the domain of each sample (None is reported as ``unknown_domain``).
        results: the reward of each sample, same length.

    Returns:
        ``reward/<domain>/count``, ``mean``, ``accuracy`` (see :meth:`DomainStats.metrics`),
        ``errors`` and ``timeouts`` for every domain present.
    """
    if len(domains) != len(results):
        raise ValueError(f"{len(domains)} domains for {len(results)} results")
    stats: dict[str, DomainStats] = {}
    for domain, result in zip(domains, results, strict=True):
        stats.setdefault(domain or UNKNOWN, DomainStats()).add(result)
    out: dict[str, float] = {}
    for domain in sorted(stats):
        metrics = stats[domain].metrics(domain)
        metrics.pop(f"reward/{domain}/time_ms", None)
        out.update(metrics)
    return out


def check_dataset_domains(
    dataset_domains: Iterable[str | None],
    *,
    domains: Iterable[str],
    default_domain: str | None,
    domain_key: str,
    where: str = "the data",
) -> None:
    """Raise a ConfigError if a domain of the data (None: a row without one) has no reward.

    Pure: `roll validate` calls it on the domains of local data before any reward is built."""
    configured = sorted(domains)
    seen = {None if d is None else str(d) for d in dataset_domains}
    missing = sorted(str(d) for d in seen if d is not None and d not in configured)
    if missing:
        raise ConfigError(
            f"{where} has domain(s) {', '.join(map(repr, missing))} with no reward; "
            f"configured domains: {', '.join(configured)}.",
            hint="Add them under reward.domains (e.g. `reward.domains."
            f"{missing[0]}=math`), or filter those rows out of the data.",
        )
    if None in seen and default_domain is None:
        raise ConfigError(
            f"some rows of {where} have no {domain_key!r} value and reward.default_domain is "
            f"not set, so no reward can score them (configured domains: "
            f"{', '.join(configured)}).",
            hint=f"Set reward.default_domain (one of {', '.join(configured)}), add a "
            f"{domain_key!r} column to the data, or point reward.domain_key at the column that "
            "names each row's domain.",
        )


class RewardRouter:
    """Scores samples with the reward of their row's domain, robustly and thread-safely.

    Args:
        domains: domain name -> a ``DomainRewardConfig`` / ``RewardFnConfig`` section, a
            reward name or dotted path (``"math"``, ``"pkg.mod:fn"``), or a callable
            ``fn(sample) -> RewardResult | float`` (must be picklable under ``process``).
        dataset_domains: the domains that occur in the data, when known; one without a
            reward (or None without ``default_domain``) is a ConfigError here.
        default_domain: domain for rows that have no domain value.
        domain_key: the row column holding the domain.
        isolation: ``"process"`` (kill on timeout) or ``"thread"``; see
            :mod:`roll_core.rewards.execution`.
        num_workers: worker processes under ``process`` isolation.
        timeouts: domain -> seconds, for domains given as names or callables
            (default 5 s; a ``DomainRewardConfig`` carries its own ``timeout_s``).
        isolations: domain -> ``"process"`` / ``"thread"`` overriding ``isolation`` for
            that domain (``code`` and ``judge`` domains run in threads: they bound their own
            work and keep state across calls).

    Raises:
        ConfigError: no domains, an unknown reward name, a user function that cannot be
            imported, a domain of the data without a reward, or a function that cannot be
            sent to worker processes.
    """

    def __init__(
        self,
        domains: Mapping[str, Any],
        *,
        dataset_domains: Iterable[str | None] | None = None,
        default_domain: str | None = None,
        domain_key: str = "domain",
        isolation: Literal["process", "thread"] = "process",
        num_workers: int = 2,
        timeouts: Mapping[str, float] | None = None,
        isolations: Mapping[str, str | None] | None = None,
    ) -> None:
        if not domains:
            raise ConfigError(
                "no reward domains are configured.",
                hint="Add one under reward.domains, e.g. `reward.domains.math=math`.",
            )
        if default_domain is not None and default_domain not in domains:
            raise ConfigError(
                f"default domain {default_domain!r} has no reward; configured domains: "
                f"{', '.join(sorted(domains))}.",
                hint="Set reward.default_domain to one of them, or add it to reward.domains.",
            )
        self.domain_key = domain_key
        self.default_domain = default_domain
        fns: dict[str, RewardFn] = {}
        self.timeouts: dict[str, float] = {}
        for name, spec in domains.items():
            fns[name], self.timeouts[name] = _build(spec, (timeouts or {}).get(name))
        if dataset_domains is not None:
            self.check_domains(dataset_domains)
        if isolation not in ("process", "thread"):
            raise ConfigError(f"isolation must be 'process' or 'thread', not {isolation!r}.")
        modes = {name: (isolations or {}).get(name) or isolation for name in fns}
        for name, mode in modes.items():
            if mode not in ("process", "thread"):
                raise ConfigError(f"isolation of domain {name!r} must be 'process' or 'thread'.")
        self._fns = fns
        self._isolations = modes
        in_process = {n: f for n, f in fns.items() if modes[n] == "process"}
        in_threads = {n: f for n, f in fns.items() if modes[n] == "thread"}
        self._runners: dict[str, ProcessRunner | ThreadRunner] = {}
        if in_process:
            _check_importable(in_process)
            try:
                process_runner = ProcessRunner(in_process, num_workers=num_workers)
            except (pickle.PicklingError, TypeError, AttributeError) as err:
                raise ConfigError(
                    f"a reward function cannot be sent to worker processes: {err}.",
                    hint="Define it at module level (no lambda or closure), or set "
                    "reward.isolation: thread.",
                ) from None
            self._runners.update(dict.fromkeys(in_process, process_runner))
        if in_threads:
            thread_runner = ThreadRunner(in_threads)
            self._runners.update(dict.fromkeys(in_threads, thread_runner))
        self._runner = (
            self._runners[next(n for n in fns if modes[n] == isolation)]
            if any(m == isolation for m in modes.values())
            else next(iter(self._runners.values()))
        )
        self.isolation = isolation
        self._lock = threading.Lock()
        self._window = {name: DomainStats() for name in fns}
        self._totals = {name: DomainStats() for name in fns}
        self._unknown_window = 0
        self._unknown_total = 0

    @classmethod
    def from_config(
        cls, cfg: RewardConfig, *, dataset_domains: Iterable[str | None] | None = None
    ) -> RewardRouter:
        """Build the router a recipe's ``reward`` section describes."""
        return cls(
            cfg.domains,
            dataset_domains=dataset_domains,
            default_domain=cfg.default_domain,
            domain_key=cfg.domain_key,
            isolation=cfg.isolation,
            num_workers=cfg.num_workers,
            isolations={
                name: spec.effective_isolation(cfg.isolation) for name, spec in cfg.domains.items()
            },
        )

    @property
    def runner(self) -> ProcessRunner | ThreadRunner:
        """What runs the functions (``replaced`` workers, ``stuck()`` threads)."""
        return self._runner

    @property
    def domains(self) -> list[str]:
        """The configured domain names."""
        return list(self._totals)

    def check_domains(self, dataset_domains: Iterable[str | None]) -> None:
        """Raise a ConfigError if some domain of the data has no reward."""
        check_dataset_domains(
            dataset_domains,
            domains=list(self.timeouts),
            default_domain=self.default_domain,
            domain_key=self.domain_key,
        )

    def domain_of(self, sample: RewardSample) -> str | None:
        """The domain that scores ``sample``: its row's value, else the default domain."""
        value = sample.row.get(self.domain_key)
        return self.default_domain if value is None else str(value)

    def score(self, sample: RewardSample) -> RewardResult:
        """The reward of one sample. Never raises for a failing reward function.

        ``info`` always has ``error`` (None or the reason) and ``timeout`` (bool) besides
        the function's own keys; a failed or unroutable sample scores 0.0.
        """
        domain = self.domain_of(sample)
        if domain is None or domain not in self.timeouts:
            with self._lock:
                self._unknown_window += 1
                self._unknown_total += 1
            reason = f"no reward for domain {domain!r} (configured: {', '.join(self.domains)})"
            return RewardResult(0.0, {"error": reason, "timeout": False, "unknown_domain": True})
        try:
            outcome: Outcome = self._runners[domain].run(domain, sample, self.timeouts[domain])
        except Exception as err:  # the runner itself failed (e.g. no process could start)
            outcome = Outcome(None, "reward runner failed: " + describe_error(err))
        if outcome.result is not None:
            result = RewardResult(
                outcome.result.score, {**outcome.result.info, "error": None, "timeout": False}
            )
        else:
            result = RewardResult(0.0, {"error": outcome.error, "timeout": outcome.timed_out})
        with self._lock:
            self._window[domain].add(result, outcome.seconds)
            self._totals[domain].add(result, outcome.seconds)
        return result

    def score_many(self, samples: Sequence[RewardSample]) -> list[RewardResult]:
        """Score several samples concurrently (as many at once as there are workers)."""
        width = max(getattr(r, "num_workers", 4) for r in self._runners.values())
        if len(samples) <= 1:
            return [self.score(s) for s in samples]
        with ThreadPoolExecutor(max_workers=min(width, len(samples))) as pool:
            return list(pool.map(self.score, samples))

    def metrics(self, *, reset: bool = True) -> dict[str, float]:
        """Metrics of the samples scored since the last ``metrics()`` call (or ever).

        Keys: ``reward/<domain>/{count,mean,accuracy,errors,timeouts,time_ms}`` for every
        configured domain and ``reward/unknown_domain/count`` (samples with no reward). With
        ``reset=False`` the window is kept open.
        """
        with self._lock:
            out: dict[str, float] = {}
            for domain, stats in self._window.items():
                out.update(stats.metrics(domain))
            out[f"reward/{UNKNOWN}/count"] = float(self._unknown_window)
            for domain, fn in self._fns.items():  # code/judge metrics (thread isolation)
                own = getattr(fn, "metrics", None)
                if self._isolations[domain] == "thread" and callable(own):
                    out.update({f"reward/{domain}/{k}": v for k, v in own(reset=reset).items()})
            if reset:
                self._window = {name: DomainStats() for name in self._window}
                self._unknown_window = 0
        return out

    def totals(self) -> dict[str, DomainStats]:
        """Cumulative counters per domain since construction (or the restored state)."""
        with self._lock:
            return {name: DomainStats(**asdict(s)) for name, s in self._totals.items()}

    @property
    def unknown_total(self) -> int:
        """Samples that had no reward for their domain, since construction."""
        with self._lock:
            return self._unknown_total

    def state_dict(self) -> dict[str, Any]:
        """The cumulative counters, for a checkpoint (plain JSON-able values)."""
        with self._lock:
            return {
                "totals": {name: asdict(s) for name, s in self._totals.items()},
                "unknown_total": self._unknown_total,
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore counters saved by :meth:`state_dict` (domains no longer configured are dropped)."""
        with self._lock:
            for name, values in state.get("totals", {}).items():
                if name in self._totals:
                    self._totals[name] = DomainStats(**values)
            self._unknown_total = int(state.get("unknown_total", 0))

    def check_rows(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Validate dataset rows with their domain's reward (a ``code`` row's tests, an
        ``instructions`` row's constraints): call at data loading.

        Raises:
            DataError: the first malformed row, named by its index.
        """
        for i, row in enumerate(rows):
            value = row.get(self.domain_key)
            domain = self.default_domain if value is None else str(value)
            check = getattr(self._fns.get(domain or ""), "check_row", None)
            if callable(check):
                check(row, f"row {i} (domain {domain!r})")

    def close(self) -> None:
        """Stop the worker processes. The router cannot score after this."""
        for runner in set(self._runners.values()):
            runner.close()
        for domain, fn in self._fns.items():
            close = getattr(fn, "close", None)
            if self._isolations[domain] == "thread" and callable(close):
                close()

    def __enter__(self) -> RewardRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_importable(fns: Mapping[str, RewardFn]) -> None:
    """Worker processes import functions by module name; ``__main__`` is not theirs."""
    for domain, fn in fns.items():
        parts = fn.parts if isinstance(fn, WeightedSum) else ((domain, 1.0, fn),)
        for label, _, part in parts:
            module = getattr(part, "__module__", None) or type(part).__module__
            if module == "__main__":
                raise ConfigError(
                    f"reward {label!r} of domain {domain!r} is defined in the script being "
                    "run (__main__); worker processes cannot import it from there.",
                    hint="Move it into a module and name it 'module:function', or set "
                    "reward.isolation: thread.",
                )


def _build(spec: Any, timeout: float | None) -> tuple[RewardFn, float]:
    if isinstance(spec, DomainRewardConfig):
        return build_domain_reward(spec), spec.timeout_s if timeout is None else timeout
    if isinstance(spec, str | RewardFnConfig):
        return build_domain_reward(spec), DEFAULT_TIMEOUT_S if timeout is None else timeout
    if callable(spec):
        label = getattr(spec, "__name__", type(spec).__name__)
        return WeightedSum(((label, 1.0, spec),)), DEFAULT_TIMEOUT_S if timeout is None else timeout
    raise ConfigError(
        f"a reward domain spec must be a reward name, a dotted path, a reward section or a "
        f"function, not {type(spec).__name__}."
    )
