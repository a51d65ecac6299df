"""The models.* control methods in-process: errors as control-plane errors, cancellation."""

from __future__ import annotations

import threading

import pytest
import trio

from models.conftest import REPO
from mtplxd.control.protocol import RpcError
from mtplxd.control.registry import MethodRegistry
from mtplxd.models.methods import register_model_store_methods
from mtplxd.models.store import ModelStore, resolve_pulled
from mtplxd.paths import Paths


def call(method: str, params: dict, notify) -> object:
    registry = MethodRegistry()
    register_model_store_methods(registry, Paths.from_env())
    return trio.run(registry.get(method).handler, params, notify)


def test_a_caller_that_goes_away_stops_the_pull(hub):
    # The weights download waits until the caller is gone, as on a slow network.
    released = threading.Event()
    hub.hold["model.safetensors"] = released

    async def gone(name, params):
        released.set()
        raise trio.BrokenResourceError

    with pytest.raises(RpcError) as caught:
        call("models.pull", {"model": REPO}, gone)
    assert caught.value.reason == "cancelled"
    assert resolve_pulled(REPO, Paths.from_env().models_dir) is None
    assert not any((ModelStore(Paths.from_env().models_dir).repo_dir(REPO) / "blobs").glob("*.incomplete"))


def test_store_errors_keep_their_reason(hub):
    async def ignore(name, params):
        pass

    with pytest.raises(RpcError) as caught:
        call("models.pull", {"model": "mtplx-test/missing"}, ignore)
    assert caught.value.reason == "not_found" and "mtplx-test/missing" in caught.value.message
    with pytest.raises(RpcError) as caught:
        call("models.pull", {}, ignore)
    assert caught.value.reason == "invalid_params"
    with pytest.raises(RpcError) as caught:
        call("models.rm", {"model": REPO}, ignore)
    assert caught.value.reason == "not_pulled"


def test_catalog_method_lists_the_embedded_fallback_last():
    async def ignore(name, params):
        pass

    rows = call("models.catalog", {}, ignore)["models"]
    assert rows[-1]["id"] == "mtplx-tiny-coder" and sum(r["recommended"] for r in rows) == 1


@pytest.mark.parametrize("method", ["models.rm", "models.pull"])
@pytest.mark.parametrize("value", [5, ["org/name"], {"repo": "org/name"}])
def test_a_model_that_is_not_a_string_is_named_as_such(method, value):
    async def ignore(name, params):
        pass

    with pytest.raises(RpcError) as caught:
        call(method, {"model": value}, ignore)
    assert caught.value.reason == "invalid_params"
    assert "must be a string naming a model" in caught.value.message
    with pytest.raises(RpcError) as caught:
        call(method, {"model": "  "}, ignore)
    assert "model is required" in caught.value.message


def test_force_must_be_a_boolean():
    async def ignore(name, params):
        pass

    with pytest.raises(RpcError) as caught:
        call("models.rm", {"model": REPO, "force": "yes"}, ignore)
    assert caught.value.reason == "invalid_params" and "force" in caught.value.message
