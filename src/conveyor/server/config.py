"""ServerConfig and the `conveyor serve` settings: built-in defaults < configs/*.yaml < flags.

One YAML file holds both the engine's keys (every EngineConfig field) and the server's keys
(every ServerConfig field); `-` and `_` are interchangeable in key names, and an unknown key is
an error that lists the known ones. The API key may also come from $CONVEYOR_API_KEY, so it
need not appear in a process listing or a file; several keys (one per tenant) are a list there,
comma-separated in the variable.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.config import EngineConfig
from conveyor.config.settings import ADMISSION, MODEL, PARALLELISM, SERVER, check_choices, setting
from conveyor.model.loading.checkpoint import check_checkpoint
from conveyor.server.reasoning import REASONING_PARSER_CHOICES
from conveyor.server.tenancy import tenant_salt
from conveyor.server.tool_parsers import TOOL_CALL_PARSERS
from conveyor.validation import check_int, check_number, check_positive_int

API_KEY_ENV = "CONVEYOR_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(slots=True)
class ServerConfig:
    host: str = setting(
        "127.0.0.1",
        "address to bind; 0.0.0.0 listens on every interface",
        section=SERVER,
        flag={"metavar": "ADDR"},
    )
    port: int = setting(8000, "port to listen on", section=SERVER, flag={"metavar": "PORT"})
    api_key: str | list[str] | None = setting(
        None,
        "the key, or keys (one per tenant, say), requests must bring as 'Authorization: "
        "Bearer KEY'; /health, /version and /metrics stay open. Prefer "
        f"${API_KEY_ENV} (comma-separated) to writing it in a file or a command line",
        section=SERVER,
        unset=f"${API_KEY_ENV}, else no key needed",
        flag={"metavar": "KEY", "nargs": "+", "action": "extend"},
    )
    cache_salt_from: str | None = setting(
        None,
        "who a request's tenant is, for the prefix cache: api-key (the key it used) or "
        "header:NAME (that header's value, set by a trusted gateway); each tenant gets its "
        "own cache salt, so no tenant shares (or can probe) another's cached prefixes "
        "(server/tenancy.py); none: one cache shared by every client and key, an explicit "
        "opt-in",
        section=SERVER,
        unset="api-key when several API keys are given, else one cache shared by all",
        flag={"metavar": "SOURCE"},
    )
    served_model_name: str | list[str] | None = setting(
        None,
        'names clients may send as "model"; the first is the one responses and metrics report',
        section=MODEL,
        unset='the model folder\'s name (or "conveyor-demo")',
        flag={"metavar": "NAME", "nargs": "+"},
    )
    shutdown_timeout: float = setting(
        10.0,
        "seconds in-flight requests may finish after SIGTERM or Ctrl-C (new ones get 503 "
        "meanwhile), after which the rest are aborted",
        section=SERVER,
    )
    log_level: str = setting("info", "log level", section=SERVER, choices=LOG_LEVELS)
    log_stats_interval: float = setting(
        5.0, "seconds between throughput log lines while busy; 0: off", section=SERVER
    )
    # Admission control and limits: beyond them a request is refused at once.
    max_waiting_requests: int | None = setting(
        None,
        "waiting sequences beyond which requests get 503 + Retry-After",
        section=ADMISSION,
        unset="one per KV block (at least max_num_seqs)",
    )
    max_client_sequences: int | None = setting(
        None,
        "sequences (n per prompt, one per embedding input) one client may have in flight, "
        "waiting or running; beyond: 429 + Retry-After. A client is its API key, else its "
        "tenant header (cache_salt_from header:NAME), else its address (server/admission.py)",
        section=ADMISSION,
        unset="no per-client limit",
    )
    max_client_tokens: int | None = setting(
        None,
        "tokens one client may have in flight, each request counted n x (prompt + "
        "max_tokens); beyond: 429 + Retry-After",
        section=ADMISSION,
        unset="no per-client limit",
    )
    max_n: int = setting(
        16, "largest `n` (samples per prompt) one request may ask for (above: 400)",
        section=ADMISSION,
    )  # fmt: skip
    max_prompts_per_request: int = setting(
        256, "prompts one completions request may hold (above: 400)", section=ADMISSION
    )
    max_chat_messages: int = setting(
        4096,
        "messages one chat request may hold (above: 400, before any is rendered)",
        section=ADMISSION,
    )
    max_request_body_bytes: int = setting(
        10 * 2**20, "larger request bodies get 413", section=ADMISSION, flag={"metavar": "B"}
    )
    max_header_bytes: int = setting(
        64 * 2**10,
        "request line + headers; larger ones get 431",
        section=ADMISSION,
        flag={"metavar": "B"},
    )
    # /v1/responses' store (server/response_store.py), counted as the JSON it keeps.
    responses_store_bytes: int = setting(
        256 * 2**20,
        "bytes of stored responses (store: true) kept over all tenants; past it the tenant "
        "holding the most loses its least recently used first",
        section=ADMISSION,
        flag={"metavar": "B"},
    )
    responses_store_tenant_bytes: int = setting(
        64 * 2**20,
        "bytes of stored responses each tenant (API key, or --cache-salt-from tenant) keeps; "
        "its new ones evict its own least recently used, never another tenant's",
        section=ADMISSION,
        flag={"metavar": "B"},
    )
    responses_store_entry_bytes: int = setting(
        4 * 2**20,
        "bytes one stored response may take; a bigger one is not stored (400 when the "
        "request itself set store: true and its input alone is over it, else store: false)",
        section=ADMISSION,
        flag={"metavar": "B"},
    )
    # Connections (server/http_limits.py, server/connections.py): what a client may hold open.
    header_timeout: float = setting(
        20.0,
        "seconds a connection has to send a request's line and headers, from connecting (or "
        "from the next request's first byte); then 408 and closed (closed if it sent nothing)",
        section=ADMISSION,
    )
    body_timeout: float = setting(
        20.0,
        "seconds a request body may go without a byte arriving; past the first such seconds it "
        "must also average body_min_rate; else 408 and closed",
        section=ADMISSION,
    )
    body_min_rate: float = setting(
        1024.0,
        "bytes a second a request body must average once body_timeout seconds have passed",
        section=ADMISSION,
        flag={"metavar": "B"},
    )
    keep_alive_timeout: float = setting(
        5.0,
        "seconds an idle connection stays open after a response, for the client's next request",
        section=ADMISSION,
    )
    max_connections: int | None = setting(
        None,
        "connections open at once; a new one beyond it closes the oldest idle connection (no "
        "request in progress) to make room, or gets 503 when none is idle",
        section=ADMISSION,
        unset="the open-file limit (its soft limit raised to the hard one at start-up) less the "
        "descriptors in use and a reserve of 1/16, at most 65536",
    )
    max_connections_per_client: int | None = setting(
        None,
        "connections one client address may hold at once; beyond it as max_connections, "
        "among that client's own (behind a gateway every client has its address: raise it)",
        section=ADMISSION,
        unset="half of max_connections, at least 1024 (or max_connections if smaller)",
    )
    # Output constraints, checked in a worker process (structured/grammar_checker.py) within
    # the engine's grammar_compile_timeout.
    grammar_memory_limit: int = setting(
        1024,
        "MiB of memory checking one output constraint (schema, regex, grammar) may take; past "
        "it the request is a 400",
        section=ADMISSION,
        flag={"metavar": "MIB"},
    )
    grammar_check_workers: int = setting(
        2,
        "output constraints checked at once, each in its own process: one slot for those "
        "estimated cheap, the rest for costly ones",
        section=ADMISSION,
    )
    grammar_checks_per_client: int = setting(
        8,
        "output constraints one client (API key, else address) may have being checked at "
        "once; more get 429",
        section=ADMISSION,
    )
    request_timeout: float | None = setting(
        None,
        'seconds; a request still unfinished then ends with finish_reason "abort" (caps '
        "each request's own `deadline`)",
        section=ADMISSION,
        unset="no limit",
    )
    engine_stall_timeout: float = setting(
        120.0,
        "seconds the engine may go without a step while requests are in flight before it "
        "counts as hung: /health 503, those requests end with an error (healthy again once it "
        "steps); 0: off",
        section=ADMISSION,
    )
    engine_heartbeat_timeout: float = setting(
        10.0,
        "liveness, not progress: seconds the engine process may send nothing, not even the "
        "beat it sends every second whatever its step does, before it counts as stopped or "
        "dead-locked: killed, the server exits 1 (a data-parallel replica is restarted); "
        "0: off",
        section=ADMISSION,
    )
    trust_request_chat_template: bool = setting(
        False,
        "let requests bring their own chat template (code that runs on the server); off: "
        "such a request gets 400",
        section=SERVER,
    )
    metrics_require_api_key: bool = setting(
        False, "with api_key, /metrics needs the key too", section=SERVER
    )
    tool_call_parser: str | None = setting(
        None,
        "the tool-call format (server/tool_parsers.py): how tools reach the model and how "
        '`tool_choice: "auto"` reads its calls; harmony (gpt-oss) reads every answer\'s '
        "channels, its reasoning included",
        section=SERVER,
        choices=tuple(TOOL_CALL_PARSERS),
        unset="the one the chat template teaches",
    )
    reasoning_parser: str | None = setting(
        None,
        "how a chat answer's <think>...</think> part (harmony: its analysis channel) becomes "
        "`reasoning_content` (server/reasoning.py); none: no split",
        section=SERVER,
        choices=REASONING_PARSER_CHOICES,
        unset="the one the chat template calls for (none if it has no <think> tags or <|channel|>)",
    )
    engine_process: bool = setting(
        True,
        "the engine in its own process, so streaming work never holds up a step through the "
        "GIL; off: a thread of the server's",
        section=PARALLELISM,
    )
    max_replica_restarts: int = setting(
        3,
        "with data_parallel_size > 1: a replica whose engine died fails only its own "
        "requests and is restarted, at most this many times; one more death ends the server "
        "with exit status 1 (as a single engine's death does). 0: the first death ends it",
        section=PARALLELISM,
    )

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty string, got {self.host!r}.")
        check_int("port", self.port, lo=1, hi=65535)
        for name in ("shutdown_timeout", "log_stats_interval"):
            check_number(name, getattr(self, name), ">= 0", lambda v: v >= 0)
        check_choices(self)  # log_level, tool_call_parser, reasoning_parser
        if self.max_waiting_requests is not None:  # None: sized to the KV cache by the engine
            check_positive_int("max_waiting_requests", self.max_waiting_requests)
        for name in ("max_client_sequences", "max_client_tokens"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        check_positive_int("max_n", self.max_n)
        check_positive_int("max_prompts_per_request", self.max_prompts_per_request)
        check_positive_int("max_chat_messages", self.max_chat_messages)
        check_positive_int("max_request_body_bytes", self.max_request_body_bytes)
        check_int("max_header_bytes", self.max_header_bytes, lo=1024)
        check_int("responses_store_entry_bytes", self.responses_store_entry_bytes, lo=1024)
        check_int(
            "responses_store_tenant_bytes",
            self.responses_store_tenant_bytes,
            lo=self.responses_store_entry_bytes,
            hint="at least responses_store_entry_bytes",
        )
        check_int(
            "responses_store_bytes",
            self.responses_store_bytes,
            lo=self.responses_store_tenant_bytes,
            hint="at least responses_store_tenant_bytes",
        )
        for name in ("header_timeout", "body_timeout", "body_min_rate", "keep_alive_timeout"):
            positive = "a positive, finite number"
            check_number(name, getattr(self, name), positive, lambda v: 0 < v < math.inf)
        for name in ("max_connections", "max_connections_per_client"):
            if getattr(self, name) is not None:  # None: from the open-file limit at start-up
                check_positive_int(name, getattr(self, name))
        check_int("grammar_memory_limit", self.grammar_memory_limit, lo=64)
        check_int("grammar_check_workers", self.grammar_check_workers, lo=2)
        check_positive_int("grammar_checks_per_client", self.grammar_checks_per_client)
        check_int("max_replica_restarts", self.max_replica_restarts, lo=0)
        for name in ("engine_stall_timeout", "engine_heartbeat_timeout"):
            check_number(
                name,
                getattr(self, name),
                "a finite number of seconds >= 0 (0: off)",
                lambda v: 0 <= v < math.inf,
            )
        if self.request_timeout is not None:
            check_number(
                "request_timeout",
                self.request_timeout,
                "a positive, finite number of seconds",
                lambda v: 0 < v < math.inf,
            )
        for name in ("engine_process", "trust_request_chat_template", "metrics_require_api_key"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}.")
        if self.api_key is not None:
            keys = [self.api_key] if isinstance(self.api_key, str) else self.api_key
            if (
                not isinstance(keys, (list, tuple))
                or not keys
                or not all(isinstance(k, str) and k for k in keys)
            ):
                message = "api_key must be a non-empty string or a list of them"
                raise ValueError(f"{message}, got {type(self.api_key).__name__}.")
            if not isinstance(self.api_key, str):
                self.api_key = list(dict.fromkeys(keys))  # drop repeats, keep order
        if self.cache_salt_from is not None:
            tenant_salt(self.cache_salt_from, len(self.api_keys))  # a known source?
            if self.cache_salt_from == "api-key" and self.api_key is None:
                raise ValueError(
                    "cache_salt_from api-key needs api_key: give --api-key (one key per "
                    "tenant), or name a tenant header with header:NAME."
                )
        names = self.served_model_name
        if names is not None:
            listed = [names] if isinstance(names, str) else names
            if (
                not isinstance(listed, (list, tuple))
                or not listed
                or not all(isinstance(n, str) and n for n in listed)
            ):
                message = "served_model_name must be a non-empty name or a list of them"
                raise ValueError(f"{message}, got {names!r}.")
            self.served_model_name = list(dict.fromkeys(listed))  # drop repeats, keep order

    @property
    def api_keys(self) -> list[str]:
        """Every accepted API key (empty: no key needed)."""
        key = self.api_key
        return [] if key is None else [key] if isinstance(key, str) else list(key)


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a configs/*.yaml file into a flat dict of known keys.

    Raises:
        ValueError: a missing or unreadable file, invalid YAML, or an unknown key.
    """
    import yaml

    file = Path(path)
    try:
        data = yaml.safe_load(file.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read config file {str(file)!r}: {exc.strerror}.") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {str(file)!r} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(file)!r} must hold a mapping of key: value.")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    known = _field_names(EngineConfig) + _field_names(ServerConfig)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(
            f"unknown key(s) in {str(file)!r}: {', '.join(unknown)}. "
            f"Known keys: {', '.join(sorted(known))}."
        )
    return data


def api_key_from_env() -> str | list[str] | None:
    """$CONVEYOR_API_KEY (the one place it is read): a key, a comma-separated list of them,
    or None when unset or empty. A value of only commas is an empty list, which ServerConfig
    refuses, rather than an open server."""
    value = os.environ.get(API_KEY_ENV)
    if not value:
        return None
    keys = [k.strip() for k in value.split(",") if k.strip()]
    return keys[0] if len(keys) == 1 else keys


def build_serve_config(
    config_file: str | os.PathLike[str] | None, overrides: dict[str, Any]
) -> tuple[EngineConfig, ServerConfig]:
    """Merge defaults, the config file and the flags (flags win; None means "not given").

    Args:
        config_file: a YAML file, or None.
        overrides: flag values by field name; None values are ignored.
    Returns:
        The engine's and the server's config.
    Raises:
        ValueError: a bad file, an unknown key, an invalid value, or a model or tokenizer
            folder that cannot be loaded (checked here, before anything heavy is imported).
    """
    values = read_config_file(config_file) if config_file else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    if values.get("api_key") is None:
        env_key = api_key_from_env()
        if env_key is not None:
            values["api_key"] = env_key
    server_keys = set(_field_names(ServerConfig))
    engine_values = {k: v for k, v in values.items() if k not in server_keys}
    server_values = {k: v for k, v in values.items() if k in server_keys}
    unknown = sorted(set(engine_values) - set(_field_names(EngineConfig)))
    if unknown:
        raise ValueError(f"unknown setting(s): {', '.join(unknown)}.")
    engine_config, server_config = EngineConfig(**engine_values), ServerConfig(**server_values)
    if engine_config.data_parallel_size > 1 and not server_config.engine_process:
        raise ValueError(
            f"data_parallel_size={engine_config.data_parallel_size} runs each replica in its "
            "own engine process; drop --no-engine-process (engine_process: false)."
        )
    check_checkpoint(engine_config.model, engine_config.tokenizer)
    return engine_config, server_config
