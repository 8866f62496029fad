"""Alembic environment for the registry; run by `server.registry.migrate.upgrade`, never by hand."""

from alembic import context

from server.registry.schema import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
