"""What the planner asks of a cost model. The analytic model (``cost.analytic``) and the
profiled one (``profile.measured``) both answer every question; callers never probe."""

from __future__ import annotations

from abc import ABC, abstractmethod

from meshplan.model.graph import Graph, Node


class CostModelProtocol(ABC):
    # Whether ``collective_seconds`` answers from measurements: the sharding pass then
    # costs collectives with it; otherwise with the alpha-beta model of each axis's link.
    measures_collectives: bool = False

    @abstractmethod
    def node_seconds(self, node: Node, graph: Graph) -> float:
        """Seconds of the whole operator on one device."""

    def graph_seconds(self, graph: Graph) -> list[float]:
        return [self.node_seconds(node, graph) for node in graph.nodes]

    @abstractmethod
    def split_seconds(self, node: Node, graph: Graph, shards: int, local_bytes: float) -> float:
        """Seconds of one device's part of ``node`` when its work is split ``shards`` ways and
        the device reads and writes ``local_bytes`` (its slices of the operands: a weight
        split in two is half the bytes read, a batch split leaves the weight whole)."""

    @abstractmethod
    def shape_seconds(self, node: Node, graph: Graph, input_shapes, output_shapes=None) -> float | None:
        """Seconds of ``node`` on other (e.g. sharded) input shapes when measured, else None."""

    @abstractmethod
    def transfer_seconds(self, nbytes: float, src: int, dst: int) -> float:
        """Seconds to send ``nbytes`` from device ``src`` to ``dst``."""

    @abstractmethod
    def worst_transfer_seconds(self, nbytes: float, across_hosts: bool | None = None) -> float:
        """A transfer between two devices not yet placed: across hosts when ``across_hosts``
        (default: when the cluster has several hosts), else inside one."""

    @abstractmethod
    def collective_seconds(self, collective: str, nbytes: float, group_size: int, inter_host: bool) -> float:
        """Seconds of a collective among ``group_size`` devices (byte conventions of
        ``reshard.steps.MeasuredCollectiveModel``)."""

    @abstractmethod
    def summary(self) -> dict:
        """For a plan's estimate: which cost model answered, and how."""
