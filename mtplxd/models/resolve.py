"""Which folder a model spec names (None, the embedded model, a local folder, a pulled repo),
without the engine: the daemon's load, `mtplxctl bench` and `mtplxctl restart`'s check before
it stops anything all resolve a spec here, so they agree on what loads."""

from __future__ import annotations

from pathlib import Path

from mtplxd.models.builtin import EMBEDDED_MODEL_DIR, EMBEDDED_MODEL_ID, embedded_model_available
from mtplxd.models.spec import missing_folder


class ModelLoadFailed(Exception):
    """The model could not be resolved or loaded; the message says what to do."""


def resolve_model(spec: str | None, models_dir: Path) -> tuple[Path, str]:
    """Map a model spec (None, a local folder, or a pulled repo id) to (folder, served id).
    Raises ModelLoadFailed, saying what to do (a damaged manifest's message included)."""
    if not spec:
        if not embedded_model_available():
            raise ModelLoadFailed("no model configured and the embedded model is not installed; "
                                  "run `mtplxctl start --model PATH_OR_REPO`")
        return EMBEDDED_MODEL_DIR, EMBEDDED_MODEL_ID
    if spec == EMBEDDED_MODEL_ID:
        return resolve_model(None, models_dir)
    candidate = Path(spec).expanduser()
    if candidate.is_dir():
        return candidate.resolve(), candidate.resolve().name
    problem = missing_folder(spec)
    if problem is not None:  # a folder that is not there: nothing to pull either
        raise ModelLoadFailed(problem)
    from mtplxd.models.hub import ModelStoreError
    from mtplxd.models.store import resolve_pulled  # the store (Hub client) loads only when asked

    try:
        pulled = resolve_pulled(spec, models_dir)
    except ModelStoreError as exc:  # a damaged manifest: every loader reports it as a failed load
        raise ModelLoadFailed(exc.message) from exc
    if pulled is not None:
        return pulled
    raise ModelLoadFailed(f"model {spec} is neither a local folder nor a pulled model; "
                          f"pull it with `mtplxctl models pull {spec}` or pass a folder path")
