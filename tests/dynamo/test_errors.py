"""Failures as the exceptions Dynamo's runtime turns into the client's HTTP error: the worker's
refusals and mmserve's errors, and an error Dynamo's client raised for the encode worker."""

from __future__ import annotations

from dynamo.llm.exceptions import HttpError, InvalidArgument

from mmserve.dynamo import requests
from mmserve.dynamo.handler import dynamo_error
from mmserve.engines.base import EngineOverloaded


def test_a_refusal_is_the_clients_400_with_its_reason() -> None:
    error = dynamo_error(requests.RequestRefused("this worker takes images only"))
    assert isinstance(error, InvalidArgument)
    assert str(error) == "this worker takes images only"


def test_mmserve_errors_keep_their_status() -> None:
    overloaded = dynamo_error(EngineOverloaded("queue full"))
    assert isinstance(overloaded, HttpError) and overloaded.code == 503
    fault = dynamo_error(RuntimeError("bug"))
    assert isinstance(fault, HttpError) and fault.code == 500
    assert "RuntimeError: bug" in fault.message


def test_an_error_from_the_encode_worker_stays_as_dynamo_typed_it() -> None:
    # What Dynamo's client raises in the worker when the encode worker refused an image.
    refused = InvalidArgument("process.aspect_ratio: image 0: ...")
    assert dynamo_error(refused) is refused
