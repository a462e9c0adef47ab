"""several hosts: each job master's state in the store (a master whose host
died restarts on another host from it), node labels (host, switch topology),
and relocated master processes

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 18:40:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'master_states',
        sa.Column('job_id', sa.String(length=64), nullable=False),
        sa.Column('seq', sa.Integer(), nullable=False),
        sa.Column('doc', sa.Text(), nullable=False),
        sa.Column('updated', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('job_id'),
    )
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('labels', sa.JSON(), nullable=True))
    with op.batch_alter_table('processes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('relocated', sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table('processes', schema=None) as batch_op:
        batch_op.drop_column('relocated')
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('labels')
    op.drop_table('master_states')
