from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FrameKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FRAME_KIND_UNSPECIFIED: _ClassVar[FrameKind]
    FRAME_KIND_BEGIN: _ClassVar[FrameKind]
    FRAME_KIND_DATA: _ClassVar[FrameKind]
    FRAME_KIND_END: _ClassVar[FrameKind]
    FRAME_KIND_ABORT: _ClassVar[FrameKind]
FRAME_KIND_UNSPECIFIED: FrameKind
FRAME_KIND_BEGIN: FrameKind
FRAME_KIND_DATA: FrameKind
FRAME_KIND_END: FrameKind
FRAME_KIND_ABORT: FrameKind

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop_token_ids", "ignore_eos", "logprobs", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "grammar", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    grammar: Grammar
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_schema", "regex", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("min_interval_s", "max_interval_s")
    MIN_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    min_interval_s: float
    max_interval_s: float
    def __init__(self, min_interval_s: _Optional[float] = ..., max_interval_s: _Optional[float] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("role", "generation", "num_waiting", "num_waiting_tokens", "num_running", "num_free_blocks", "num_total_blocks", "block_size", "prefix_hit_rate", "model", "max_model_len", "draining", "cache_events_channel", "device", "tensor_parallel_size")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVENTS_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    role: str
    generation: int
    num_waiting: int
    num_waiting_tokens: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    prefix_hit_rate: float
    model: str
    max_model_len: int
    draining: bool
    cache_events_channel: str
    device: str
    tensor_parallel_size: int
    def __init__(self, role: _Optional[str] = ..., generation: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_waiting_tokens: _Optional[int] = ..., num_running: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., prefix_hit_rate: _Optional[float] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., draining: _Optional[bool] = ..., cache_events_channel: _Optional[str] = ..., device: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("endpoints", "ticket", "transport", "generation", "deadline_unix_ms", "num_held_tokens", "ranks", "tensor_parallel_size")
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    ticket: bytes
    transport: str
    generation: int
    deadline_unix_ms: int
    num_held_tokens: int
    ranks: _containers.RepeatedCompositeFieldContainer[KVRankTarget]
    tensor_parallel_size: int
    def __init__(self, endpoints: _Optional[_Iterable[str]] = ..., ticket: _Optional[bytes] = ..., transport: _Optional[str] = ..., generation: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., num_held_tokens: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[KVRankTarget, _Mapping]]] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class KVRankTarget(_message.Message):
    __slots__ = ("endpoints", "head_start", "head_end")
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_END_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    head_start: int
    head_end: int
    def __init__(self, endpoints: _Optional[_Iterable[str]] = ..., head_start: _Optional[int] = ..., head_end: _Optional[int] = ...) -> None: ...

class DecodeGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "output_token_ids", "remote_prefill", "local_prefill_below", "split_at", "local_within_budget", "prefill_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_BELOW_FIELD_NUMBER: _ClassVar[int]
    SPLIT_AT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WITHIN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    remote_prefill: bool
    local_prefill_below: int
    split_at: int
    local_within_budget: bool
    prefill_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., remote_prefill: _Optional[bool] = ..., local_prefill_below: _Optional[int] = ..., split_at: _Optional[int] = ..., local_within_budget: _Optional[bool] = ..., prefill_cached_tokens: _Optional[int] = ...) -> None: ...

class Reserved(_message.Message):
    __slots__ = ("target", "block_size", "num_reserved_blocks", "split_at")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SPLIT_AT_FIELD_NUMBER: _ClassVar[int]
    target: KVTarget
    block_size: int
    num_reserved_blocks: int
    split_at: int
    def __init__(self, target: _Optional[_Union[KVTarget, _Mapping]] = ..., block_size: _Optional[int] = ..., num_reserved_blocks: _Optional[int] = ..., split_at: _Optional[int] = ...) -> None: ...

class DecodeTokens(_message.Message):
    __slots__ = ("first_index", "token_ids", "logprobs", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "prompt_logprobs")
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, first_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class DecodeGenerateResponse(_message.Message):
    __slots__ = ("reserved", "tokens")
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    reserved: Reserved
    tokens: DecodeTokens
    def __init__(self, reserved: _Optional[_Union[Reserved, _Mapping]] = ..., tokens: _Optional[_Union[DecodeTokens, _Mapping]] = ...) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionCommand(_message.Message):
    __slots__ = ("generate", "cancel")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    generate: DecodeGenerateRequest
    cancel: str
    def __init__(self, generate: _Optional[_Union[DecodeGenerateRequest, _Mapping]] = ..., cancel: _Optional[str] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("request_id", "reserved", "tokens", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reserved: Reserved
    tokens: DecodeTokens
    error: SessionError
    def __init__(self, request_id: _Optional[str] = ..., reserved: _Optional[_Union[Reserved, _Mapping]] = ..., tokens: _Optional[_Union[DecodeTokens, _Mapping]] = ..., error: _Optional[_Union[SessionError, _Mapping]] = ...) -> None: ...

class SessionBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[SessionEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[SessionEvent, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "output_token_ids", "target")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    target: KVTarget
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., target: _Optional[_Union[KVTarget, _Mapping]] = ...) -> None: ...

class PrefillFirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "num_prompt_tokens", "num_cached_tokens", "prompt_logprobs", "scored_only")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SCORED_ONLY_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: TokenLogprob
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    scored_only: bool
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., scored_only: _Optional[bool] = ...) -> None: ...

class PrefillTransferDone(_message.Message):
    __slots__ = ("kv_bytes_sent",)
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    kv_bytes_sent: int
    def __init__(self, kv_bytes_sent: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token", "transfer_done")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_DONE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: PrefillFirstToken
    transfer_done: PrefillTransferDone
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[_Union[PrefillFirstToken, _Mapping]] = ..., transfer_done: _Optional[_Union[PrefillTransferDone, _Mapping]] = ...) -> None: ...

class KVFrame(_message.Message):
    __slots__ = ("version", "kind", "request_id", "layer", "offset", "payload", "checksum", "ticket", "num_layers", "num_tokens", "num_kv_heads", "head_dim", "dtype", "first_token_id", "total_bytes", "reason", "flags", "token_offset", "head_start", "model_kv_heads", "sub_start", "sub_end", "num_senders", "traceparent")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    MODEL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    SUB_START_FIELD_NUMBER: _ClassVar[int]
    SUB_END_FIELD_NUMBER: _ClassVar[int]
    NUM_SENDERS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    version: int
    kind: FrameKind
    request_id: str
    layer: int
    offset: int
    payload: bytes
    checksum: int
    ticket: bytes
    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    first_token_id: int
    total_bytes: int
    reason: str
    flags: int
    token_offset: int
    head_start: int
    model_kv_heads: int
    sub_start: int
    sub_end: int
    num_senders: int
    traceparent: str
    def __init__(self, version: _Optional[int] = ..., kind: _Optional[_Union[FrameKind, str]] = ..., request_id: _Optional[str] = ..., layer: _Optional[int] = ..., offset: _Optional[int] = ..., payload: _Optional[bytes] = ..., checksum: _Optional[int] = ..., ticket: _Optional[bytes] = ..., num_layers: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., first_token_id: _Optional[int] = ..., total_bytes: _Optional[int] = ..., reason: _Optional[str] = ..., flags: _Optional[int] = ..., token_offset: _Optional[int] = ..., head_start: _Optional[int] = ..., model_kv_heads: _Optional[int] = ..., sub_start: _Optional[int] = ..., sub_end: _Optional[int] = ..., num_senders: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class PushResult(_message.Message):
    __slots__ = ("ok", "reason")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "messages", "prompt_token_ids", "sampling", "session_id", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    session_id: str
    request_id: str
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "logprobs", "finish_reason", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "max_model_len", "created")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    created: int
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., created: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class CacheEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheEventBatch(_message.Message):
    __slots__ = ("address", "role", "generation", "block_size", "sequence", "snapshot", "stored", "evicted")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: str
    generation: int
    block_size: int
    sequence: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    evicted: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, address: _Optional[str] = ..., role: _Optional[str] = ..., generation: _Optional[int] = ..., block_size: _Optional[int] = ..., sequence: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., evicted: _Optional[_Iterable[int]] = ...) -> None: ...
