"""The ServerApp's messages to its clients (:mod:`fedskew.flower.server_app`): :class:`GridLink` addresses each
client by its stable id over a Flower ``Grid`` (learned from the nodes' hello replies, re-learned when a SuperNode
restarts), and bounds every wait: the nodes' arrival, each reply, the stragglers after the first one."""

from __future__ import annotations

import logging
import time

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedskew import __version__
from fedskew.flower.hello import FederationError, Hello, NodeReport
from fedskew.flower.settings import FlowerSettings

log = logging.getLogger("flwr.fedskew")
MESSAGE_TTL_MARGIN = 60.0  # seconds a message outlives the wait for its reply


class GridLink:
    """Messages to clients by their stable id over a Flower ``Grid``, every wait bounded."""

    def __init__(self, grid: Grid, settings: FlowerSettings) -> None:
        self.grid = grid
        self.settings = settings
        self.nodes: dict[int, int] = {}  # cid -> Flower node id (learned from the hello replies)
        self.seen: set[int] = set()  # node ids asked for their client id after the first hello
        self.request = Hello((), __version__, "")  # what the server says in every hello (set by connect)

    def connect(self, num_clients: int, request: Hello) -> dict[int, NodeReport]:
        """Wait (at most ``node_wait`` s) for ``num_clients`` nodes; say hello to each: the server's fedskew version,
        configuration hash and the client reports its method declares go out, each node's report comes back
        (:class:`NodeReport`). A node running another fedskew version or configuration is refused, naming both."""
        deadline = time.monotonic() + self.settings.node_wait
        while len(ids := sorted(self.grid.get_node_ids())) < num_clients:
            if time.monotonic() > deadline:
                raise FederationError(
                    f"only {len(ids)} of {num_clients} SuperNodes connected within {self.settings.node_wait:g} s "
                    '(flower.node_wait); start one `flower-supernode --node-config "cid=K"` per client'
                )
            time.sleep(self.settings.poll_interval)
        self.request = request
        replies, failed = self._hello(ids, num_clients)
        if failed:
            raise FederationError(f"nodes did not answer the hello: {failed}")
        reports: dict[int, NodeReport] = {}
        for nid, content in replies.items():
            report = NodeReport.read(nid, content, request)
            if report.cid in self.nodes:
                raise FederationError(
                    f"two nodes ({self.nodes[report.cid]}, {nid}) both say they are client {report.cid}"
                )
            self.nodes[report.cid] = nid
            reports[report.cid] = report
        missing = sorted(set(range(num_clients)) - set(self.nodes))
        if missing or len(self.nodes) != num_clients:
            raise FederationError(
                f"the federation needs clients 0..{num_clients - 1} once each; connected: {sorted(self.nodes)}"
            )
        shapes = {(r.num_classes, r.in_channels, r.image_size, r.tokens) for r in reports.values()}
        if len(shapes) > 1:
            seen = {cid: (r.num_classes, r.in_channels, r.image_size) for cid, r in sorted(reports.items())}
            raise FederationError(
                f"the clients' data disagree on (classes, channels or vocabulary size, image size or sequence length): "
                f"{seen}; every node's data must have the same classes and input shape (an .npz can store num_classes)"
            )
        if len({r.vocabulary for r in reports.values()}) > 1:
            seen_v = {cid: r.vocabulary for cid, r in sorted(reports.items())}
            raise FederationError(
                f"the clients' text vocabularies differ (hashes {seen_v}): each node built its own from its training "
                "file, so the same id means different words; give every node the same vocabulary"
            )
        return reports

    def _hello(self, node_ids: list[int], num_clients: int) -> tuple[dict[int, RecordDict], dict[int, str]]:
        request = self.request
        config = ConfigRecord(
            {
                "clients": num_clients,
                "reports": list(request.reports),
                "fedskew_version": request.version,
                "config_hash": request.config_hash,
            }
        )
        return self._exchange("query.hello", {nid: RecordDict({"config": config}) for nid in node_ids}, "0")

    def rejoin(self) -> dict[int, int]:
        """Map nodes that registered since the last hello (a SuperNode restarted mid-run gets a new Flower node id)
        to their client ids, replacing the old node of that id. Returns ``{cid: new node id}``. A rejoined client
        starts with an empty ``context.state`` (its node lost it), as a client that has not trained yet."""
        online = set(self.grid.get_node_ids())
        new = sorted(online - set(self.nodes.values()) - self.seen)
        if not new:
            return {}
        replies, _ = self._hello(new, len(self.nodes))
        moved = {}
        for nid in new:
            cid = None
            if nid in replies:
                try:
                    cid = NodeReport.read(nid, replies[nid], self.request).cid
                except FederationError as exc:  # another version or configuration: never let in
                    log.warning("%s", exc)
            if cid is not None and cid in self.nodes and self.nodes[cid] in online:
                # the SuperLink still lists the old node (it drops a dead one after 2 missed heartbeats): ask again
                log.warning("node %d says it is client %d, which node %d still is", nid, cid, self.nodes[cid])
            elif cid is not None and cid in self.nodes:
                self.nodes[cid] = moved[cid] = nid
            else:  # no answer, or no client of this federation: not asked again
                self.seen.add(nid)
        return moved

    def exchange(
        self, message_type: str, contents: dict[int, RecordDict], rnd: int
    ) -> tuple[dict[int, RecordDict], dict[int, str]]:
        """Send each client its own content; return the replies and, for the clients that sent none within
        ``round_timeout`` s (or an error), the reason."""
        by_node = {self.nodes[cid]: content for cid, content in contents.items()}
        replies, failed = self._exchange(message_type, by_node, str(rnd))
        cid_of = {nid: cid for cid, nid in self.nodes.items()}
        return {cid_of[n]: c for n, c in replies.items()}, {cid_of[n]: r for n, r in failed.items()}

    def _exchange(
        self, message_type: str, contents: dict[int, RecordDict], group: str
    ) -> tuple[dict[int, RecordDict], dict[int, str]]:
        timeout, straggler = self.settings.round_timeout, self.settings.straggler_timeout
        # the messages outlive the wait by a margin (clock skew between machines), then the SuperLink drops them
        ttl = timeout + MESSAGE_TTL_MARGIN
        messages = [
            Message(content, dst_node_id=nid, message_type=message_type, group_id=group, ttl=ttl)
            for nid, content in contents.items()
        ]
        ids = list(self.grid.push_messages(messages))
        failed = {nid: "the message could not be pushed" for nid, mid in zip(contents, ids, strict=True) if not mid}
        pending = {mid: nid for nid, mid in zip(contents, ids, strict=True) if mid}
        replies: dict[int, RecordDict] = {}
        deadline = time.monotonic() + timeout
        reason = f"no reply within {timeout:g} s"
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                nid = pending.pop(reply.metadata.reply_to_message_id, None)
                if nid is None:
                    continue
                if reply.has_error():
                    failed[nid] = f"error: {reply.error.reason}"
                else:
                    replies[nid] = reply.content
                if straggler is not None and time.monotonic() + straggler < deadline:
                    deadline = time.monotonic() + straggler  # the first reply is in: the others get `straggler` s
                    reason = f"no reply within {straggler:g} s of the first one"
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(self.settings.poll_interval)
        for nid in pending.values():
            failed[nid] = reason
        return replies, failed
