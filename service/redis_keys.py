"""The Redis key layout of one deployment, every key under one prefix (docs/architecture.md, section 5).

  {p}:requests:{{model}}  stream of RequestMsg for one served model, consumer group "engines" (each engine
                        process reads as consumer "{engine_id}/{incarnation}"); an entry is acked (and
                        deleted) only when its request has finished; field "p" holds the RequestMsg, and
                        an entry with field RESUMES is a gateway's re-queue of a request whose entry Redis
                        lost (restarted empty) and whose engine died: taken over, not dropped as a duplicate
  {p}:out:{gateway}     a gateway's reply stream: one ReplyBatch entry (field "b") per engine step, trimmed to the
                        reply retention window; any gateway may read it (to resume a client's stream)
  {p}:requests:{{model}}:to:{engine}  stream of RequestMsg routed to one engine by its cached prefix (same group and
                        fields); its engine reads it first, an idle engine takes an entry left unread
                        ``steal_after_s``, and its pending entries are reclaimed like the shared stream's
  {p}:routed:{model}    set of the engine ids that have such a stream (for reclaim and stealing)
  {p}:prefixes:{engine} set of the first 8 bytes of each prefix-cache block hash the engine holds, expiring
                        with its heartbeat (the gateway's routing reads it)
  {p}:request:{{id}}    StreamRecord, written by the gateway at submission, kept the retention window
  {p}:response:{{id}}   StoredResponse (Responses API, store=true), written by a gateway, kept --response-ttl
                        after the request finishes
  {p}:owner:{{id}}      the consumer that runs the request, claimed with SET NX: a duplicated queue entry
                        (a retried XADD) is never run twice
  {p}:progress:{{id}}   Progress, an engine's periodic checkpoint of the request's delivered tokens
  {p}:aborts            stream of aborted request ids, read by every worker each step
  {p}:deadletter        stream of requests given up on after repeated delivery, with the reason
  {p}:engines           set of engine ids; {p}:engine:{id} holds the Heartbeat, expiring without beats
  {p}:gateways          set of gateway ids; {p}:gateway:{id} holds the GatewayBeat, expiring likewise
  {p}:limit:{{t}}:*     one tenant's concurrency slots and token bucket (service/limits.py builds the names)
  {p}:kv_wanted:{id}    set (expiring) by a gateway's /v1/kv_snapshot: a dashboard watches engine {id}
  {p}:kv:{id}           KVSnapshotMsg, engine {id}'s latest KV snapshot, published while the key above exists

In a Redis Cluster a key's slot comes from its hash tag (the part in braces) when it has one: a request's
own keys share its id as their tag, so a command naming several of them (the gateway's MGET of a record and
its owner) stays in one slot; the request streams (one per model) and the out streams (one per gateway)
spread over the slots, except that a model's shared stream and its streams routed to each engine share the
model as their tag (a worker reads its own routed stream and the shared one in one XREADGROUP). No other
command names two streams, nor keys of two requests: pipelines that do are not transactions, and the
cluster client splits them by node.
"""
from __future__ import annotations

from dataclasses import dataclass

PREFIX_KEY_BYTES = 8  # of a block hash, in an engine's prefixes set: a collision only misroutes, at worst
RESUMES = "resumes"  # a request-stream field: the entry re-queues a request whose engine died (see above)


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str

    @property
    def aborts(self) -> str:
        return f"{self.prefix}:aborts"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}:deadletter"

    @property
    def engines(self) -> str:
        return f"{self.prefix}:engines"

    @property
    def gateways(self) -> str:
        return f"{self.prefix}:gateways"

    def requests(self, model: str) -> str:
        """One request stream per served model, so an engine never takes another model's requests."""
        return f"{self.prefix}:requests:{{{model}}}"  # the model as hash tag: its routed streams share the slot

    def routed(self, model: str, engine_id: str) -> str:
        """The stream of requests routed to one engine (a suffix of the model's: the same hash tag, if any)."""
        return f"{self.requests(model)}:to:{engine_id}"

    def routed_engines(self, model: str) -> str:
        return f"{self.prefix}:routed:{model}"

    def prefixes(self, engine_id: str) -> str:
        return f"{self.prefix}:prefixes:{engine_id}"

    def out(self, gateway_id: str) -> str:
        return f"{self.prefix}:out:{gateway_id}"

    def request(self, request_id: str) -> str:
        return f"{self.prefix}:request:{{{request_id}}}"

    def response(self, response_id: str) -> str:
        """A stored Responses API response (``StoredResponse``)."""
        return f"{self.prefix}:response:{{{response_id}}}"

    def owner(self, request_id: str) -> str:
        return f"{self.prefix}:owner:{{{request_id}}}"

    def progress(self, request_id: str) -> str:
        return f"{self.prefix}:progress:{{{request_id}}}"

    def engine(self, engine_id: str) -> str:
        return f"{self.prefix}:engine:{engine_id}"

    def gateway(self, gateway_id: str) -> str:
        return f"{self.prefix}:gateway:{gateway_id}"

    def kv_wanted(self, engine_id: str) -> str:
        return f"{self.prefix}:kv_wanted:{engine_id}"

    def kv_snapshot(self, engine_id: str) -> str:
        return f"{self.prefix}:kv:{engine_id}"


def consumer_name(engine_id: str, incarnation: str) -> str:
    """A restarted engine keeps its id (a pod name) but not its incarnation: its predecessor's pending
    entries belong to a dead consumer and are resumed, not mistaken for its own."""
    return f"{engine_id}/{incarnation}"


def split_consumer(name: str) -> tuple[str, str]:
    """``consumer_name``'s (engine id, incarnation)."""
    engine_id, _, incarnation = name.rpartition("/")
    return engine_id, incarnation
