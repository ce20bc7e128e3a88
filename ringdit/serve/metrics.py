"""``GET /metrics``: the server's state in Prometheus' text format (``prometheus_client``), for a scraper.

Each server has its own registry (never the library's global one: two servers in one process -- the tests -- must not
share counters). Numbers the engine and the queue already keep (batches, samples, model evaluations, jobs waiting) are
read when scraped, so they cannot drift from ``GET /v1/stats``; latencies are histograms observed as jobs start and
finish and as batches are sampled.
"""

from __future__ import annotations

# seconds: an 8x8 digit in tens of milliseconds up to a 14B model's long video in tens of minutes
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)


class Metrics:
    def __init__(self, server):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.job_seconds = Histogram("ringdit_job_seconds", "Seconds from a job's request to its end (queued + "
                                     "sampled + written)", ["kind", "status"], buckets=BUCKETS, registry=self.registry)
        self.queue_seconds = Histogram("ringdit_queue_wait_seconds", "Seconds a job waited in the queue before its "
                                       "batch started", ["kind"], buckets=BUCKETS, registry=self.registry)
        self.batch_seconds = Histogram("ringdit_batch_seconds", "Seconds one batch took to sample, decode and write",
                                       ["kind"], buckets=BUCKETS, registry=self.registry)
        self.requests = Counter("ringdit_http_requests", "HTTP requests answered, by route and status code",
                                ["route", "code"], registry=self.registry)
        self.registry.register(_Live(server))

    def job_started(self, job) -> None:
        self.queue_seconds.labels(job.request.kind).observe(max(0.0, job.started - job.created))

    def job_finished(self, job) -> None:
        self.job_seconds.labels(job.request.kind, job.status).observe(max(0.0, job.finished - job.created))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Live:
    """What is read from the server at each scrape: the queue's length, jobs running, the engine's counts, the state."""

    def __init__(self, server):
        self.server = server

    def describe(self):
        return []  # collected only when scraped (the server's parts may not exist yet when it registers)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        server = self.server
        queue, engine = server.queue, server.engine
        waiting = GaugeMetricFamily("ringdit_queue_waiting", "Jobs waiting in the queue")
        waiting.add_metric([], queue.waiting if queue is not None else 0)
        yield waiting
        running = GaugeMetricFamily("ringdit_jobs_running", "Jobs whose batch is being sampled")
        running.add_metric([], queue.running if queue is not None else 0)
        yield running
        for name, help_text, value in (
                ("ringdit_batches", "Batches sampled (one model forward per step each)", "batches"),
                ("ringdit_samples", "Samples made (images or videos)", "samples"),
                ("ringdit_model_evaluations", "Model forwards run", "evaluations"),
                ("ringdit_cache_reused_evaluations", "Model forwards whose blocks the step cache skipped",
                 "cache_reused")):
            counter = CounterMetricFamily(name, help_text)
            counter.add_metric([], getattr(engine, value) if engine is not None else 0)
            yield counter
        state = GaugeMetricFamily("ringdit_state", "1 for the server's state (loading, ok, draining, failed)",
                                  labels=["state"])
        for each in ("loading", "ok", "draining", "failed"):
            state.add_metric([each], float(server.state == each))
        yield state
