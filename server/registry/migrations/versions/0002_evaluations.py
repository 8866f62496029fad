"""Federated evaluation and the model's input contract.

- ``evaluations``: the figures factories measured for a version on their own held-out images
  (summed confusion matrix, accuracy, recall per class, escape and false-reject rates), one row per
  time the version was evaluated (during the next round, or in the evaluate-only phase at the end).
- ``versions.model_input``: the class list, image size and channels the model was trained for, and
  the frozen backbone it sits on (pretrained family); edges decode images and map labels by it.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "evaluations",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("version_id", sa.String(64), sa.ForeignKey("versions.id"), nullable=False, index=True),
        sa.Column("run_id", sa.String(64), nullable=False, index=True),
        sa.Column("server_round", sa.Integer(), nullable=False),
        sa.Column("phase", sa.String(16), nullable=False),
        sa.Column("factories", sa.Integer(), nullable=False),
        sa.Column("examples", sa.Integer(), nullable=False),
        sa.Column("classes", sa.JSON(), nullable=False),
        sa.Column("confusion", sa.JSON(), nullable=False),
        sa.Column("figures", sa.JSON(), nullable=False),
        sa.Column("shared", sa.JSON(), nullable=False),
        sa.Column("secure_aggregation", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    with op.batch_alter_table("versions") as batch:
        batch.add_column(sa.Column("model_input", sa.JSON(), nullable=False, server_default="{}"))


def downgrade() -> None:
    with op.batch_alter_table("versions") as batch:
        batch.drop_column("model_input")
    op.drop_table("evaluations")
