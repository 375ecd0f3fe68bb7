"""A cost model that answers from a profile and falls back to the analytic model.

``node_seconds`` returns the measured time of the node's signature when the profile has
one, times the profile's composition factor (its model run whole against the sum of its
operators timed one at a time: ``Profile.composition``), else the analytic estimate;
``measured_nodes`` and ``analytic_nodes`` count the distinct nodes answered each way.
Transfers and collectives use the profile's communication fits (measured, or the
cluster's figures when the profile was made without mpiexec) and the analytic link model
where the profile has no fit.
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.cost.cluster import Cluster, LinkSpec
from meshplan.cost.analytic import CostModel
from meshplan.model.graph import Graph, Node
from meshplan.profile.comm import COLLECTIVES, LINK
from meshplan.profile.document import Profile, load_profile
from meshplan.profile.signatures import signature_of

__all__ = ["ProfiledCostModel", "load_profile", "with_measured_links"]

_LINK_AXES = {"inter_host": 0, "intra_host": 1}    # mesh axis 0 spans hosts, axis 1 the devices of one


def with_measured_links(cluster: Cluster, profile: Profile) -> tuple[Cluster, dict[str, LinkSpec]]:
    """``cluster`` with the link figures the profile measured (one send/recv pair alone
    on each mesh axis: one way, latency + bytes / bandwidth) in place of the
    description's, and those figures.

    A link the profile did not measure (a 1xD profile has no inter-host fit; one made
    without mpiexec has only the cluster's own figures) keeps the cluster's.
    """
    found = {}
    for link, axis in _LINK_AXES.items():
        fit = profile.comm_fit(LINK, axis)
        if fit is not None and fit.source != "cluster":
            found[link] = LinkSpec(bandwidth=fit.bandwidth, latency=fit.latency)
    return replace(cluster, **found), found


class ProfiledCostModel(CostModel):
    measures_collectives = True

    def __init__(self, cluster: Cluster, profile: Profile):
        super().__init__(cluster)
        self.profile = profile
        self.factor = profile.composition_factor
        self._measured: set[str] = set()       # node names
        self._analytic: set[str] = set()

    # --- operators ------------------------------------------------------------------

    @property
    def measured_nodes(self) -> int:
        return len(self._measured)

    @property
    def analytic_nodes(self) -> int:
        return len(self._analytic)

    def node_seconds(self, node: Node, graph: Graph) -> float:
        signature = signature_of(node, graph)
        seconds = self.profile.op_seconds(signature.key) if signature is not None else None
        if seconds is not None:
            self._analytic.discard(node.name)
            self._measured.add(node.name)
            return seconds * self.factor
        if node.name not in self._measured:
            self._analytic.add(node.name)
        return super().node_seconds(node, graph)

    def split_seconds(self, node: Node, graph: Graph, shards: int, local_bytes: float) -> float:
        """A device's part of ``node`` where the profile has no measurement of it: the
        measured whole scaled by the analytic model's ratio of the part to the whole (so a
        batch split of a product bound by its weight saves what the analytic model says it
        saves, next to nothing); the analytic part where the whole was not measured either."""
        part = self._analytic_split(node, graph, shards, local_bytes)
        whole = self.node_seconds(node, graph)
        if node.name not in self._measured:
            return part
        overhead = self.cluster.device.kernel_overhead
        analytic_whole = CostModel.node_seconds(self, node, graph) - overhead
        ratio = (part - overhead) / analytic_whole if analytic_whole > 0 else 1.0 / shards
        return max(whole - overhead, 0.0) * ratio + overhead

    def shape_seconds(self, node: Node, graph: Graph, input_shapes, output_shapes=None) -> float | None:
        """Measured seconds of ``node`` on other (e.g. sharded) input shapes, or None.

        The profile has such entries when it was made with a ``variants`` source; without
        ``output_shapes`` the entry is found by its inputs alone.
        """
        signature = signature_of(node, graph, input_shapes, output_shapes)
        if signature is None:
            return None
        if output_shapes is not None:
            seconds = self.profile.op_seconds(signature.key)
        else:
            seconds = self.profile.op_seconds_by_inputs(signature.input_key)
        return None if seconds is None else seconds * self.factor

    # --- communication ------------------------------------------------------------

    def collective_seconds(self, collective: str, nbytes: float, group_size: int, inter_host: bool) -> float:
        """Seconds of a collective among ``group_size`` devices, within a host or across hosts.

        ``nbytes`` is the full buffer each device holds: the array all-reduced, the
        gathered result of an all-gather, the input of a reduce-scatter, the whole send
        buffer of an all-to-all, the array broadcast or sent.
        """
        if collective not in COLLECTIVES:
            raise ValueError(f"unknown collective {collective!r} (known: {', '.join(COLLECTIVES)})")
        if nbytes <= 0 or group_size <= 1:
            return 0.0
        fit = self.profile.comm_fit(collective, 0 if inter_host else 1, group_size)
        return fit.seconds(nbytes) if fit is not None else super().collective_seconds(collective, nbytes, group_size, inter_host)

    def _send_fit(self, inter_host: bool):
        return self.profile.comm_fit("send_recv", 0 if inter_host else 1)

    def transfer_seconds(self, nbytes: float, src: int, dst: int) -> float:
        if nbytes <= 0 or src == dst:
            return 0.0
        fit = self._send_fit(self.cluster.host_of(src) != self.cluster.host_of(dst))
        return fit.seconds(nbytes) if fit is not None else super().transfer_seconds(nbytes, src, dst)

    def worst_transfer_seconds(self, nbytes: float, across_hosts: bool | None = None) -> float:
        if nbytes <= 0:
            return 0.0
        across = self.cluster.hosts > 1 if across_hosts is None else across_hosts
        fit = self._send_fit(across)
        return fit.seconds(nbytes) if fit is not None else super().worst_transfer_seconds(nbytes, across)

    def summary(self) -> dict:
        """For a plan's estimate: which cost model answered how many nodes."""
        return {
            "cost_model": "profiled",
            "measured_nodes": self.measured_nodes,
            "analytic_nodes": self.analytic_nodes,
            "profile_hardware": self.profile.hardware,
            "profile_provider": self.profile.provider,
            "composition_factor": self.factor,
            "communication": self.profile.communication_source,
        }
