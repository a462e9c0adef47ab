"""Cluster topology: a tree switch -> node -> GPU that placement walks.

GPUs are numbered 0..N-1 in tree order, so GPU ``g`` lives on node
``g // gpus_per_node`` and node ``n`` hangs off switch ``n // nodes_per_switch``
(ElasticFlow §4.3 describes the same hierarchical tree; its cluster files give
``num_switch,num_node_p_switch,num_gpu_p_node,...``).
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tidal.core.errors import InputError

_SPEC = re.compile(r"^n(\d+)g(\d+)(?:s(\d+))?$")


@dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster: ``num_switches`` x ``nodes_per_switch`` x ``gpus_per_node``."""

    num_switches: int
    nodes_per_switch: int
    gpus_per_node: int
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("num_switches", "nodes_per_switch", "gpus_per_node"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise InputError(f"must be a positive integer, got {value!r}", field=field)
        if not self.name:
            object.__setattr__(self, "name", f"n{self.num_nodes}g{self.gpus_per_node}")

    @property
    def num_nodes(self) -> int:
        return self.num_switches * self.nodes_per_switch

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def switch_of_node(self, node: int) -> int:
        return node // self.nodes_per_switch

    def switch_of(self, gpu: int) -> int:
        return self.switch_of_node(self.node_of(gpu))

    def gpus_of_node(self, node: int) -> range:
        start = node * self.gpus_per_node
        return range(start, start + self.gpus_per_node)

    @cached_property
    def all_gpus(self) -> frozenset[int]:
        return frozenset(range(self.num_gpus))

    def nodes_spanned(self, gpus: tuple[int, ...] | frozenset[int]) -> int:
        return len({g // self.gpus_per_node for g in gpus})

    def min_nodes(self, n_gpus: int) -> int:
        """Fewest nodes that can hold ``n_gpus`` GPUs."""
        return max(1, -(-n_gpus // self.gpus_per_node))


def parse_cluster(spec: str | Path) -> Cluster:
    """Build a cluster from a spec string (``n32g8``, optionally ``n256g8s8`` for
    8 switches) or from a cluster CSV file
    (``num_switch,num_node_p_switch,num_gpu_p_node,...``)."""
    text = str(spec).strip()
    if not text:
        raise InputError("empty: give a spec like n32g8 or a cluster CSV file", field="cluster")
    m = _SPEC.match(text)
    if m:
        nodes, gpus = int(m.group(1)), int(m.group(2))
        switches = int(m.group(3)) if m.group(3) else _default_switches(nodes, text)
        if nodes < 1 or gpus < 1:
            raise InputError("spec needs at least one node and one GPU", source=text)
        if nodes % switches:
            raise InputError(f"{nodes} nodes do not divide into {switches} switches", source=text)
        return Cluster(switches, nodes // switches, gpus, name=text)
    path = Path(text)
    if not path.exists():
        raise InputError(
            "not a cluster spec like 'n32g8' and no such file", source=text, field="cluster"
        )
    return _read_cluster_csv(path)


# Switch counts of the public ElasticFlow artifact's cluster files
# (cluster_spec/nXgY.csv) where they differ from 32 nodes per switch: n128g8
# and n48g8 are one switch there. Its n1g2.csv is 2 nodes x 1 GPU; here a name
# always means what it says (n1g2: 1 node x 2 GPUs).
ARTIFACT_SWITCHES = {"n128g8": 1, "n48g8": 1}


def _default_switches(nodes: int, name: str = "") -> int:
    """The artifact's switch count for its file names; otherwise 32 nodes per
    switch, as most of its files have (one switch when 32 does not divide)."""
    if name in ARTIFACT_SWITCHES:
        return ARTIFACT_SWITCHES[name]
    return max(1, nodes // 32) if nodes % 32 == 0 else 1


_CLUSTER_COLUMNS = ("num_switch", "num_node_p_switch", "num_gpu_p_node")


def _read_cluster_csv(path: Path) -> Cluster:
    if path.is_dir():
        raise InputError("a directory, not a cluster CSV file", source=str(path), field="cluster")
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            header = reader.fieldnames or []
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise InputError(f"not a readable cluster CSV file ({getattr(e, 'strerror', None) or e})",
                         source=str(path)) from None
    missing = [c for c in _CLUSTER_COLUMNS if c not in header]
    if missing:
        found = ",".join(header)[:60] or "nothing"
        raise InputError(f"not a cluster CSV: its header needs the columns {','.join(_CLUSTER_COLUMNS)} "
                         f"(found {found!r}); or give a spec like n32g8", source=str(path), line=1)
    if not rows:
        raise InputError("no data row under the header", source=str(path), line=2)
    row = rows[0]
    values = {}
    for field in ("num_switch", "num_node_p_switch", "num_gpu_p_node"):
        raw = row.get(field)
        if raw is None:
            raise InputError("missing column", source=str(path), line=1, field=field)
        try:
            values[field] = int(raw)
        except ValueError:
            raise InputError(f"not an integer: {raw!r}", source=str(path), line=2, field=field)
        if values[field] < 1:
            raise InputError(f"must be >= 1, got {raw}", source=str(path), line=2, field=field)
    return Cluster(
        values["num_switch"],
        values["num_node_p_switch"],
        values["num_gpu_p_node"],
        name=path.stem,
    )
