"""Publishing to a JetStream stream until the stream has it: what an engine sends that must not be lost.

A publish fails while the stream has no leader (a cluster electing one after losing a node, the server
restarting) or the client is reconnecting. `publish_until_stored` resends with backoff for `resend_for_s`, each
time under the same msg-id, so the stream drops a resend whose first copy was stored but whose acknowledgement
was lost: the message is stored once. It never raises (the engine goes on; a message never stored is logged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the bus is only passed in: importing this module does not pull in NATS
    from switchyard.shared.bus import Bus
    from switchyard.shared.codec import WireModel

__all__ = ["RESEND_FOR_S", "publish_until_stored"]

log = logging.getLogger(__name__)

#: How long a message is resent for: longer than a JetStream cluster takes to elect a new stream leader after
#: losing one node (a few seconds) and a client to reconnect to another node.
RESEND_FOR_S = 30.0


async def publish_until_stored(
    bus: Bus, subject: str, message: WireModel, msg_id: str, what: str, resend_for_s: float = RESEND_FOR_S
) -> bool:
    """Store `message` on `subject`'s stream, resent with backoff until acknowledged; False (logged, naming
    `what`) if it never was within `resend_for_s`."""
    deadline = time.monotonic() + resend_for_s
    delay = 0.25
    while True:
        try:
            await bus.js_publish(subject, message, msg_id=msg_id)
            return True
        except Exception as exc:
            if time.monotonic() + delay > deadline:
                log.warning("%s not published: %s", what, exc)
                return False
            log.debug("%s not stored yet (%s); resending", what, exc)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 4.0)
