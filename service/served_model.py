"""The model this gateway serves: its name, the live engines that serve it (from their heartbeats), the
context they allow, and the embeddings it can give."""
from __future__ import annotations

from engine.pooler_config import PoolerConfig
from engine.pooling_params import PoolingParams

from service.broker_api import GatewayBroker
from service.errors import APIError
from service.messages import Heartbeat


class ServedModel:
    def __init__(self, name: str, max_model_len: int, broker: GatewayBroker, pooler: PoolerConfig | None) -> None:
        self.name = name
        self.max_model_len = max_model_len  # the checkpoint's (or --max-model-len)
        self._broker = broker
        # None (a gateway built without its checkpoint's folder, in tests): no Matryoshka dimensions known.
        self.pooler = pooler or PoolerConfig(hidden_size=0)

    def check_name(self, model: str | None) -> None:
        """A request naming another model is a 404 (naming none is fine)."""
        if model is not None and model != self.name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.name}'",
                           param="model", code="model_not_found")

    def check_pooling(self, pooling: PoolingParams) -> None:
        """``dimensions`` the model cannot give are a 400 here, as the engine would refuse them."""
        try:
            pooling.resolve(self.pooler)
        except ValueError as exc:
            raise APIError(400, str(exc), param="dimensions") from None

    def live_engines(self) -> dict[str, Heartbeat]:
        return {i: b for i, b in self._broker.engines.items() if b.model == self.name}

    def context_len(self) -> int:
        # The engines' limit wins when it is tighter than what the checkpoint says.
        return min([self.max_model_len] + [b.max_model_len for b in self.live_engines().values()])

    def unavailable_reason(self) -> str | None:
        if not self._broker.reachable:
            return "the broker (Redis) is unreachable"
        if not self.live_engines():
            return f"no live engine serves model {self.name!r}"
        return None
