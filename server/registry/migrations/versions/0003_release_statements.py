"""Signed release statements on every approve, revoke and rollback.

``actions.release`` (unique, only grows), ``actions.statement`` (canonical JSON) and
``actions.signature`` (the release key's envelope): edges act on an action only when its statement
verifies against the release key they pin and its release number is above the last one they applied.
Actions recorded before this revision have no statement; edges ignore them.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("actions") as batch:
        batch.add_column(sa.Column("release", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("statement", sa.Text(), nullable=False, server_default=""))
        batch.add_column(sa.Column("signature", sa.Text(), nullable=False, server_default=""))
        batch.create_unique_constraint("uq_actions_release", ["release"])


def downgrade() -> None:
    with op.batch_alter_table("actions") as batch:
        batch.drop_constraint("uq_actions_release", type_="unique")
        batch.drop_column("signature")
        batch.drop_column("statement")
        batch.drop_column("release")
