"""`POST /reset_prefix_cache`: vLLM's route and answer (200, empty body) once the pipeline has
cleared every worker's caches; the API key guards it when one is set; a failure is a 5xx that
names the instances (the NATS side: tests/worker/test_reset_prefix_cache.py)."""

from __future__ import annotations

import httpx

from mmserve.runtime.errors import RemoteError

from .conftest import RunningFrontend


def test_reset_answers_200_with_an_empty_body(frontend: RunningFrontend) -> None:
    before = frontend.dispatcher.resets
    response = httpx.post(frontend.url + "/reset_prefix_cache")
    assert response.status_code == 200
    assert response.content == b""
    assert response.headers["content-length"] == "0"
    assert frontend.dispatcher.resets == before + 1


def test_reset_is_post_only(frontend: RunningFrontend) -> None:
    response = httpx.get(frontend.url + "/reset_prefix_cache")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_reset_needs_the_api_key_when_set(start_frontend) -> None:
    frontend = start_frontend("--api-key", "s3cret")
    before = frontend.dispatcher.resets
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
        response = httpx.post(frontend.url + "/reset_prefix_cache", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert frontend.dispatcher.resets == before
    response = httpx.post(
        frontend.url + "/reset_prefix_cache", headers={"authorization": "Bearer s3cret"}
    )
    assert response.status_code == 200
    assert frontend.dispatcher.resets == before + 1


def test_a_failed_reset_is_a_5xx_naming_the_instance(frontend: RunningFrontend) -> None:
    message = "1 of 2 instances did not clear their caches: worker ab12: [deadline_exceeded] ..."
    frontend.dispatcher.reset_failure = RemoteError("cache_reset_failed", message)
    response = httpx.post(frontend.url + "/reset_prefix_cache")
    assert response.status_code == 503
    error = response.json()["error"]
    assert (error["code"], error["type"], error["message"]) == (
        "cache_reset_failed",
        "server_error",
        message,
    )
