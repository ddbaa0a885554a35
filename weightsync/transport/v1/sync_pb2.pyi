from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OfferRequest(_message.Message):
    __slots__ = ("model", "version", "manifest", "signature", "objects", "origin", "hops")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    manifest: bytes
    signature: bytes
    objects: _containers.RepeatedScalarFieldContainer[str]
    origin: str
    hops: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., manifest: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., objects: _Optional[_Iterable[str]] = ..., origin: _Optional[str] = ..., hops: _Optional[int] = ...) -> None: ...

class OfferReply(_message.Message):
    __slots__ = ("decision", "missing", "current_version")
    class Decision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DECISION_UNSPECIFIED: _ClassVar[OfferReply.Decision]
        WANTED: _ClassVar[OfferReply.Decision]
        NOT_NEEDED: _ClassVar[OfferReply.Decision]
    DECISION_UNSPECIFIED: OfferReply.Decision
    WANTED: OfferReply.Decision
    NOT_NEEDED: OfferReply.Decision
    DECISION_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    decision: OfferReply.Decision
    missing: _containers.RepeatedScalarFieldContainer[str]
    current_version: int
    def __init__(self, decision: _Optional[_Union[OfferReply.Decision, str]] = ..., missing: _Optional[_Iterable[str]] = ..., current_version: _Optional[int] = ...) -> None: ...

class ObjectFrame(_message.Message):
    __slots__ = ("model", "version", "object", "data", "tensor", "start", "stop", "parent")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    object: str
    data: bytes
    tensor: str
    start: int
    stop: int
    parent: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., object: _Optional[str] = ..., data: _Optional[bytes] = ..., tensor: _Optional[str] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ..., parent: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("objects", "bytes", "duplicates")
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    objects: int
    bytes: int
    duplicates: int
    def __init__(self, objects: _Optional[int] = ..., bytes: _Optional[int] = ..., duplicates: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("verify",)
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    verify: bool
    def __init__(self, verify: _Optional[bool] = ...) -> None: ...

class LedgerEntry(_message.Message):
    __slots__ = ("version", "outcome", "path", "source", "bytes_pushed", "bytes_fetched", "timings_s", "error", "offered_unix_ms", "served_unix_ms", "digest", "route", "route_reason", "applied_early", "parity", "swap_path", "swap_path_reason")
    class TimingsSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PUSHED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FETCHED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OFFERED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SERVED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    ROUTE_REASON_FIELD_NUMBER: _ClassVar[int]
    APPLIED_EARLY_FIELD_NUMBER: _ClassVar[int]
    PARITY_FIELD_NUMBER: _ClassVar[int]
    SWAP_PATH_FIELD_NUMBER: _ClassVar[int]
    SWAP_PATH_REASON_FIELD_NUMBER: _ClassVar[int]
    version: int
    outcome: str
    path: str
    source: str
    bytes_pushed: int
    bytes_fetched: int
    timings_s: _containers.ScalarMap[str, float]
    error: str
    offered_unix_ms: int
    served_unix_ms: int
    digest: str
    route: str
    route_reason: str
    applied_early: int
    parity: ParityReport
    swap_path: str
    swap_path_reason: str
    def __init__(self, version: _Optional[int] = ..., outcome: _Optional[str] = ..., path: _Optional[str] = ..., source: _Optional[str] = ..., bytes_pushed: _Optional[int] = ..., bytes_fetched: _Optional[int] = ..., timings_s: _Optional[_Mapping[str, float]] = ..., error: _Optional[str] = ..., offered_unix_ms: _Optional[int] = ..., served_unix_ms: _Optional[int] = ..., digest: _Optional[str] = ..., route: _Optional[str] = ..., route_reason: _Optional[str] = ..., applied_early: _Optional[int] = ..., parity: _Optional[_Union[ParityReport, _Mapping]] = ..., swap_path: _Optional[str] = ..., swap_path_reason: _Optional[str] = ...) -> None: ...

class ParityReport(_message.Message):
    __slots__ = ("version", "engine", "max_abs_dlogprob", "expert_mismatch", "tokens", "probe_s", "breaches", "action", "compute_dtype", "dlogprob_p50", "dlogprob_p90", "gap_kl", "gap_overlap", "expert_positions")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_DLOGPROB_FIELD_NUMBER: _ClassVar[int]
    EXPERT_MISMATCH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBE_S_FIELD_NUMBER: _ClassVar[int]
    BREACHES_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DLOGPROB_P50_FIELD_NUMBER: _ClassVar[int]
    DLOGPROB_P90_FIELD_NUMBER: _ClassVar[int]
    GAP_KL_FIELD_NUMBER: _ClassVar[int]
    GAP_OVERLAP_FIELD_NUMBER: _ClassVar[int]
    EXPERT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    version: int
    engine: str
    max_abs_dlogprob: float
    expert_mismatch: float
    tokens: int
    probe_s: float
    breaches: _containers.RepeatedScalarFieldContainer[str]
    action: str
    compute_dtype: str
    dlogprob_p50: float
    dlogprob_p90: float
    gap_kl: float
    gap_overlap: float
    expert_positions: int
    def __init__(self, version: _Optional[int] = ..., engine: _Optional[str] = ..., max_abs_dlogprob: _Optional[float] = ..., expert_mismatch: _Optional[float] = ..., tokens: _Optional[int] = ..., probe_s: _Optional[float] = ..., breaches: _Optional[_Iterable[str]] = ..., action: _Optional[str] = ..., compute_dtype: _Optional[str] = ..., dlogprob_p50: _Optional[float] = ..., dlogprob_p90: _Optional[float] = ..., gap_kl: _Optional[float] = ..., gap_overlap: _Optional[float] = ..., expert_positions: _Optional[int] = ...) -> None: ...

class BrokenVersion(_message.Message):
    __slots__ = ("version", "digest", "error", "failures", "first_failed_unix_ms", "retry_in_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    FIRST_FAILED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    RETRY_IN_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    digest: str
    error: str
    failures: int
    first_failed_unix_ms: int
    retry_in_s: float
    def __init__(self, version: _Optional[int] = ..., digest: _Optional[str] = ..., error: _Optional[str] = ..., failures: _Optional[int] = ..., first_failed_unix_ms: _Optional[int] = ..., retry_in_s: _Optional[float] = ...) -> None: ...

class EngineState(_message.Message):
    __slots__ = ("state", "version", "reason")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[EngineState.State]
        SERVING: _ClassVar[EngineState.State]
        EMPTY: _ClassVar[EngineState.State]
        PAUSED: _ClassVar[EngineState.State]
        UNREACHABLE: _ClassVar[EngineState.State]
        UNKNOWN: _ClassVar[EngineState.State]
    STATE_UNSPECIFIED: EngineState.State
    SERVING: EngineState.State
    EMPTY: EngineState.State
    PAUSED: EngineState.State
    UNREACHABLE: EngineState.State
    UNKNOWN: EngineState.State
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    state: EngineState.State
    version: int
    reason: str
    def __init__(self, state: _Optional[_Union[EngineState.State, str]] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Verification(_message.Message):
    __slots__ = ("ok", "hashed", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    HASHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    hashed: str
    error: str
    def __init__(self, ok: _Optional[bool] = ..., hashed: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("agent", "region", "model", "current_version", "current_digest", "target_version", "ledger", "last_error", "engine", "peers", "started_unix_ms", "served_digest", "broken", "engine_state", "verification", "unhealthy", "parity", "refused")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CURRENT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SERVED_DIGEST_FIELD_NUMBER: _ClassVar[int]
    BROKEN_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STATE_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_FIELD_NUMBER: _ClassVar[int]
    PARITY_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    agent: str
    region: str
    model: str
    current_version: int
    current_digest: str
    target_version: int
    ledger: _containers.RepeatedCompositeFieldContainer[LedgerEntry]
    last_error: str
    engine: str
    peers: _containers.RepeatedScalarFieldContainer[str]
    started_unix_ms: int
    served_digest: str
    broken: _containers.RepeatedCompositeFieldContainer[BrokenVersion]
    engine_state: EngineState
    verification: Verification
    unhealthy: str
    parity: ParityReport
    refused: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, agent: _Optional[str] = ..., region: _Optional[str] = ..., model: _Optional[str] = ..., current_version: _Optional[int] = ..., current_digest: _Optional[str] = ..., target_version: _Optional[int] = ..., ledger: _Optional[_Iterable[_Union[LedgerEntry, _Mapping]]] = ..., last_error: _Optional[str] = ..., engine: _Optional[str] = ..., peers: _Optional[_Iterable[str]] = ..., started_unix_ms: _Optional[int] = ..., served_digest: _Optional[str] = ..., broken: _Optional[_Iterable[_Union[BrokenVersion, _Mapping]]] = ..., engine_state: _Optional[_Union[EngineState, _Mapping]] = ..., verification: _Optional[_Union[Verification, _Mapping]] = ..., unhealthy: _Optional[str] = ..., parity: _Optional[_Union[ParityReport, _Mapping]] = ..., refused: _Optional[_Iterable[int]] = ...) -> None: ...
