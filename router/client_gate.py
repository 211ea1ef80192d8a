"""`ClientGate`: who a generation request is, and whether it may start now.

Both front doors call `admit` for each generation request, after the API
key check and before the body is parsed: it names the client (its API key,
else its address), takes one of its concurrency slots
(`ClientConcurrency`: the key's own `max_concurrent`, else
`--max-concurrent-per-client`), checks its key's token bucket
(`TokenRates`) and, for the `with` block, makes it the request's
`CURRENT_CLIENT`, through which `RequestFlow.run` charges the tokens when
the request ends. Refusals are 429 with `Retry-After`, counted per key
(`pdserve_router_key_rejections_total{key, reason}`); admitted requests
and their tokens too (`pdserve_router_key_requests_total`,
`pdserve_router_key_tokens_total`). Keys appear there and in logs by name
only. Event loop only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from router.api_error import ApiError
from router.auth import ApiKeyCheck
from router.http.client_limits import ClientConcurrency
from router.key_limits import CURRENT_CLIENT, Client, TokenRates
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)


class ClientGate:
    def __init__(self, auth: ApiKeyCheck, concurrency: ClientConcurrency,
                 rates: TokenRates | None = None, metrics: RouterMetrics | None = None
                 ) -> None:
        self.auth = auth
        self.concurrency = concurrency
        self.rates = rates or TokenRates()
        self._metrics = metrics

    @contextlib.contextmanager
    def admit(self, authorization: str | None, address: str | None) -> Iterator[Client]:
        """The request's `Client` for the `with` block; ApiError 401 / 429."""
        key = self.auth.check(authorization)
        if key is None:
            with self.concurrency.hold(ClientConcurrency.client_key(None, address),
                                       "client address"):
                yield Client(None)
            return
        with contextlib.ExitStack() as slot:
            try:
                charge = self.rates.admit(key)
                slot.enter_context(self.concurrency.hold(
                    ClientConcurrency.client_key(key.name, None), "API key", key.max_concurrent))
            except ApiError as exc:  # only the gate's own refusals, not the request's
                reason = "token_rate" if exc.code == "token_rate_exceeded" else "concurrency"
                log.info("API key %r refused (%s): %s", key.name, reason, exc.message)
                if self._metrics is not None:
                    self._metrics.key_rejections.labels(key=key.name, reason=reason).inc()
                raise
            if self._metrics is not None:
                self._metrics.key_requests.labels(key=key.name).inc()
            token = CURRENT_CLIENT.set(Client(key, self._charger(key.name, charge)))
            try:
                yield CURRENT_CLIENT.get()
            finally:
                CURRENT_CLIENT.reset(token)

    def _charger(self, name: str, charge: Callable[[int], None] | None
                 ) -> Callable[[int], None] | None:
        metrics = self._metrics
        if metrics is None and charge is None:
            return None

        def charged(num_tokens: int) -> None:
            if charge is not None:
                charge(num_tokens)
            if metrics is not None:
                metrics.key_tokens.labels(key=name).inc(num_tokens)
        return charged
