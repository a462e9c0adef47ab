"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-22 01:17:13.877565
"""
from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def _accuracy_and_events() -> None:
    op.create_table('accuracy',
    sa.Column('job_id', sa.String(length=64), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.Column('value', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('job_id', 'epoch')
    )
    op.create_table('events',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('time', sa.Float(), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('job_id', sa.String(length=64), nullable=True),
    sa.Column('node', sa.String(length=128), nullable=True),
    sa.Column('gpu', sa.Integer(), nullable=True),
    sa.Column('detail', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_events_job_id'), ['job_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_events_kind'), ['kind'], unique=False)
        batch_op.create_index(batch_op.f('ix_events_time'), ['time'], unique=False)


def _jobs_nodes_throughput_users() -> None:
    op.create_table('jobs',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('user', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('submit_time', sa.Float(), nullable=False),
    sa.Column('start_time', sa.Float(), nullable=True),
    sa.Column('end_time', sa.Float(), nullable=True),
    sa.Column('admitted', sa.Boolean(), nullable=False),
    sa.Column('drop_reason', sa.Text(), nullable=False),
    sa.Column('target', sa.Integer(), nullable=False),
    sa.Column('master_url', sa.String(length=256), nullable=False),
    sa.Column('master_node', sa.String(length=128), nullable=False),
    sa.Column('progress', sa.JSON(), nullable=False),
    sa.Column('done', sa.Float(), nullable=False),
    sa.Column('attained', sa.Float(), nullable=False),
    sa.Column('executed', sa.Float(), nullable=False),
    sa.Column('waiting_since', sa.Float(), nullable=False),
    sa.Column('tags', sa.JSON(), nullable=False),
    sa.Column('rescales', sa.Integer(), nullable=False),
    sa.Column('busy', sa.Boolean(), nullable=False),
    sa.Column('exit_info', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_state'), ['state'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_user'), ['user'], unique=False)

    op.create_table('nodes',
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('ordinal', sa.Integer(), nullable=False),
    sa.Column('address', sa.String(length=256), nullable=False),
    sa.Column('num_gpus', sa.Integer(), nullable=False),
    sa.Column('virtual', sa.Boolean(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('last_heartbeat', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('name'),
    sa.UniqueConstraint('ordinal')
    )
    op.create_table('throughput',
    sa.Column('model', sa.String(length=64), nullable=False),
    sa.Column('batch', sa.Integer(), nullable=False),
    sa.Column('gpus', sa.Integer(), nullable=False),
    sa.Column('value', sa.Float(), nullable=False),
    sa.Column('source', sa.String(length=256), nullable=False),
    sa.PrimaryKeyConstraint('model', 'batch', 'gpus')
    )
    op.create_table('users',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('is_admin', sa.Boolean(), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    with op.batch_alter_table('users', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_users_token_hash'), ['token_hash'], unique=True)


def _workers_and_gpus() -> None:
    op.create_table('workers',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('node', sa.String(length=128), nullable=False),
    sa.Column('gpu', sa.Integer(), nullable=True),
    sa.Column('desired', sa.String(length=16), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('pid', sa.Integer(), nullable=False),
    sa.Column('exit_code', sa.Integer(), nullable=True),
    sa.Column('env', sa.JSON(), nullable=False),
    sa.Column('argv', sa.JSON(), nullable=False),
    sa.Column('cwd', sa.Text(), nullable=False),
    sa.Column('created', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_workers_job_id'), ['job_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_workers_node'), ['node'], unique=False)

    op.create_table('gpus',
    sa.Column('gid', sa.Integer(), nullable=False),
    sa.Column('node', sa.String(length=128), nullable=False),
    sa.Column('index', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('job_id', sa.String(length=64), nullable=True),
    sa.Column('worker', sa.String(length=64), nullable=True),
    sa.Column('util', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['node'], ['nodes.name'], ),
    sa.PrimaryKeyConstraint('gid')
    )
    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_gpus_job_id'), ['job_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_gpus_node'), ['node'], unique=False)


def upgrade() -> None:
    _accuracy_and_events()
    _jobs_nodes_throughput_users()
    _workers_and_gpus()


def downgrade() -> None:
    # ### commands auto generated by Alembic - please adjust! ###
    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_gpus_node'))
        batch_op.drop_index(batch_op.f('ix_gpus_job_id'))

    op.drop_table('gpus')
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_workers_node'))
        batch_op.drop_index(batch_op.f('ix_workers_job_id'))

    op.drop_table('workers')
    with op.batch_alter_table('users', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_users_token_hash'))

    op.drop_table('users')
    op.drop_table('throughput')
    op.drop_table('nodes')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_user'))
        batch_op.drop_index(batch_op.f('ix_jobs_state'))

    op.drop_table('jobs')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_events_time'))
        batch_op.drop_index(batch_op.f('ix_events_kind'))
        batch_op.drop_index(batch_op.f('ix_events_job_id'))

    op.drop_table('events')
    op.drop_table('accuracy')
    # ### end Alembic commands ###
