"""throughput: measured per GPU type (a job's measured step times on T4 and on
A100 are different profiles); the key becomes (model, batch, gpus, gpu_type),
rows kept with gpu_type '' (untyped)

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-29 07:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def _table(name: str, typed: bool) -> None:
    cols = [
        sa.Column('model', sa.String(length=64), nullable=False),
        sa.Column('batch', sa.Integer(), nullable=False),
        sa.Column('gpus', sa.Integer(), nullable=False),
    ]
    if typed:
        cols.append(sa.Column('gpu_type', sa.String(length=64), nullable=False, server_default=''))
    cols += [
        sa.Column('value', sa.Float(), nullable=False),
        sa.Column('source', sa.String(length=256), nullable=False),
        sa.PrimaryKeyConstraint('model', 'batch', 'gpus', *(['gpu_type'] if typed else [])),
    ]
    op.create_table(name, *cols)


def upgrade() -> None:
    _table('throughput_typed', typed=True)
    op.execute("INSERT INTO throughput_typed (model, batch, gpus, gpu_type, value, source) "
               "SELECT model, batch, gpus, '', value, source FROM throughput")
    op.drop_table('throughput')
    op.rename_table('throughput_typed', 'throughput')


def downgrade() -> None:
    _table('throughput_untyped', typed=False)
    op.execute("INSERT INTO throughput_untyped (model, batch, gpus, value, source) "
               "SELECT model, batch, gpus, value, source FROM throughput WHERE gpu_type = ''")
    op.drop_table('throughput')
    op.rename_table('throughput_untyped', 'throughput')
