"""per-worker resource limits: a process row carries its limits (and its
out-of-memory report), a node its memory

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25 17:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('processes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('resources', sa.JSON(), nullable=True))
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('memory', sa.BigInteger(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('memory')
    with op.batch_alter_table('processes', schema=None) as batch_op:
        batch_op.drop_column('resources')
