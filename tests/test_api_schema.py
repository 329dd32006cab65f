"""A bounded schemathesis run over the service's OpenAPI schema, against the real server: no
5xx, and every response (status, content type, headers, body) as the schema says; the same of
sequences of calls linked through the schema (its stateful phase); and the schema says "exactly
one of teacher or teachers".

Each operation's cases come from schemathesis's Hypothesis strategy (`APIOperation.as_strategy`)
driven by a plain `@given` test, so the run depends on no pytest internals."""
from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from tests.api_helpers import TOKEN  # noqa: E402
from tests.ray_helpers import wait_for  # noqa: E402

pytestmark = [pytest.mark.ray]
EXAMPLES = 30  # per operation: a few hundred cases in all


def test_no_server_error_and_every_response_fits_the_schema(api_service):
    with api_service.client() as http:  # /readyz answers 503 while the local Ray head starts
        wait_for(lambda: http.get("/readyz").status_code == 200, timeout=180, interval=0.5)
    schema = schemathesis.openapi.from_url(f"{api_service.url}/openapi.json",
                                           headers={"Authorization": f"Bearer {TOKEN}"})
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8, [op.label for op in operations]

    failures, calls = {}, []
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                  derandomize=True, database=None)
        def one_operation(case):
            # A request can fit the schema and still name a dataset, teacher or class this server
            # does not offer: its 422 is the answer, so "schema-valid request rejected" does not apply.
            calls.append(operation.label)
            case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"},
                                   excluded_checks=[schemathesis.checks.positive_data_acceptance])

        try:
            one_operation()
        except Exception as error:  # noqa: BLE001 - every operation is tried; all failures reported
            failures[operation.label] = f"{type(error).__name__}: {error}"
    assert len(calls) >= 5 * len(operations), len(calls)  # every operation got cases
    print(f"{len(calls)} cases over {len(operations)} operations")
    assert not failures, "\n\n".join(f"{label}\n{text}" for label, text in failures.items())


def test_the_schema_says_exactly_one_of_teacher_or_teachers(api_service):
    jsonschema = pytest.importorskip("jsonschema")
    with api_service.client() as http:
        schema = http.get("/openapi.json").json()["components"]["schemas"]["DistillationRequest"]
    check = jsonschema.Draft202012Validator(schema)
    base = {"dataset": "digits", "classes": [0]}
    assert not check.is_valid(base)  # neither: what the service refuses with a 422
    assert not check.is_valid({**base, "teacher": "a", "teachers": ["b"]})
    assert not check.is_valid({**base, "teacher": None})
    assert check.is_valid({**base, "teacher": "a"}) and check.is_valid({**base, "teachers": ["a", "b"]})
    assert check.is_valid({**base, "teacher": None, "teachers": ["a"]})  # a null one is absent


def test_schemathesis_stateful_phase_passes_with_a_seed_left_to_chance(api_service):
    """Sequences of calls linked through the schema (a job's id from one answer into the next
    request), with a seed Hypothesis draws anew each run: no 5xx, every answer as the schema says."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    schema = schemathesis.openapi.from_url(f"{api_service.url}/openapi.json", headers=auth)
    # Requests that fit the schema, as the test above sends: the token is added to each call, so a
    # negative case without it would be sent with it all the same.
    schema.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE])
    calls: list[str] = []

    class Stateful(schema.as_state_machine()):
        def get_call_kwargs(self, case):
            return {"headers": auth}

        def after_call(self, response, case):
            calls.append(f"{case.method} {case.path} {response.status_code}")

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            # A request can fit the schema and name a dataset or teacher this server does not offer.
            case.validate_response(response, excluded_checks=[schemathesis.checks.positive_data_acceptance],
                                   transport_kwargs=kwargs)

    Stateful.run(settings=settings(max_examples=25, stateful_step_count=6, deadline=None, database=None,
                                   suppress_health_check=list(HealthCheck)))
    print(f"{len(calls)} calls in sequences, {len({c.rsplit(' ', 1)[0] for c in calls})} operations")
    assert len(calls) >= 25
