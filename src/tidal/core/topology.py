"""Cluster topology: a tree switch -> node -> GPU that placement walks.

A cluster is a list of nodes, each with its GPU count, GPU type, switch and
labels; nodes may differ in size and type (``6xT4:4,2xA100:8``). GPUs are
numbered 0..N-1 in node order, so a node's GPUs are one contiguous range and
a switch's nodes are listed together. A homogeneous cluster (``n32g8``: the
ElasticFlow artifact's ``num_switch,num_node_p_switch,num_gpu_p_node`` files,
§4.3's hierarchical tree) is the special case where every node is alike and
each switch has as many nodes: there GPU ``g`` lives on node
``g // gpus_per_node``.

Sia (SOSP'23) and Gavel (OSDI'20) schedule such clusters; the default one of
the Sia study is ``6xT4:4,2xA100:8,3xRTX2080Ti:8``.
"""

from __future__ import annotations

import bisect
import csv
import re
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from pathlib import Path
from typing import Iterable, Sequence

from tidal.core.errors import InputError

_SPEC = re.compile(r"^n(\d+)g(\d+)(?:s(\d+))?$")
_GROUP = re.compile(r"^(\d+)x([A-Za-z][\w.-]*)?:?(\d+)$")  # 6xT4:4, 2x8 (untyped)
_TYPE = re.compile(r"^[A-Za-z][\w.-]*$")
NODES_PER_SWITCH = 32  # a group of more nodes than this spans several switches


@dataclass(frozen=True)
class Node:
    """One server: ``gpus`` GPUs of ``gpu_type`` ("" = untyped, the shipped
    A100 profiles) under switch ``switch``."""

    gpus: int
    gpu_type: str = ""
    switch: int = 0
    labels: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise InputError(f"must be a positive integer, got {self.gpus!r}", field="gpus")
        if not isinstance(self.switch, int) or self.switch < 0:
            raise InputError(f"must be a non-negative integer, got {self.switch!r}", field="switch")
        if self.gpu_type and not _TYPE.match(self.gpu_type):
            raise InputError(f"not a GPU type name: {self.gpu_type!r}", field="gpu_type")


@dataclass(frozen=True)
class Cluster:
    """Nodes in GPU-numbering order; their switches ascend (a switch's nodes
    are listed together). :meth:`uniform` builds the homogeneous tree."""

    nodes: tuple[Node, ...]
    name: str = ""
    _starts: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _typed_sizes: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # types -> sizes

    def __post_init__(self) -> None:
        nodes = tuple(self.nodes)
        if not nodes:
            raise InputError("a cluster needs at least one node", field="nodes")
        if any(b.switch < a.switch for a, b in zip(nodes, nodes[1:])):
            raise InputError("nodes must be listed switch by switch (ascending)", field="switch")
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "_starts", tuple(accumulate((n.gpus for n in nodes), initial=0)))
        if not self.name:
            object.__setattr__(self, "name", describe(nodes))

    @classmethod
    def uniform(cls, num_switches: int, nodes_per_switch: int, gpus_per_node: int, name: str = "",
                gpu_type: str = "") -> "Cluster":
        """``num_switches`` x ``nodes_per_switch`` x ``gpus_per_node`` alike nodes."""
        for fld, value in (("num_switches", num_switches), ("nodes_per_switch", nodes_per_switch),
                           ("gpus_per_node", gpus_per_node)):
            if not isinstance(value, int) or value < 1:
                raise InputError(f"must be a positive integer, got {value!r}", field=fld)
        nodes = tuple(Node(gpus_per_node, gpu_type, s) for s in range(num_switches) for _ in range(nodes_per_switch))
        return cls(nodes, name or f"n{len(nodes)}g{gpus_per_node}")

    # -- sizes -------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def num_gpus(self) -> int:
        return self._starts[-1]

    @cached_property
    def num_switches(self) -> int:
        return len({n.switch for n in self.nodes})

    @cached_property
    def is_uniform(self) -> bool:
        """Every node alike and every switch with as many nodes (the artifact's tree)."""
        first = self.nodes[0]
        per_switch = [len(v) for v in self.switch_nodes.values()]
        return (all(n.gpus == first.gpus and n.gpu_type == first.gpu_type for n in self.nodes)
                and len(set(per_switch)) == 1)

    @property
    def gpus_per_node(self) -> int:
        """The GPUs of every node; a cluster of mixed sizes has no such count
        (use :meth:`node_gpus` or :attr:`max_gpus_per_node`)."""
        if not self.same_size:
            raise ValueError(f"cluster {self.name} has nodes of {sorted({n.gpus for n in self.nodes})} GPUs")
        return self.nodes[0].gpus

    @cached_property
    def same_size(self) -> bool:
        return len({n.gpus for n in self.nodes}) == 1

    @cached_property
    def max_gpus_per_node(self) -> int:
        return max(n.gpus for n in self.nodes)

    @property
    def nodes_per_switch(self) -> int:
        """Nodes under each switch, where all switches have as many."""
        counts = {len(v) for v in self.switch_nodes.values()}
        if len(counts) != 1:
            raise ValueError(f"cluster {self.name} has switches of {sorted(counts)} nodes")
        return counts.pop()

    @cached_property
    def gpu_types(self) -> tuple[str, ...]:
        """The GPU types present, in order of first appearance."""
        return tuple(dict.fromkeys(n.gpu_type for n in self.nodes))

    @cached_property
    def switch_nodes(self) -> dict[int, tuple[int, ...]]:
        """Switch -> its nodes (ascending)."""
        out: dict[int, list[int]] = {}
        for i, n in enumerate(self.nodes):
            out.setdefault(n.switch, []).append(i)
        return {s: tuple(v) for s, v in out.items()}

    # -- where a GPU is ----------------------------------------------------------
    @cached_property
    def _node_of(self) -> tuple[int, ...]:
        return tuple(i for i, n in enumerate(self.nodes) for _ in range(n.gpus))

    def node_of(self, gpu: int) -> int:
        return self._node_of[gpu]

    def node_gpus(self, node: int) -> int:
        return self.nodes[node].gpus

    def gpus_of_node(self, node: int) -> range:
        return range(self._starts[node], self._starts[node + 1])

    def node_start(self, node: int) -> int:
        return self._starts[node]

    def switch_of_node(self, node: int) -> int:
        return self.nodes[node].switch

    def switch_of(self, gpu: int) -> int:
        return self.nodes[self._node_of[gpu]].switch

    def gpu_type_of(self, gpu: int) -> str:
        return self.nodes[self._node_of[gpu]].gpu_type

    @cached_property
    def all_gpus(self) -> frozenset[int]:
        return frozenset(range(self.num_gpus))

    def nodes_spanned(self, gpus: Iterable[int]) -> int:
        node_of = self._node_of
        return len({node_of[g] for g in gpus})

    @cached_property
    def _sizes_desc(self) -> tuple[int, ...]:
        return tuple(accumulate(sorted((n.gpus for n in self.nodes), reverse=True)))

    def min_nodes(self, n_gpus: int, gpu_types: Iterable[str] | None = None) -> int:
        """Fewest nodes that can hold ``n_gpus`` GPUs (the largest nodes first;
        all of them if the cluster is smaller); with ``gpu_types``, among the
        nodes of those types only (8 GPUs on 4-GPU T4 nodes need 2 of them,
        even where A100 nodes have 8)."""
        if n_gpus <= 0:
            return 1
        if gpu_types is None:
            return min(bisect.bisect_left(self._sizes_desc, n_gpus) + 1, self.num_nodes)
        key = frozenset(gpu_types)
        sizes = self._typed_sizes.get(key)
        if sizes is None:
            sizes = tuple(accumulate(sorted((n.gpus for n in self.nodes if n.gpu_type in key), reverse=True)))
            self._typed_sizes[key] = sizes = sizes or self._sizes_desc
        return min(bisect.bisect_left(sizes, n_gpus) + 1, len(sizes))


def describe(nodes: Sequence[Node]) -> str:
    """The short name of a node list: ``n32g8`` when alike and untyped,
    else its groups (``6xT4:4,2xA100:8``)."""
    groups: list[list] = []
    for n in nodes:
        if groups and groups[-1][1:] == [n.gpu_type, n.gpus]:
            groups[-1][0] += 1
        else:
            groups.append([1, n.gpu_type, n.gpus])
    if len(groups) == 1 and not groups[0][1]:
        return f"n{groups[0][0]}g{groups[0][2]}"
    return ",".join(f"{c}x{t}:{g}" if t else f"{c}x{g}" for c, t, g in groups)


def parse_cluster(spec: str | Path) -> Cluster:
    """A cluster from a spec string or a cluster CSV file:

    - ``n32g8`` (32 nodes of 8 GPUs), ``n256g8s8`` (8 switches);
    - node groups ``6xT4:4,2xA100:8,3xRTX2080Ti:8`` (count x type : GPUs per
      node; ``4x8`` is untyped); each group starts its own switch, of at most
      :data:`NODES_PER_SWITCH` nodes;
    - a CSV: the artifact's ``num_switch,num_node_p_switch,num_gpu_p_node``,
      or one row per node (group) with ``gpus`` and optional ``count``,
      ``gpu_type``, ``switch``, ``labels`` (``k=v;k=v``)."""
    text = str(spec).strip()
    if not text:
        raise InputError("empty: give a spec like 'n32g8' or '6xT4:4,2xA100:8', or a cluster CSV", field="cluster")
    m = _SPEC.match(text)
    if m:
        nodes, gpus = int(m.group(1)), int(m.group(2))
        switches = int(m.group(3)) if m.group(3) else _default_switches(nodes, text)
        if nodes < 1 or gpus < 1:
            raise InputError("spec needs at least one node and one GPU", source=text)
        if switches < 1 or nodes % switches:
            raise InputError(f"{nodes} nodes do not divide into {switches} switches", source=text)
        return Cluster.uniform(switches, nodes // switches, gpus, name=text)
    if "," in text or _GROUP.match(text):
        return _parse_groups(text)
    path = Path(text)
    if not path.exists():
        raise InputError("not a cluster spec like 'n32g8' or '6xT4:4,2xA100:8', and no such file",
                         source=text, field="cluster")
    return _read_cluster_csv(path)


def _parse_groups(text: str) -> Cluster:
    nodes: list[Node] = []
    switch = 0
    for part in (p.strip() for p in text.split(",")):
        m = _GROUP.match(part)
        if not m:
            raise InputError(f"not a node group like '6xT4:4' (count x type : GPUs per node): {part!r}",
                             source=text, field="cluster")
        count, gtype, gpus = int(m.group(1)), m.group(2) or "", int(m.group(3))
        if count < 1 or gpus < 1:
            raise InputError(f"{part!r} needs at least one node and one GPU", source=text, field="cluster")
        for i in range(count):
            nodes.append(Node(gpus, gtype, switch + i // NODES_PER_SWITCH))
        switch += -(-count // NODES_PER_SWITCH)
    return Cluster(tuple(nodes))


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
_NODE_COLUMNS = ("count", "gpus", "gpu_type", "switch", "labels")


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
    if "gpus" in header and not set(_CLUSTER_COLUMNS) & set(header):
        return _read_node_rows(path, header, rows)
    missing = [c for c in _CLUSTER_COLUMNS if c not in header]
    if missing:
        found = ",".join(header)[:60] or "nothing"
        raise InputError(f"not a cluster CSV: its header needs the columns {','.join(_CLUSTER_COLUMNS)}, "
                         f"or gpus[,count,gpu_type,switch,labels] for one row per node (found {found!r}); "
                         "or give a spec like n32g8", source=str(path), line=1)
    if not rows:
        raise InputError("no data row under the header", source=str(path), line=2)
    values = {fld: _int(rows[0].get(fld), path, 2, fld, 1) for fld in _CLUSTER_COLUMNS}
    return Cluster.uniform(values["num_switch"], values["num_node_p_switch"], values["num_gpu_p_node"],
                           name=path.stem)


def _int(raw: str | None, path: Path, line: int, fld: str, least: int) -> int:
    if raw is None or not raw.strip():
        raise InputError("missing value", source=str(path), line=line, field=fld)
    try:
        value = int(raw)
    except ValueError:
        raise InputError(f"not an integer: {raw!r}", source=str(path), line=line, field=fld) from None
    if value < least:
        raise InputError(f"must be >= {least}, got {raw}", source=str(path), line=line, field=fld)
    return value


def _read_node_rows(path: Path, header: Sequence[str], rows: list[dict]) -> Cluster:
    """One row per node, or per group of alike nodes (``count``)."""
    unknown = [c for c in header if c not in _NODE_COLUMNS]
    if unknown:
        raise InputError(f"unknown column {unknown[0]!r} (a node row has {','.join(_NODE_COLUMNS)})",
                         source=str(path), line=1)
    if not rows:
        raise InputError("no data row under the header", source=str(path), line=2)
    nodes: list[Node] = []
    for line, row in enumerate(rows, 2):
        gpus = _int(row.get("gpus"), path, line, "gpus", 1)
        count = _int(row.get("count") or "1", path, line, "count", 1)
        switch = _int(row.get("switch") or "0", path, line, "switch", 0)
        gtype = (row.get("gpu_type") or "").strip()
        if gtype and not _TYPE.match(gtype):
            raise InputError(f"not a GPU type name: {gtype!r}", source=str(path), line=line, field="gpu_type")
        labels = _labels(row.get("labels") or "", path, line)
        if nodes and switch < nodes[-1].switch:
            raise InputError(f"switch {switch} after switch {nodes[-1].switch}: list nodes switch by switch",
                             source=str(path), line=line, field="switch")
        nodes.extend(Node(gpus, gtype, switch, labels) for _ in range(count))
    return Cluster(tuple(nodes), name=path.stem)


def _labels(text: str, path: Path, line: int) -> tuple[tuple[str, str], ...]:
    out = []
    for item in (p.strip() for p in text.split(";") if p.strip()):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise InputError(f"a label is key=value, got {item!r}", source=str(path), line=line, field="labels")
        out.append((key.strip(), value.strip()))
    return tuple(out)
