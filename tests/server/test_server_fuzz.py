"""API fuzzing: schemathesis drives a real `conveyor serve` from the server's own OpenAPI schema.

For /v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings, /tokenize and
/detokenize it sends generated bodies, valid and invalid, a bounded number per endpoint
(derandomized, so CI runs the same cases): no answer may be a 5xx, and every error answer must
be the OpenAI error body with its status as `code`. The server runs with a short context and
request timeout so that whatever valid request the fuzzer makes ends quickly.
"""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from tests.serve_process import start_server

MAX_EXAMPLES = 25  # per endpoint
ENDPOINTS = (
    r"^/(v1/completions|v1/chat/completions|v1/responses|v1/embeddings|tokenize|detokenize)$"
)
STATUSES: Counter[int] = Counter()


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    args = ["--model", str(demo_model_dir), "--max-model-len", "64", "--request-timeout", "2"]
    args += ["--max-n", "2", "--num-kv-blocks", "64", "--max-num-seqs", "16"]
    proc = start_server(args, tmp_path_factory.mktemp("fuzz"))
    yield proc
    proc.stop()
    print(
        f"\nfuzzing: {sum(STATUSES.values())} requests, by status {dict(sorted(STATUSES.items()))}"
    )


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    return schema.include(path_regex=ENDPOINTS)


schema = schemathesis.pytest.from_fixture("api_schema")


@schemathesis.check
def has_error_body(ctx, response, case) -> None:
    """Every 4xx/5xx answer is `{"error": {"message", "type", "param", "code"}}`."""
    STATUSES[response.status_code] += 1
    if response.status_code < 400:
        return
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == response.status_code and error["message"], error


@pytest.mark.slow
@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_fuzzed_requests_get_no_5xx_and_errors_have_the_error_body(case) -> None:
    response = case.call(timeout=30)
    case.validate_response(response, checks=[not_a_server_error, has_error_body])
