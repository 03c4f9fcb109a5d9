"""The prefix cache as a cross-client oracle (issue 27 item 4), against a real `conveyor serve`.

`usage.prompt_tokens_details.cached_tokens` (and the time to first token) told one client
whether another had sent a prefix. With `--cache-salt-from` every tenant's requests carry
their own cache salt: across tenants nothing is cached, within one tenant it is as before.
Several API keys are tenants by default (issue 49 item 8: key 2 once saw key 1's prompt, 160
cached tokens for a right guess against 48 for a wrong one); `--cache-salt-from none` is the
explicit opt-in to one shared cache.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from tests.serve_process import start_server

from conveyor.server.tenancy import TenantSalt

pytestmark = pytest.mark.slow  # each test talks to a real `conveyor serve`

ALICE, BOB = "sk-alice", "sk-bob"
PROMPT = [100 + (7 * i) % 500 for i in range(80)]  # five full 16-token blocks
COMMON = ["--num-kv-blocks", "128", "--served-model-name", "demo"]


@pytest.fixture(scope="module")
def by_key(demo_model_dir, tmp_path_factory):
    """Two keys and no --cache-salt-from: each key is a tenant by default."""
    args = ["--model", str(demo_model_dir), *COMMON, "--api-key", ALICE, BOB]
    proc = start_server(args, tmp_path_factory.mktemp("tenants-by-key"))
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log()


@pytest.fixture(scope="module")
def shared(demo_model_dir, tmp_path_factory):
    args = ["--model", str(demo_model_dir), *COMMON, "--api-key", ALICE, BOB,
            "--cache-salt-from", "none"]  # fmt: skip
    proc = start_server(args, tmp_path_factory.mktemp("tenants-shared"))
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def by_header(demo_model_dir, tmp_path_factory):
    args = ["--model", str(demo_model_dir), *COMMON, "--cache-salt-from", "header:X-Tenant"]
    proc = start_server(args, tmp_path_factory.mktemp("tenants-by-header"))
    yield proc
    assert proc.stop() == 0


def _client(server, key: str = "unused", **headers: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, default_headers=headers
    )


def _cached(client: openai.OpenAI, prompt: list[int] = PROMPT, **extra: str) -> int:
    resp = client.completions.create(
        model="demo", prompt=prompt, max_tokens=1, temperature=0.0, extra_body=extra
    )
    return resp.usage.prompt_tokens_details.cached_tokens


def test_tenants_by_api_key_never_see_each_others_cached_prefixes(by_key) -> None:
    alice, bob = _client(by_key, ALICE), _client(by_key, BOB)
    assert _cached(alice) == 0
    assert _cached(bob) == 0  # was 64 (by default, until issue 49): Bob learned of the prompt
    assert _cached(alice) == 64 and _cached(bob) == 64  # within a tenant: cached as before
    # A request's own cache_salt splits a tenant further ...
    assert _cached(alice, cache_salt="project-1") == 0
    assert _cached(alice, cache_salt="project-1") == 64
    # ... but picking another tenant's salt joins nothing: the tenant's part always comes first.
    alices = TenantSalt.parse("api-key").cache_salt([(b"authorization", b"Bearer sk-alice")], None)
    assert _cached(bob, cache_salt=alices) == 0


def test_the_shared_cache_is_an_explicit_opt_in(shared) -> None:
    """--cache-salt-from none: one cache for every key, as before issue 49."""
    prompt = [p + 5 for p in PROMPT]
    assert _cached(_client(shared, ALICE), prompt) == 0
    assert _cached(_client(shared, BOB), prompt) == 64  # key 2 reuses key 1's blocks


def test_chat_requests_are_isolated_too(by_key) -> None:
    messages = [{"role": "user", "content": "A question about the weather, asked at length. " * 6}]

    def cached(key: str) -> int:
        resp = _client(by_key, key).chat.completions.create(
            model="demo", messages=messages, max_tokens=1
        )
        return resp.usage.prompt_tokens_details.cached_tokens

    assert cached(ALICE) == 0 and cached(BOB) == 0
    assert cached(ALICE) > 0 and cached(BOB) > 0


def test_every_listed_key_is_accepted_and_no_other(by_key) -> None:
    with pytest.raises(openai.AuthenticationError):
        _cached(_client(by_key, "sk-mallory"))
    bad = httpx.post(
        f"{by_key.base_url}/v1/completions",
        json={"prompt": "x", "max_tokens": 1, "cache_salt": ""},
        headers={"Authorization": f"Bearer {ALICE}"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_tenants_by_header_are_isolated_and_the_header_is_taken_once(by_header) -> None:
    prompt = [p + 1 for p in PROMPT]
    a, b = _client(by_header, **{"X-Tenant": "a"}), _client(by_header, **{"X-Tenant": "b"})
    anonymous = _client(by_header)
    tenants = (a, b, anonymous)  # no header: the tenant "", a pool of its own
    assert [_cached(t, prompt) for t in tenants] == [0, 0, 0]
    assert [_cached(t, prompt) for t in tenants] == [64, 64, 64]
    twice = httpx.post(
        f"{by_header.base_url}/v1/completions",
        json={"prompt": "x", "max_tokens": 1},
        headers=[("X-Tenant", "b"), ("X-Tenant", "a")],
    )
    assert twice.status_code == 400 and "must be sent once" in twice.json()["error"]["message"]
