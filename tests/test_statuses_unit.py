"""The one table from engine errors to HTTP statuses that the Space's routes, `/generate` and the OpenAI routes share
(test_hostile_inputs.py sends the same bad requests to each running route)."""

from __future__ import annotations

import inspect

import pytest

from lora_manager import errors
from lora_manager.serving.statuses import RETRY, error_of, status_of
from lora_manager.space.refusals import REFUSAL_STATUS, Refusal, refusal

pytestmark = pytest.mark.unit

EXPECTED = {
    errors.RequestError: 422,
    errors.AdapterFormatError: 422,
    errors.AdapterIncompatibleError: 422,
    errors.AdapterValueError: 422,
    errors.AdapterSourceError: 422,
    errors.AdapterTooLargeError: 422,
    errors.CacheBudgetError: 422,
    errors.NotFoundError: 404,
    errors.UnknownAdapterError: 404,
    errors.BodyTooLargeError: 413,
    errors.QueueFullError: 429,
    errors.EngineClosedError: 503,
    errors.ReplicasLostError: 503,
    errors.LoraManagerError: 500,
}


def _make(kind: type[errors.LoraManagerError]) -> errors.LoraManagerError:
    return kind("message", field="steps") if issubclass(kind, errors.RequestError) else kind("message")


def test_every_engine_error_has_its_status():
    defined = {k for _, k in inspect.getmembers(errors, inspect.isclass) if issubclass(k, errors.LoraManagerError)}
    assert defined == set(EXPECTED), defined ^ set(EXPECTED)  # a new error class gets a row here
    assert {kind.__name__: status_of(_make(kind)) for kind in EXPECTED} == {k.__name__: s for k, s in EXPECTED.items()}


@pytest.mark.parametrize("status", sorted(set(EXPECTED.values())))
def test_an_error_rebuilt_from_its_status_keeps_the_status_and_field(status):
    rebuilt = error_of(status, "told", "steps")
    assert status_of(rebuilt) == status and str(rebuilt) == "told"
    assert getattr(rebuilt, "field", "steps") == "steps"


def test_the_space_answers_each_status_with_a_titled_refusal_and_a_fault_as_a_500():
    for kind, status in EXPECTED.items():
        shown = refusal(_make(kind))
        if status == 500:
            assert not isinstance(shown, Refusal)
        else:
            assert isinstance(shown, Refusal) and REFUSAL_STATUS[shown.title] == status, (kind, shown.title)
    assert set(RETRY) <= set(REFUSAL_STATUS.values())
