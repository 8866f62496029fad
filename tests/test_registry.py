import hashlib
from collections import OrderedDict

import numpy as np
import pytest

from server.registry.artifacts import ArtifactError
from server.registry.service import NewVersion, Registry


def _weights(v=1.0):
    return OrderedDict(a=np.full((4, 4), v, np.float32), b=np.arange(3, dtype=np.float32))


def _new(run="r1", rnd=0, parent=None, kind="initial", v=1.0):
    return NewVersion(run_id=run, server_round=rnd, parent_id=parent, kind=kind, architecture="cnn-small",
                      weights=_weights(v), metrics={"accuracy": 0.5}, participants=["a"])


def test_versions_are_stored_with_lineage_and_sha256(registry_factory):
    reg = registry_factory()
    v0 = reg.add_version(_new())
    v1 = reg.add_version(_new(rnd=1, parent=v0.id, kind="fedavg", v=2.0))
    assert [v.id for v in reg.versions("r1")] == [v0.id, v1.id]
    assert reg.get_version(v1.id).parent_id == v0.id and v1.num_parameters == 19
    path = reg.artifacts.path_for(v1.sha256)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == v1.sha256
    assert np.array_equal(reg.load_weights(v1.id)["a"], _weights(2.0)["a"])
    assert v1.code_version and v1.signature


def test_corrupted_artifact_is_detected(registry_factory):
    reg = registry_factory()
    v = reg.add_version(_new())
    path = reg.artifacts.path_for(v.sha256)
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(ArtifactError, match="corrupt"):
        reg.load_weights(v.id)


def test_no_temporary_files_are_left(registry_factory):
    reg = registry_factory()
    reg.add_version(_new())
    assert not list(reg.artifacts.root.rglob(".tmp-*"))


def test_path_traversal_digest_is_refused(tmp_path):
    reg = Registry.at(tmp_path)
    with pytest.raises(ArtifactError, match="sha256"):
        reg.artifacts.path_for("../../etc/passwd")


def test_runs_and_rounds(registry_factory):
    reg = registry_factory()
    reg.start_run("r1", "1", {"x": 1})
    reg.record_round("r1", 1, status="completed", accuracy=0.4, loss=1.2, participants=["a", "b"], failures={"c": "timeout"}, seconds=3.0)
    reg.finish_run("r1", "finished")
    assert reg.get_run("r1").status == "finished"
    (r,) = reg.rounds("r1")
    assert r.failures == {"c": "timeout"} and r.participants == ["a", "b"]


def test_migrations_match_the_models(registry_factory):
    """The Alembic history produces exactly the schema the ORM models describe."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from server.registry.schema import Base

    reg = registry_factory()
    with reg.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


def test_unknown_schema_is_refused(tmp_path):
    import sqlite3

    from server.registry.migrate import SchemaError

    sqlite3.connect(tmp_path / "registry.db").execute("CREATE TABLE versions (id TEXT)")
    with pytest.raises(SchemaError, match="no migration history"):
        Registry.at(tmp_path)
