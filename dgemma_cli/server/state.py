"""What the handlers share: the engine, the batch loop, the served model ids, the worker pools, the API key."""

from __future__ import annotations

import hmac
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from .batching import BatchLoop
from .protocol import ApiError


@dataclass
class Server:
    engine: Any  # engine.Engine
    loop: BatchLoop
    model_id: str
    api_key: str | None = None
    adapters: dict[str, int] = field(default_factory=dict)  # model id -> LoRA adapter slot (lora.attach), beside
    # the base (slot 0)

    def slot_of(self, model: str) -> int | None:
        """The adapter slot a request's `model` names (0: the base), None: no such model here."""
        return 0 if model == self.model_id else self.adapters.get(model)

    @property
    def model_ids(self) -> list[str]:
        return [self.model_id, *self.adapters]
    created: int = field(default_factory=lambda: int(time.time()))
    picture_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "dgemma-picture"))
    # compiles run one at a time in the compile worker; these threads wait for it (at most MAX_WAITING of them: past
    # it, a 429) or find the cache, so a cached structure always finds a thread
    structure_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(16, "dgemma-structure"))
    seconds_per_request: float = 1.0  # moving average, for Retry-After

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        ok = hmac.compare_digest(token.strip().encode(), self.api_key.encode()) and scheme.lower() == "bearer"
        if not ok:
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")

    def retry_after(self) -> int:
        active, queued = self.loop.load()
        wait = self.seconds_per_request * (queued / self.loop.max_batch + 1)
        return int(min(60, max(1, math.ceil(wait))))

    def finished(self, seconds: float) -> None:
        self.seconds_per_request = 0.8 * self.seconds_per_request + 0.2 * seconds
