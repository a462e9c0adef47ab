"""the coordinator's phase machine: a job's phase, its change in flight and the
policy's global batch; unused columns go (a GPU's worker, a process's creation time)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 14:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('phase', sa.String(length=16), nullable=False, server_default='submitted'))
        batch_op.add_column(sa.Column('change', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('batch', sa.Integer(), nullable=False, server_default='0'))
    # jobs of an older server: the phase is the state (a change in flight was
    # finished or rejected by its job master on its own)
    op.execute("UPDATE jobs SET phase = CASE WHEN state = 'resizing' THEN 'running' ELSE state END")
    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.drop_column('worker')
    with op.batch_alter_table('processes', schema=None) as batch_op:
        batch_op.drop_column('created')


def downgrade() -> None:
    with op.batch_alter_table('processes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('created', sa.Float(), nullable=False, server_default='0'))
    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.add_column(sa.Column('worker', sa.String(length=64), nullable=True))
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('batch')
        batch_op.drop_column('change')
        batch_op.drop_column('phase')
