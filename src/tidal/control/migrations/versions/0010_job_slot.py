"""isolation: each job's number among all jobs (its uid slot under --run-as LO-HI)

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28 14:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('slot', sa.Integer(), nullable=True))
        batch_op.create_index('ix_jobs_slot', ['slot'], unique=True)


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_slot')
        batch_op.drop_column('slot')
