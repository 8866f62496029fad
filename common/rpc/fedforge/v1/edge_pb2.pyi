from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("name", "shape", "dtype", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorList(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    def __init__(self, tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...

class Value(_message.Message):
    __slots__ = ("int", "data", "real", "ints", "blobs", "text")
    INT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    REAL_FIELD_NUMBER: _ClassVar[int]
    INTS_FIELD_NUMBER: _ClassVar[int]
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    int: int
    data: bytes
    real: float
    ints: IntList
    blobs: BytesList
    text: str
    def __init__(self, int: _Optional[int] = ..., data: _Optional[bytes] = ..., real: _Optional[float] = ..., ints: _Optional[_Union[IntList, _Mapping]] = ..., blobs: _Optional[_Union[BytesList, _Mapping]] = ..., text: _Optional[str] = ...) -> None: ...

class IntList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, values: _Optional[_Iterable[int]] = ...) -> None: ...

class BytesList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, values: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TrainRequest(_message.Message):
    __slots__ = ("run_id", "server_round", "weights", "config", "secagg")
    class SecaggEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_ROUND_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SECAGG_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    server_round: int
    weights: _containers.RepeatedCompositeFieldContainer[Tensor]
    config: _struct_pb2.Struct
    secagg: _containers.MessageMap[str, Value]
    def __init__(self, run_id: _Optional[str] = ..., server_round: _Optional[int] = ..., weights: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., secagg: _Optional[_Mapping[str, Value]] = ...) -> None: ...

class TrainReply(_message.Message):
    __slots__ = ("factory_id", "weights", "num_examples", "metrics", "masked", "predictions", "class_counts", "confusion")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    FACTORY_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    MASKED_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    CLASS_COUNTS_FIELD_NUMBER: _ClassVar[int]
    CONFUSION_FIELD_NUMBER: _ClassVar[int]
    factory_id: str
    weights: _containers.RepeatedCompositeFieldContainer[Tensor]
    num_examples: int
    metrics: _containers.ScalarMap[str, float]
    masked: Tensor
    predictions: Tensor
    class_counts: Tensor
    confusion: Tensor
    def __init__(self, factory_id: _Optional[str] = ..., weights: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., num_examples: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., masked: _Optional[_Union[Tensor, _Mapping]] = ..., predictions: _Optional[_Union[Tensor, _Mapping]] = ..., class_counts: _Optional[_Union[Tensor, _Mapping]] = ..., confusion: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ProxyRequest(_message.Message):
    __slots__ = ("sha256", "images")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    images: Tensor
    def __init__(self, sha256: _Optional[str] = ..., images: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ProxyReply(_message.Message):
    __slots__ = ("factory_id", "have")
    FACTORY_ID_FIELD_NUMBER: _ClassVar[int]
    HAVE_FIELD_NUMBER: _ClassVar[int]
    factory_id: str
    have: bool
    def __init__(self, factory_id: _Optional[str] = ..., have: _Optional[bool] = ...) -> None: ...

class SecAggRequest(_message.Message):
    __slots__ = ("run_id", "server_round", "stage", "fields")
    class FieldsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_ROUND_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    server_round: int
    stage: str
    fields: _containers.MessageMap[str, Value]
    def __init__(self, run_id: _Optional[str] = ..., server_round: _Optional[int] = ..., stage: _Optional[str] = ..., fields: _Optional[_Mapping[str, Value]] = ...) -> None: ...

class SecAggReply(_message.Message):
    __slots__ = ("factory_id", "fields")
    class FieldsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...
    FACTORY_ID_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    factory_id: str
    fields: _containers.MessageMap[str, Value]
    def __init__(self, factory_id: _Optional[str] = ..., fields: _Optional[_Mapping[str, Value]] = ...) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("run_id", "server_round", "weights", "config", "secagg")
    class SecaggEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_ROUND_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SECAGG_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    server_round: int
    weights: _containers.RepeatedCompositeFieldContainer[Tensor]
    config: _struct_pb2.Struct
    secagg: _containers.MessageMap[str, Value]
    def __init__(self, run_id: _Optional[str] = ..., server_round: _Optional[int] = ..., weights: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., secagg: _Optional[_Mapping[str, Value]] = ...) -> None: ...

class EvaluateReply(_message.Message):
    __slots__ = ("factory_id", "num_examples", "metrics", "confusion", "masked")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    FACTORY_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    CONFUSION_FIELD_NUMBER: _ClassVar[int]
    MASKED_FIELD_NUMBER: _ClassVar[int]
    factory_id: str
    num_examples: int
    metrics: _containers.ScalarMap[str, float]
    confusion: Tensor
    masked: Tensor
    def __init__(self, factory_id: _Optional[str] = ..., num_examples: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., confusion: _Optional[_Union[Tensor, _Mapping]] = ..., masked: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("config", "run_id")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    config: _struct_pb2.Struct
    run_id: str
    def __init__(self, config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., run_id: _Optional[str] = ...) -> None: ...

class DescribeReply(_message.Message):
    __slots__ = ("factory_id", "architecture", "fits", "reason", "data_source", "class_counts", "dp", "personalizes")
    FACTORY_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    FITS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    CLASS_COUNTS_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    PERSONALIZES_FIELD_NUMBER: _ClassVar[int]
    factory_id: str
    architecture: str
    fits: bool
    reason: str
    data_source: str
    class_counts: _containers.RepeatedScalarFieldContainer[int]
    dp: bool
    personalizes: bool
    def __init__(self, factory_id: _Optional[str] = ..., architecture: _Optional[str] = ..., fits: _Optional[bool] = ..., reason: _Optional[str] = ..., data_source: _Optional[str] = ..., class_counts: _Optional[_Iterable[int]] = ..., dp: _Optional[bool] = ..., personalizes: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("factory_id", "status", "num_examples", "data_source", "uptime_seconds", "pid", "skipped_files", "privacy", "architecture", "figures", "serving")
    class PrivacyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class FiguresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    FACTORY_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FILES_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    factory_id: str
    status: str
    num_examples: int
    data_source: str
    uptime_seconds: float
    pid: int
    skipped_files: _containers.RepeatedScalarFieldContainer[str]
    privacy: _containers.ScalarMap[str, float]
    architecture: str
    figures: _containers.ScalarMap[str, float]
    serving: str
    def __init__(self, factory_id: _Optional[str] = ..., status: _Optional[str] = ..., num_examples: _Optional[int] = ..., data_source: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., pid: _Optional[int] = ..., skipped_files: _Optional[_Iterable[str]] = ..., privacy: _Optional[_Mapping[str, float]] = ..., architecture: _Optional[str] = ..., figures: _Optional[_Mapping[str, float]] = ..., serving: _Optional[str] = ...) -> None: ...

class InspectRequest(_message.Message):
    __slots__ = ("image", "request_id")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    image: bytes
    request_id: str
    def __init__(self, image: _Optional[bytes] = ..., request_id: _Optional[str] = ...) -> None: ...

class InspectReply(_message.Message):
    __slots__ = ("request_id", "label", "class_index", "score", "probabilities", "model_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    CLASS_INDEX_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    label: str
    class_index: int
    score: float
    probabilities: _containers.RepeatedScalarFieldContainer[float]
    model_version: str
    def __init__(self, request_id: _Optional[str] = ..., label: _Optional[str] = ..., class_index: _Optional[int] = ..., score: _Optional[float] = ..., probabilities: _Optional[_Iterable[float]] = ..., model_version: _Optional[str] = ...) -> None: ...
