"""Prometheus text metrics of the gateway, kept in plain dicts (no locks on the event loop:
every hot-path update happens on the loop's single thread)."""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable

# Seconds. Fine at the low end: the gateway's own overhead is expected well under a millisecond.
_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
            1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    """Cumulative-bucket histogram in Prometheus' sense (counts per upper bound)."""

    def __init__(self) -> None:
        self.counts = [0] * (len(_BUCKETS) + 1)
        self.total = 0.0
        self.num = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(_BUCKETS, value)] += 1
        self.total += value
        self.num += 1

    def render(self, name: str, labels: str) -> list[str]:
        sep = "," if labels else ""
        out, running = [], 0
        for bound, count in zip((*_BUCKETS, float("inf")), self.counts, strict=True):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {running}')
        brace = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{brace} {self.total}")
        out.append(f"{name}_count{brace} {self.num}")
        return out


class Metrics:
    """Counters and histograms of requests, plus gauges read at scrape time."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self.latency: dict[str, Histogram] = defaultdict(Histogram)
        self.overhead: dict[str, Histogram] = defaultdict(Histogram)
        self.captures_spooled = 0
        self.captures_dropped = 0
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}

    def request(self, provider: str, route: str, status: int, seconds: float,
                upstream_seconds: float | None) -> None:
        self.requests[(provider, route, status)] += 1
        self.latency[provider].observe(seconds)
        if upstream_seconds is not None:
            self.overhead[provider].observe(max(0.0, seconds - upstream_seconds))

    def gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self.gauges[name] = (help_text, read)

    def render(self) -> bytes:
        lines = ["# HELP factory_gateway_requests_total Requests answered, by provider, route "
                 "and status.", "# TYPE factory_gateway_requests_total counter"]
        for (provider, route, status), n in sorted(self.requests.items()):
            lines.append(f'factory_gateway_requests_total{{provider="{provider}",'
                         f'route="{route}",status="{status}"}} {n}')
        for name, help_text, hists in (
                ("factory_gateway_request_duration_seconds",
                 "Time from request received to response complete.", self.latency),
                ("factory_gateway_overhead_seconds",
                 "Request duration minus time spent waiting on the upstream.", self.overhead)):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
            for provider, hist in sorted(hists.items()):
                lines += hist.render(name, f'provider="{provider}"')
        for name, help_text, value in (
                ("factory_gateway_captures_spooled_total", "Captures written to the spool.",
                 self.captures_spooled),
                ("factory_gateway_captures_dropped_total",
                 "Captures that could not be spooled (must stay 0).", self.captures_dropped)):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
        for name, (help_text, read) in sorted(self.gauges.items()):
            kind = "counter" if name.endswith("_total") else "gauge"
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                      f"{name} {read()}"]
        return ("\n".join(lines) + "\n").encode()
