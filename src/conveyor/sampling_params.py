"""Sampling parameters of one request, checked once when the request is made.

Every invalid value raises ValueError naming the field and the allowed range, so
`LLM.generate` and the HTTP server (which maps ValueError to 400) share one check.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

from conveyor.pooling_params import PoolingParams
from conveyor.structured_params import StructuredOutputsParams
from conveyor.validation import check_int, check_number

MAX_TENANT_CHARS = 256
# Largest `logprobs` a request may ask for (vLLM's default `max_logprobs`).
MAX_LOGPROBS = 20
# Stop strings are checked in the shared engine step, for every new token of the request, so
# their number and length are bounded (OpenAI allows 4; these are generous). The longest one
# is also how much text a stream holds back until it knows no stop string starts there.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
# logit_bias entries are added to the logits every step: bounded (OpenAI allows 300).
MAX_LOGIT_BIAS_ENTRIES = 1024
# stop_token_ids are copied into every sample and matched against every sampled token.
MAX_STOP_TOKEN_IDS = 1024
# allowed_token_ids is a mask built every step (vLLM has no cap; this is above any vocabulary).
MAX_ALLOWED_TOKEN_IDS = 1 << 18
# bad_words are tokenized once per request and matched against every new token of it.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 512
# A cache salt is hashed into the first KV block's hash of every prompt that carries it.
MAX_CACHE_SALT_CHARS = 1024
# `seed` is a signed 64-bit integer, as in vLLM (torch.long's range).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def sample_seed(seed: int, index: int) -> int:
    """The generator seed (unsigned 64-bit) of sample `index` of a request seeded with `seed`:
    a hash, not `seed + index`, which overflows at 2^63 - 1 and makes sample 1 of seed s
    sample 0 of seed s + 1. torch's CPU generator keeps the low 32 bits, so two seeds share a
    stream with probability 2^-32 (raw seeds would whenever they agree mod 2^32)."""
    packed = struct.pack("<qq", seed, index)
    digest = hashlib.blake2b(packed, digest_size=8, person=b"conveyor-seed").digest()
    return int.from_bytes(digest, "little")


def check_cache_salt(salt: object) -> None:
    """A cache salt is a non-empty string of at most MAX_CACHE_SALT_CHARS characters.

    Raises:
        ValueError: anything else (the message starts with `cache_salt`).
    """
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r:.80}.")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(
            f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}."
        )


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop, as in vLLM's SamplingParams.

    `temperature == 0` means greedy. `top_k` of -1 or 0 disables top-k, `top_p == 1` and
    `min_p == 0` disable theirs. `stop` strings are matched on the detokenized text and are
    not part of the returned text; `stop_token_ids` end the request when sampled.

    Scheduling fields (read by core/policies, never by the sampler): `priority` (lower runs
    first under the `priority` scheduler), `deadline` (seconds from arrival; a request still
    unfinished then ends with finish_reason "abort" and an `abort_reason`), `length_hint`
    (expected output tokens, used instead of `max_tokens` by the SJF-family schedulers),
    `tenant` (whose request it is: requests of different tenants share each step's time,
    core/tenant_shares.py; the server sets it to the client, `LLM.generate` takes `tenant=`).

    `structured_outputs` constrains the output to a JSON schema, a regex, a choice or a
    grammar (a StructuredOutputsParams, or a dict of its fields); the request then stops with
    finish_reason "stop" where the constraint is complete. `logit_bias` (OpenAI's) adds a
    bias in [-100, 100] to the logits of token ids before sampling (-100 bans, 100 all but
    forces); logprobs stay those of the raw logits. `prompt_logprobs` (vLLM's): the logprob of
    every prompt token after the first and its top alternatives, from the prompt's own forward
    (such a request skips the prefix cache, whose hits would not be computed).

    `seed` (a signed 64-bit integer) makes the request reproducible; sample i of n draws from
    its own stream, seeded with `sample_seed(seed, i)`. `cache_salt` (vLLM's): requests with
    different salts never share prefix-cache blocks (the salt enters the hash of the first
    block), so one client cannot tell from cached tokens or timing what another one sent.

    `pooling` (a PoolingParams, or a dict of its fields) makes it an embedding request: its
    prompt runs, nothing is sampled, and its output carries the pooled vector
    (`RequestOutput.embedding`); it takes n = 1 and no prompt logprobs or output constraint.

    `allowed_token_ids` (vLLM's): only these token ids can be sampled (every other logit is
    -inf). `bad_words` (vLLM's): words never generated. The engine's tokenizer turns each
    into its token ids, with and without a leading space, as vLLM does
    (`bad_words_token_ids`, which a caller may also give directly); a word's last token is
    banned whenever the tokens generated so far end with the rest of the word. Both mask
    logits before the penalties; logprobs stay those of the raw logits.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    priority: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    deadline: float | None = None
    length_hint: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = None
    pooling: PoolingParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    tenant: str = ""
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:  # before each id is checked
            raise ValueError(
                f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids, "
                f"got {len(self.stop_token_ids)}."
            )
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if isinstance(self.pooling, dict):
            self.pooling = PoolingParams(**self.pooling)
        self._verify()

    def _verify(self) -> None:
        check_int("n", self.n, lo=1)
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, lo=1)
        check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        check_number(
            "temperature", self.temperature, ">= 0 and finite", lambda v: 0 <= v < float("inf")
        )
        check_number("top_p", self.top_p, "in (0, 1]", lambda v: 0.0 < v <= 1.0)
        check_int("top_k", self.top_k, lo=-1, hint="-1 or 0 disables top-k")
        check_number("min_p", self.min_p, "in [0, 1]", lambda v: 0.0 <= v <= 1.0)
        for name in ("presence_penalty", "frequency_penalty"):
            check_number(name, getattr(self, name), "in [-2, 2]", lambda v: -2 <= v <= 2)
        check_number(
            "repetition_penalty",
            self.repetition_penalty,
            "in (0, 2]",
            lambda v: 0.0 < v <= 2.0,
        )
        if self.seed is not None:
            check_int("seed", self.seed, lo=SEED_MIN, hi=SEED_MAX, hint="a signed 64-bit integer")
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        check_int("priority", self.priority, lo=-(2**31), hi=2**31 - 1)
        if not isinstance(self.tenant, str) or len(self.tenant) > MAX_TENANT_CHARS:
            raise ValueError(
                f"tenant must be a string of at most {MAX_TENANT_CHARS} characters, "
                f"got {self.tenant!r:.80}."
            )
        if self.deadline is not None:
            check_number(
                "deadline",
                self.deadline,
                "a positive, finite number of seconds from arrival",
                lambda v: 0 < v < float("inf"),
            )
        if self.length_hint is not None:
            check_int("length_hint", self.length_hint, lo=1)
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop_strings)}."
            )
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a non-empty string or a list of them, got {s!r}.")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop must be strings of at most {MAX_STOP_STRING_CHARS} characters, "
                    f"got one of {len(s)}."
                )
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams or a dict of its fields, "
                f"got {type(so).__name__}."
            )
        self._verify_logit_bias()
        self._verify_masks()
        if self.cache_salt is not None:
            check_cache_salt(self.cache_salt)
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}.")
        self._verify_pooling()

    def _verify_pooling(self) -> None:
        if self.pooling is None:
            return
        if not isinstance(self.pooling, PoolingParams):
            raise ValueError(
                "pooling must be a PoolingParams or a dict of its fields, "
                f"got {type(self.pooling).__name__}."
            )
        for name, value, none in (
            ("n", self.n, 1),
            ("prompt_logprobs", self.prompt_logprobs, None),
            ("structured_outputs", self.structured_outputs, None),
        ):
            if value != none:
                raise ValueError(
                    f"{name} must be {none} for an embedding (pooling) request, got {value!r:.80}."
                )

    @property
    def needs_every_prompt_row(self) -> bool:
        """Every prompt token's row is read (prompt logprobs, mean pooling), so the prefix
        cache's hits, whose rows are never computed, cannot stand in for any of them."""
        pooling = self.pooling
        return self.prompt_logprobs is not None or (
            pooling is not None and pooling.pooling_type == "mean"
        )

    def _verify_masks(self) -> None:
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, list) or not allowed:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids.")
            if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(
                    f"allowed_token_ids must hold at most {MAX_ALLOWED_TOKEN_IDS} token ids, "
                    f"got {len(allowed)}."
                )
            for t in allowed:
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(
                        f"allowed_token_ids must be token ids (integers >= 0), got {t!r}."
                    )
        words = self.bad_words
        if words is not None:
            if not isinstance(words, list) or len(words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words must be a list of at most {MAX_BAD_WORDS} strings.")
            for w in words:
                if not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS:
                    raise ValueError(
                        "bad_words must be non-blank strings of at most "
                        f"{MAX_BAD_WORD_CHARS} characters, got {w!r:.80}."
                    )
        for ids in self.bad_words_token_ids or ():
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
            ):
                raise ValueError(
                    f"bad_words_token_ids must be non-empty lists of token ids, got {ids!r:.80}."
                )

    def _verify_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must map token ids to biases, got {type(bias).__name__}.")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(
                f"logit_bias must hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}."
            )
        for t, b in bias.items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}.")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r}.")
