"""What an agent's config must point at: the daemon's endpoint and the model it serves."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .errors import AgentConfigError

PROVIDER_ID = "mtplx"


class NoModelLoaded(AgentConfigError):
    """The daemon serves no model, so there is no model id or limit to write."""


@dataclass(frozen=True)
class AgentTarget:
    """The facts every writer needs, taken from the daemon's `daemon.status`.

    `api_key_env` is the name of the environment variable holding the API key when the daemon
    requires one, else None; writers reference it and never copy the key itself.
    `reasoning_efforts` are the reasoning-effort levels the model accepts (a request for
    another is a 400); empty when the daemon does not say.
    """

    base_url: str
    model_id: str
    context_window: int
    max_output_tokens: int
    reasoning: bool = False
    api_key_env: str | None = None
    reasoning_efforts: tuple[str, ...] = ()

    @classmethod
    def from_status(cls, status: dict[str, Any]) -> "AgentTarget":
        """Build the target from a `daemon.status` result; NoModelLoaded when none is served."""
        http = status.get("http") or {}
        model = status.get("model")
        if not model or not model.get("id"):
            raise NoModelLoaded("the daemon serves no model yet; load one with `mtplxctl start --model <id>` first")
        if model.get("state", "loaded") != "loaded" or not model.get("context_length"):
            raise NoModelLoaded(f"the model is {model.get('state', 'not ready')}, not loaded; "
                                "wait for `mtplxctl status` to show it loaded, then run this again")
        return cls(
            base_url=str(http["base_url"]).rstrip("/"),
            model_id=str(model["id"]),
            context_window=int(model["context_length"]),
            max_output_tokens=int(model["max_output_tokens"]),
            reasoning=bool(model.get("reasoning", False)),
            api_key_env=(http.get("key_env") or "MTPLX_API_KEY") if http.get("key_required") else None,
            reasoning_efforts=tuple(model.get("reasoning_efforts") or ()),
        )

    @property
    def server_root(self) -> str:
        """The base URL without its `/v1` suffix (what Anthropic clients expect)."""
        return self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready copy, kept in the install record."""
        return asdict(self)
