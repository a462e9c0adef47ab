"""idempotent submission: a job remembers the Idempotency-Key it was
submitted with, unique per user, so a retried submission finds its job
instead of creating a second one

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 19:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('idempotency_key', sa.String(length=128), nullable=True))
        batch_op.create_index('ix_jobs_user_idempotency_key', ['user', 'idempotency_key'], unique=True)


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_user_idempotency_key')
        batch_op.drop_column('idempotency_key')
