from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VersionInfo(_message.Message):
    __slots__ = ("id", "run_id", "server_round", "parent_id", "kind", "architecture", "status", "sha256", "size_bytes", "created_at", "secure_aggregation")
    ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_ROUND_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    SECURE_AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    id: str
    run_id: str
    server_round: int
    parent_id: str
    kind: str
    architecture: str
    status: str
    sha256: str
    size_bytes: int
    created_at: str
    secure_aggregation: bool
    def __init__(self, id: _Optional[str] = ..., run_id: _Optional[str] = ..., server_round: _Optional[int] = ..., parent_id: _Optional[str] = ..., kind: _Optional[str] = ..., architecture: _Optional[str] = ..., status: _Optional[str] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., created_at: _Optional[str] = ..., secure_aggregation: _Optional[bool] = ...) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ("status", "architecture")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    status: str
    architecture: str
    def __init__(self, status: _Optional[str] = ..., architecture: _Optional[str] = ...) -> None: ...

class ListVersionsReply(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[VersionInfo]
    def __init__(self, versions: _Optional[_Iterable[_Union[VersionInfo, _Mapping]]] = ...) -> None: ...

class GetVersionRequest(_message.Message):
    __slots__ = ("id", "offset", "chunk_size")
    ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    id: str
    offset: int
    chunk_size: int
    def __init__(self, id: _Optional[str] = ..., offset: _Optional[int] = ..., chunk_size: _Optional[int] = ...) -> None: ...

class VersionChunk(_message.Message):
    __slots__ = ("manifest", "signature", "total_size", "offset", "data")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    manifest: bytes
    signature: str
    total_size: int
    offset: int
    data: bytes
    def __init__(self, manifest: _Optional[bytes] = ..., signature: _Optional[str] = ..., total_size: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WatchApprovedRequest(_message.Message):
    __slots__ = ("architecture", "after_action")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    AFTER_ACTION_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    after_action: int
    def __init__(self, architecture: _Optional[str] = ..., after_action: _Optional[int] = ...) -> None: ...

class ApprovalEvent(_message.Message):
    __slots__ = ("action_id", "version_id", "action", "status", "architecture", "at", "release", "statement", "signature")
    ACTION_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    STATEMENT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    action_id: int
    version_id: str
    action: str
    status: str
    architecture: str
    at: str
    release: int
    statement: bytes
    signature: str
    def __init__(self, action_id: _Optional[int] = ..., version_id: _Optional[str] = ..., action: _Optional[str] = ..., status: _Optional[str] = ..., architecture: _Optional[str] = ..., at: _Optional[str] = ..., release: _Optional[int] = ..., statement: _Optional[bytes] = ..., signature: _Optional[str] = ...) -> None: ...
