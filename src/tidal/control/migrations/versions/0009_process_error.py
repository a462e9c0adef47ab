"""liveness: why a process ended when its exit code does not say (a launch
that failed with an OS error)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28 10:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('processes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('error', sa.Text(), nullable=False, server_default=''))


def downgrade() -> None:
    with op.batch_alter_table('processes', schema=None) as batch_op:
        batch_op.drop_column('error')
