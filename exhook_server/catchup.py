"""The catch-up session: batches EMQX routed while no hook call of ours answered reach the store.

EMQX's failed_action cannot stop a publish: while our hooks do not answer (a restart, a crash, a call
past EMQX's request_timeout) a batch is PUBACKed to the platform and routed to subscribers. This is
that subscriber: one persistent MQTT 5 session (`catchup_session_clientid`, clean_start false) at
QoS 1 on the batch topics. Each message goes through `Ingestor.ingest` (the hook's path), one at a
time in arrival order, and is PUBACKed only once stored or rejected; a message both paths saw is
stored once (`batch.implied_batch_id`). At most `RECEIVE_MAXIMUM` are held unacknowledged.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Any, NamedTuple

import paho.mqtt.client as mqtt
import structlog
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from exhook_server import metrics, paho_tls
from exhook_server.config import Config
from exhook_server.errors import StorageError
from exhook_server.ingest import Ingestor

log = structlog.get_logger("sdv_fanout.catchup")

#: Unacknowledged QoS 1 messages EMQX may send us at once (MQTT 5 Receive Maximum): what we hold
#: in memory at most, each at most EMQX's max_packet_size.
RECEIVE_MAXIMUM = 32
#: Messages waiting for ingest at most (QoS 0 ones too, which Receive Maximum does not count):
#: beyond it the MQTT thread stops reading, and TCP holds the broker back.
_QUEUE_MAX = 2 * RECEIVE_MAXIMUM
#: Reconnect backoff: doubles from the first delay to the last; a link that was up starts over.
_RETRY_FIRST_S = 1.0
_RETRY_MAX_S = 30.0
#: After EMQX gave the session to another client with our id: wait this long before taking it
#: back (the other holder is the rightful one unless it stops holding it meanwhile).
TAKEN_OVER_WAIT_S = 10.0
#: A stored message that failed in storage is tried again after this long (doubling to the max).
_STORE_RETRY_FIRST_S = 0.5
_STORE_RETRY_MAX_S = 10.0
#: One turn of the MQTT thread's loop: also how late a PUBACK goes out at most.
_LOOP_S = 0.05
#: MQTT 5 reason code DISCONNECT 0x8E: Session taken over.
_TAKEN_OVER = 0x8E


class _Arrived(NamedTuple):
    #: The connection it came on (a PUBACK goes on that connection only; MQTT packet ids repeat).
    link: int
    mid: int
    qos: int
    topic: str
    payload: bytes
    dup: bool


def topic_filters(cfg: Config) -> list[str]:
    """What the session subscribes to: every topic whose message.publish call stores a batch."""
    return [cfg.batch_topic, cfg.trigger_topic, cfg.data_topic_prefix + "/#", cfg.cancel_topic, cfg.policy_topic]


class CatchupSession:
    """The persistent session, held while `hold` runs (cancel it to let go).

    A storage failure is retried until the message stores; any other failure is logged and the
    message left unacknowledged (EMQX sends it again on the next connection). One process runs
    `hold` (the LMDB group's first process, the PostgreSQL leader); should two connect, EMQX hands
    the session to the later one, and the one taken over waits `TAKEN_OVER_WAIT_S` before it asks
    for it again.

    paho runs in a thread of its own (catch-up traffic is small and rare): it connects, reads and
    sends PUBACKs; the ingest runs on the event loop of `hold`.
    """

    def __init__(self, cfg: Config, ingestor: Ingestor) -> None:
        self._cfg = cfg
        self._ingestor = ingestor
        self.clientid = cfg.catchup_session_clientid
        self._host, self._port, self._tls = paho_tls.broker(cfg)
        self._filters = topic_filters(cfg)
        self._stop = threading.Event()
        #: The connection now open (bumped by the MQTT thread at each connect).
        self._link = 0
        #: (link, mid) of messages stored or rejected, for the MQTT thread to PUBACK.
        self._acks: collections.deque[tuple[int, int]] = collections.deque()
        self._room = threading.BoundedSemaphore(_QUEUE_MAX)
        self._taken_over = False
        #: Whether the connection now served got its CONNACK.
        self._up = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[_Arrived] | None = None

    async def hold(self) -> None:
        """Hold the session until cancelled: connect (again after any loss), ingest what arrives.
        On cancel: a DISCONNECT (the session stays with EMQX for its expiry); what was received
        and not stored is not acknowledged, so EMQX sends it to the next holder."""
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        thread = threading.Thread(target=self._serve, name="mqtt-catchup", daemon=True)
        log.info("catchup_holding", clientid=self.clientid, topics=self._filters, host=self._host, port=self._port)
        thread.start()
        try:
            while True:
                item = await self._queue.get()
                try:
                    await self._ingest(item)
                finally:
                    self._room.release()
        finally:
            self._stop.set()
            await asyncio.to_thread(thread.join, _RETRY_MAX_S)
            metrics.CATCHUP_HELD.set(0)
            log.info("catchup_released", clientid=self.clientid)

    async def _ingest(self, item: _Arrived) -> None:
        kind = self._ingestor.parser.classify(item.topic)
        if kind is None:  # a filter matched a topic no hook call would store: nothing to do
            metrics.CATCHUP_MESSAGES.labels("ignored").inc()
            self._ack(item)
            return
        delay = _STORE_RETRY_FIRST_S
        while True:
            try:
                stored = await self._ingestor.ingest(kind, item.topic, item.payload, "", "", via="catchup")
            except StorageError as exc:
                metrics.CATCHUP_MESSAGES.labels("retried").inc()
                log.warning("catchup_store_retry", topic=item.topic, reason=type(exc).__name__, retry_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _STORE_RETRY_MAX_S)
                continue
            except Exception:  # never the session's end: unacknowledged, EMQX sends it again on reconnect
                metrics.CATCHUP_MESSAGES.labels("failed").inc()
                log.exception("catchup_ingest_failed", topic=item.topic, size=len(item.payload))
                return
            break
        metrics.CATCHUP_MESSAGES.labels("stored" if stored else "rejected").inc()
        log.info("catchup_ingested", topic=item.topic, stored=stored, dup=item.dup, size=len(item.payload))
        self._ack(item)

    def _ack(self, item: _Arrived) -> None:
        if item.qos:
            self._acks.append((item.link, item.mid))

    # -- the MQTT thread -----------------------------------------------------------------------
    def _new_client(self) -> mqtt.Client:
        cfg = self._cfg
        client = paho_tls.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.clientid,
            protocol=mqtt.MQTTv5,
            manual_ack=True,
            reconnect_on_failure=False,
        )
        paho_tls.authenticate(client, cfg, self._tls)
        client.on_connect = self._on_connect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        client.on_disconnect = self._on_disconnect
        return client

    def _serve(self) -> None:
        delay = _RETRY_FIRST_S
        while not self._stop.is_set():
            client = self._new_client()
            self._link += 1
            self._taken_over = self._up = False
            props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
            props.SessionExpiryInterval = self._cfg.catchup_session_expiry_s
            props.ReceiveMaximum = RECEIVE_MAXIMUM
            try:
                client.connect(
                    self._host, self._port, keepalive=self._cfg.mqtt_keepalive_s, clean_start=False, properties=props
                )
                up = self._run(client)
            except (OSError, ValueError) as exc:
                log.warning("catchup_connect_failed", host=self._host, port=self._port, error=str(exc), retry_s=delay)
                up = False
            finally:
                metrics.CATCHUP_HELD.set(0)
                client._reset_sockets()  # paho's own close of its socket pair (it has no public one)
            if self._stop.is_set():
                return
            if up:
                delay = _RETRY_FIRST_S
            wait = TAKEN_OVER_WAIT_S if self._taken_over else delay
            self._stop.wait(wait)
            delay = min(delay * 2, _RETRY_MAX_S)

    def _run(self, client: mqtt.Client) -> bool:
        """Serve one connection until it ends or we stop; whether it was ever up."""
        link = self._link
        rc = mqtt.MQTT_ERR_SUCCESS
        while rc == mqtt.MQTT_ERR_SUCCESS and not self._stop.is_set():
            self._send_acks(client, link)
            rc = client.loop(timeout=_LOOP_S)
        if self._stop.is_set() and client.is_connected():
            self._send_acks(client, link)  # what was stored meanwhile: the next holder is not sent it again
            client.disconnect()  # written at once (no loop thread); the session stays for its expiry
        return self._up

    def _send_acks(self, client: mqtt.Client, link: int) -> None:
        """PUBACK what was stored or rejected; an older connection's messages come again on this one."""
        while self._acks:
            ack_link, mid = self._acks.popleft()
            if ack_link == link:
                client.ack(mid, 1)

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            log.error("catchup_connect_refused", clientid=self.clientid, reason=str(reason))
            return
        self._up = True
        metrics.CATCHUP_HELD.set(1)
        if flags.session_present:
            log.info("catchup_session_resumed", clientid=self.clientid)
        else:
            # Nothing was queued for us before now: what EMQX routed earlier while no hook answered
            # (the very first start, or a session expired or lost with a broker restart) is gone.
            log.warning(
                "catchup_session_new", clientid=self.clientid, session_expiry_s=self._cfg.catchup_session_expiry_s
            )
        client.subscribe([(f, 1) for f in self._filters])

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, reasons: Any, props: Any) -> None:
        refused = [f for f, r in zip(self._filters, reasons, strict=False) if r.is_failure]
        if refused:
            log.error("catchup_subscribe_refused", clientid=self.clientid, topics=refused, hint="the broker's ACL")

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        item = _Arrived(self._link, msg.mid, msg.qos, msg.topic, bytes(msg.payload), bool(msg.dup))
        while not self._room.acquire(timeout=_LOOP_S * 10):
            if self._stop.is_set():
                return  # not acknowledged: EMQX sends it again to the next holder
        loop = self._loop
        assert loop is not None and self._queue is not None
        try:
            loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop closed under us: stopping
            self._room.release()

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        metrics.CATCHUP_HELD.set(0)
        if self._stop.is_set():
            return
        if getattr(reason, "value", None) == _TAKEN_OVER:
            self._taken_over = True
            log.warning("catchup_taken_over", clientid=self.clientid, wait_s=TAKEN_OVER_WAIT_S)
        else:
            log.warning("catchup_disconnected", clientid=self.clientid, reason=str(reason))
