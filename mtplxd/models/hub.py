"""Where the Hugging Face Hub is, whether mtplx may reach it, and what to say when it cannot.

`HF_ENDPOINT` (a mirror or a private Hub) and `HF_HUB_OFFLINE` are read at each call rather than
once at import, so a daemon and its tests see the environment they run in. Every network error
that huggingface_hub raises is translated here into a ModelStoreError whose message names the
endpoint and the two variables, and says what to do next.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE = {"1", "true", "yes", "on"}


class ModelStoreError(Exception):
    """A model-store operation failed; `reason` is the stable name scripts can match on."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def hub_endpoint() -> str:
    """The Hub base URL: `$HF_ENDPOINT` when set, else https://huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_offline() -> bool:
    """True when `HF_HUB_OFFLINE` (or the older `TRANSFORMERS_OFFLINE`) forbids network access."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def offline_error(action: str) -> ModelStoreError:
    """The error for an operation that needs the Hub while HF_HUB_OFFLINE is set."""
    return ModelStoreError(
        "offline",
        f"cannot {action}: HF_HUB_OFFLINE is set, so mtplx does not contact the Hugging Face Hub. "
        "Unset HF_HUB_OFFLINE (or set it to 0) to go online; pulled models and local folders "
        "still work offline.")


def require_online(action: str) -> None:
    """Raise the offline error when HF_HUB_OFFLINE is set."""
    if hub_offline():
        raise offline_error(action)


def unreachable_error(action: str, detail: object) -> ModelStoreError:
    """The error for a Hub that does not answer (no network, DNS, firewall, wrong mirror)."""
    endpoint = hub_endpoint()
    source = "HF_ENDPOINT" if os.environ.get("HF_ENDPOINT") else "the default; HF_ENDPOINT overrides it"
    return ModelStoreError(
        "unreachable",
        f"cannot {action}: the Hugging Face Hub at {endpoint} ({source}) did not answer ({detail}). "
        "Check the network connection, or point HF_ENDPOINT at a reachable mirror; set "
        "HF_HUB_OFFLINE=1 to work offline with pulled models and local folders.")


@contextmanager
def hub_errors(action: str, repo: str, revision: str | None = None) -> Iterator[None]:
    """Translate huggingface_hub and network exceptions raised inside into ModelStoreError."""
    import httpx2
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    where = hub_endpoint()
    try:
        yield
    except ModelStoreError:
        raise
    except OfflineModeIsEnabled:
        # huggingface_hub read HF_HUB_OFFLINE when it was imported.
        raise offline_error(action) from None
    except GatedRepoError:
        raise ModelStoreError(
            "gated", f"{repo} is gated on {where}: accept its terms on the model page, then log in "
                     "with `hf auth login` or set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise ModelStoreError(
            "revision_not_found", f"{repo} has no revision {revision!r} on {where}; use a branch, "
                                  "a tag or a commit sha from the model's history") from None
    except RepositoryNotFoundError:
        raise ModelStoreError(
            "not_found", f"{repo} was not found on {where} (check the spelling; a private repo needs "
                         "`hf auth login` or HF_TOKEN)") from None
    except (httpx2.TransportError, LocalEntryNotFoundError, ConnectionError, TimeoutError) as exc:
        raise unreachable_error(action, _short(exc)) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise ModelStoreError("hub_error", f"cannot {action}: {where} answered HTTP {status} "
                                           f"({_short(exc)})") from None


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
