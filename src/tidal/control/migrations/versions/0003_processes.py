"""the process table holds a job's master and its workers; dead columns go

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 10:40:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_index('ix_workers_node')
        batch_op.drop_index('ix_workers_job_id')
    op.rename_table('workers', 'processes')
    with op.batch_alter_table('processes', schema=None) as batch_op:
        batch_op.create_index('ix_processes_job_id', ['job_id'], unique=False)
        batch_op.create_index('ix_processes_node', ['node'], unique=False)
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('master_node')
        batch_op.drop_column('busy')
    op.drop_table('accuracy')


def downgrade() -> None:
    op.create_table('accuracy',
                    sa.Column('job_id', sa.String(length=64), nullable=False),
                    sa.Column('epoch', sa.Integer(), nullable=False),
                    sa.Column('value', sa.Float(), nullable=False),
                    sa.PrimaryKeyConstraint('job_id', 'epoch'))
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('busy', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('master_node', sa.String(length=128), nullable=False, server_default=''))
    with op.batch_alter_table('processes', schema=None) as batch_op:
        batch_op.drop_index('ix_processes_node')
        batch_op.drop_index('ix_processes_job_id')
    op.rename_table('processes', 'workers')
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.create_index('ix_workers_job_id', ['job_id'], unique=False)
        batch_op.create_index('ix_workers_node', ['node'], unique=False)
