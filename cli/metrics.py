"""The Prometheus endpoint of `dsec up`: figures read live from the running components."""
from __future__ import annotations

import collections

from typing import TYPE_CHECKING, Iterator

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

if TYPE_CHECKING:
    from cli.stack import Stack


class StackCollector:
    """Collects from the stack at scrape time (no global state, one registry per stack)."""

    def __init__(self, stack: "Stack") -> None:
        self.stack = stack

    def collect(self) -> Iterator:
        """Yield the current metric families."""
        edge, placement = self.stack.edge, self.stack.placement
        if edge is not None:
            cap = edge.capacity
            g = GaugeMetricFamily("dsec_edge_sandboxes", "Sandboxes running on this node", labels=["node"])
            g.add_metric([edge.node], len(edge.sandboxes))
            yield g
            classes = collections.Counter({"latency": 0, "batch": 0})
            classes.update(running.record.cpu_class or "latency" for running in list(edge.sandboxes.values()))
            c = GaugeMetricFamily("dsec_edge_sandboxes_by_cpu_class", "Sandboxes running on this node by CPU class",
                                  labels=["node", "cpu_class"])
            for cls, n in classes.items():
                c.add_metric([edge.node, cls], n)
            yield c
            w = GaugeMetricFamily("dsec_edge_warm_ready", "Warm-pool sandboxes ready on this node",
                                  labels=["node", "pool"])
            for name, stock in sorted(edge.warm.pools.items()):
                w.add_metric([edge.node, name], len(stock.ready))
            yield w
            for name, value, total in (("cpu", cap.used_cpu(), cap.cpu), ("memory_bytes", cap.used_memory(), cap.memory),
                                       ("slots", len(cap.used), cap.config.slots)):
                used = GaugeMetricFamily(f"dsec_edge_used_{name}", f"Booked {name}", labels=["node"])
                used.add_metric([edge.node], value)
                yield used
                cap_g = GaugeMetricFamily(f"dsec_edge_capacity_{name}", f"Capacity {name}", labels=["node"])
                cap_g.add_metric([edge.node], total)
                yield cap_g
            for name, value in (("created", edge.created), ("create_failures", edge.failed),
                                ("layer_cache_hits", edge.layers.hits), ("layer_cache_misses", edge.layers.misses),
                                ("layer_bytes_fetched", edge.layers.bytes_fetched),
                                ("layer_cache_evictions", edge.layers.evictions),
                                ("exec_duplicates", edge.ops.duplicates), ("warm_pool_hits", edge.warm.hits),
                                ("warm_pool_misses", edge.warm.misses), ("warm_pool_started", edge.warm.started),
                                ("warm_pool_failures", edge.warm.failures)):
                c = CounterMetricFamily(f"dsec_edge_{name}", f"Edge {name.replace('_', ' ')}", labels=["node"])
                c.add_metric([edge.node], value)
                yield c
            network = edge.network
            if network.mirrors:
                up = CounterMetricFamily("dsec_mirror_upstream_bytes", "Bytes a package mirror fetched from upstream",
                                         labels=["node", "mirror"])
                restarts = CounterMetricFamily("dsec_mirror_restarts", "Times a package mirror was started again",
                                               labels=["node", "mirror"])
                for m in network.mirrors:
                    up.add_metric([edge.node, m.name], m.upstream_bytes())
                    restarts.add_metric([edge.node, m.name], m.restarts)
                yield up
                yield restarts
        if placement is not None:
            for name, value in (("placed", placement.placed), ("rejected", placement.rejected),
                                ("bursted", placement.bursted), ("cas_conflicts", placement.ledger.conflicts),
                                ("lost_nodes", placement.reaper.lost_nodes)):
                c = CounterMetricFamily(f"dsec_placement_{name}", f"Placement {name.replace('_', ' ')}")
                c.add_metric([], value)
                yield c
            stats = placement.stats()
            for name, value, what in (("utilization", stats.utilization, "Booked share of the local pool"),
                                      ("burst_threshold", stats.threshold, "Utilization past which creates burst"),
                                      ("waiting", stats.queued, "Creates this engine holds waiting for room"),
                                      ("latency_p50_seconds", stats.latency_p50, "Send-to-routed latency p50"),
                                      ("latency_p99_seconds", stats.latency_p99, "Send-to-routed latency p99")):
                g = GaugeMetricFamily(f"dsec_placement_{name}", what)
                g.add_metric([], value)
                yield g


def serve(stack: "Stack", host: str, port: int):
    """Start the endpoint; returns the server (call shutdown() to stop)."""
    registry = CollectorRegistry()
    registry.register(StackCollector(stack))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
