"""The daemon's front on the services: the operations (Api) and the metrics, built once on what
services.wiring.build made. The daemon and the unit tests build it; a replay needs neither."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.registry import Collector

from gpuguard.config import Config
from gpuguard.daemon.admission import Budget
from gpuguard.daemon.api import Api
from gpuguard.daemon.metrics import Metrics
from gpuguard.services.wiring import Services


@dataclass(frozen=True)
class Front:
    api: Api          # the socket's operations
    metrics: Metrics  # the snapshot, the endpoint and the files

    def close(self) -> None:
        self.metrics.close()


def build(services: Services, reload: Callable[[], Config] | None = None,
          sync_nodes: Callable[[], None] = lambda: None,
          notices: Callable[[], Mapping[tuple[str, str], int]] = dict, connections: Budget | None = None,
          collectors: Sequence[Collector] = ()) -> Front:
    """reload: the `reload` operation (None: the config stays); sync_nodes: the `sync_nodes`
    operation; notices: webhook and e-mail notices by (channel, outcome) (remote_notify); connections:
    the budget the metrics endpoint shares with the socket (server.Server's; None: one of its own);
    collectors: the edges' own metrics (the process index's), served beside the services'."""
    edges = services.edges
    api = Api(services, reload or edges.config, sync_nodes)
    metrics = Metrics(edges.config().metrics, services.store, services.grants.gpus, edges.sampler, edges.gate,
                      services.accounts.of, notices=notices, drained=lambda: services.drains, budget=connections,
                      collectors=collectors)
    return Front(api, metrics)
