"""uvicorn's h11 protocol with a deadline on a request's headers, which uvicorn 0.54 does not have.

A connection that has not sent a whole request head within ``HeaderDeadline.timeout`` seconds of
opening (or of its previous answer, on a kept-alive connection) is closed. Without it a client
trickling one header line every few seconds holds its connection for ever, and a few hundred of
them (slowloris) hold every connection the server allows. ``serve`` passes this class to uvicorn
as its ``http`` protocol; the body has its own deadline in ``serve.Gate``.
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderDeadline(H11Protocol):
    timeout = 10.0  # seconds; serve sets it from --header-timeout in each server process
    _deadline = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self._deadline is not None and self.conn.their_state is not h11.IDLE:  # the head is in
            self._deadline.cancel()
            self._deadline = None

    def connection_lost(self, exc) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.timeout, self._expire)

    def _expire(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()
